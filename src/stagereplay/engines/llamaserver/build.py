"""The built ``llama-server`` and its build record: where the set-up installs it, what it was built from.

The server binary is built from the llama.cpp tree vendored in the pinned llama-cpp-python sdist
(``envs/build_llama_server.sh``, run by ``SPEC=envs/llamaserver.txt bash envs/setup.sh``), so its slot
files hold the same sequence state format as the one ``llamacpp.state`` parses. The build writes a record
beside the binary (``llama-server.json``: the binding version, the vendored commit, the CMake flags and
the CPU features); ``server_binary`` refuses a binary that is missing or was built for another version,
and ``server_build`` gives the record every row of a server run names. No torch here.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from stagereplay.engines.spec import ModelError

BINARY = "llama-server"
SETUP = "SPEC=envs/llamaserver.txt bash envs/setup.sh"


class LlamaServerError(ModelError):
    """One line: what the server (or its binary) did wrong, and the fix where there is one."""


# The binary and its build record.


def binary_path() -> Path:
    """Where the set-up installs the server: beside this environment's Python."""
    return Path(sys.prefix) / "bin" / BINARY


@dataclass(frozen=True)
class ServerBuild:
    """The build record ``envs/build_llama_server.sh`` wrote beside the binary."""

    llama_cpp_python: str  # the binding whose vendored llama.cpp tree was built
    llama_cpp_commit: str  # that tree's commit, as the sdist's changelog names it ("unknown" if it does not)
    cmake_flags: tuple[str, ...]
    march_native: str  # what the compiler's -march=native resolved to on the build machine
    cpu_features: tuple[str, ...]  # the instruction sets the kernels were compiled for
    version_output: str  # what ``llama-server --version`` printed

    def describe(self) -> str:
        """The build in one line, for a row's environment."""
        return (
            f"llama-server of llama-cpp-python {self.llama_cpp_python} (llama.cpp {self.llama_cpp_commit});"
            f" {' '.join(self.cmake_flags)}; -march=native={self.march_native}; {' '.join(self.cpu_features)}"
        )


def server_build(binary: Path | None = None) -> ServerBuild:
    """The build record of ``binary`` (the installed server by default); one line if it has none."""
    binary = binary or binary_path()
    record = binary.with_name(binary.name + ".json")
    try:
        data = json.loads(record.read_text())
        return ServerBuild(
            llama_cpp_python=str(data["llama_cpp_python"]),
            llama_cpp_commit=str(data["llama_cpp_commit"]),
            cmake_flags=tuple(data["cmake_flags"]),
            march_native=str(data["march_native"]),
            cpu_features=tuple(data["cpu_features"]),
            version_output=str(data["version_output"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = "has no build record" if isinstance(error, OSError) else f"has an unreadable build record ({error!r})"
        raise LlamaServerError(f"{binary} {problem} ({record}) — run {SETUP}") from None


def installed_binding_version() -> str | None:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def server_binary(binary: Path | None = None) -> Path:
    """The installed server (or ``binary``), checked: present, executable, built from the installed binding's tree."""
    binary = Path(binary) if binary is not None else binary_path()
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise LlamaServerError(f"llama-server is not built ({binary} is missing) — run {SETUP}")
    built_for = server_build(binary).llama_cpp_python
    installed = installed_binding_version()
    if built_for != installed:
        raise LlamaServerError(
            f"llama-server at {binary} was built from llama-cpp-python {built_for}, the installed one is {installed or 'none'} — run {SETUP}"
        )
    return binary
