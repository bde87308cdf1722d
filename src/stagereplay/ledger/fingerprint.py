"""xxh3-128 fingerprints of tensors, hashed from their buffers without copies, and of files and bytes.

A fingerprint folds dtype and shape into the hash, so two tensors with the same
bytes but a different layout never collide. Bytes are little-endian (the
native order of every platform torch ships for); the buffer is hashed through a
memoryview of a uint8 view of the tensor, never through a ``tobytes()`` copy.

``bytes_digest`` and ``file_digest`` are the one digest of raw bytes (a file's is
streamed, never read whole): model files, tokenizer files, item files, the card's
stamp and table rows are all hashed through them. torch is imported only by the
tensor functions, so the file and bytes digests need no torch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

    from stagereplay.ledger.kvstate import KVState

if sys.byteorder != "little":  # pragma: no cover - no such torch platform today
    raise RuntimeError("stagereplay fingerprints assume a little-endian host")


FILE_BLOCK = 1 << 24  # bytes read at a time: the digest is the same for any block size


def bytes_digest(data: bytes | memoryview) -> str:
    """Hex xxh3-128 of raw bytes."""
    return xxhash.xxh3_128(data).hexdigest()


def file_digest(path: str | Path) -> str:
    """Hex xxh3-128 of a file's bytes, read in blocks: ``bytes_digest`` of its content."""
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(FILE_BLOCK), b""):
            hasher.update(block)
    return hasher.hexdigest()


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (a device tensor is copied to host once)."""
    import torch

    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def fingerprint_tensor(tensor: torch.Tensor) -> str:
    """Hex xxh3-128 of dtype, shape and raw bytes."""
    hasher = xxhash.xxh3_128()
    hasher.update(f"{str(tensor.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}|".encode())
    hasher.update(tensor_buffer(tensor))
    return hasher.hexdigest()


def fingerprint_tokens(tokens: Iterable[int]) -> str:
    """Fingerprint of a token sequence, as the int64 tensor it is stored as."""
    import torch

    return fingerprint_tensor(torch.tensor(list(tokens), dtype=torch.int64))


def combine(named_digests: Iterable[tuple[str, str]]) -> str:
    """One digest over (name, digest) pairs, in the order given."""
    hasher = xxhash.xxh3_128()
    for name, digest in named_digests:
        hasher.update(f"{name}={digest};".encode())
    return hasher.hexdigest()


def fingerprint_tensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """Digest of a named set of tensors (sorted by name): the id of a stored object."""
    return combine((name, fingerprint_tensor(tensors[name])) for name in sorted(tensors))


@dataclass(frozen=True)
class CacheFingerprint:
    keys: tuple[str, ...]  # one xxh3-128 per layer
    values: tuple[str, ...]
    digest: str  # over all layer fingerprints: the cache's object id


def fingerprint_cache(state: KVState) -> CacheFingerprint:
    keys = tuple(fingerprint_tensor(key) for key in state.keys)
    values = tuple(fingerprint_tensor(value) for value in state.values)
    # The digest is fingerprint_tensors(state.named_tensors()), combined from the layer
    # digests just computed rather than hashing every tensor a second time.
    named = dict(zip(state.named_tensors(), (digest for pair in zip(keys, values) for digest in pair)))
    return CacheFingerprint(keys=keys, values=values, digest=combine((name, named[name]) for name in sorted(named)))
