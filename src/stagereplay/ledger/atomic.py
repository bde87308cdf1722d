"""Write a file under a temporary name, then rename it into place.

An interrupted job leaves at most a hidden ``.name.*.tmp`` file, never a
truncated file under the real name.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def _current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(temporary_path)``, then rename the result to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    handle.close()
    temporary = Path(handle.name)
    try:
        write(temporary)
        # mkstemp (and safetensors) create 0600 files; ledgers are shared on clusters, so honour the umask.
        os.chmod(temporary, 0o666 & ~_current_umask())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda temporary: temporary.write_text(text))
