"""The ledger's content-addressed object store: safetensors files named by their fingerprint.

Objects are safetensors files named by the fingerprint of the tensors they
hold (``objects/ab/abcdef….safetensors``), so identical artifacts — a live
cache and its bit-exact incremental twin — are stored once. Every object is
written to a temporary name and renamed into place, so an interrupted job never
leaves anything that looks complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from stagereplay.ledger.atomic import atomic_write
from stagereplay.ledger.fingerprint import fingerprint_tensors
from stagereplay.ledger.kvstate import KVState
from stagereplay.ledger.tables import LedgerError, is_object_id

OBJECT_SUFFIX = ".safetensors"


def canonical_safetensors(data: bytes) -> bytes:
    """The same safetensors file with its header in one fixed order, so equal content is equal bytes.

    safetensors writes ``__metadata__`` in hash-map order, which differs between processes; the
    tensor entries' offsets are relative to the end of the header, so re-serialising the header
    (sorted metadata first, then the tensors in the order written, padded with spaces to 8 bytes as
    safetensors itself pads) leaves the tensor bytes and their offsets as they are.
    """
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    metadata = header.pop("__metadata__", None)
    ordered = ({"__metadata__": dict(sorted(metadata.items()))} if metadata else {}) | header
    text = json.dumps(ordered, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + length :]


class ObjectStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path_for(self, object_id: str) -> Path:
        if not is_object_id(object_id):
            raise LedgerError(f"malformed object id {object_id!r} — ledger rows must name 32-hex-digit xxh3-128 ids")
        return self.root / object_id[:2] / f"{object_id}{OBJECT_SUFFIX}"

    def put(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str], object_id: str | None = None) -> str:
        """Store tensors (on host, contiguous) under their fingerprint; a no-op if already stored.

        ``object_id`` skips rehashing when the caller has just fingerprinted the same tensors.
        """
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
        object_id = object_id or fingerprint_tensors(tensors)
        path = self.path_for(object_id)
        if path.exists():
            return object_id
        metadata = {key: str(value) for key, value in metadata.items()}
        data = canonical_safetensors(safetensors_bytes(tensors, metadata=metadata))
        atomic_write(path, lambda temporary: temporary.write_bytes(data))
        return object_id

    def get(self, object_id: str) -> dict[str, torch.Tensor]:
        """The tensors of an object, checked against its name: a corrupt object is never used."""
        tensors = self.load_unchecked(object_id)
        actual = fingerprint_tensors(tensors)
        if actual != object_id:
            raise LedgerError(
                f"object {object_id} in {self.root} is corrupt (its content hashes to {actual}) — run stagereplay verify, delete it and rerun the workflow"
            )
        return tensors

    def load_unchecked(self, object_id: str) -> dict[str, torch.Tensor]:
        path = self.path_for(object_id)
        if not path.exists():
            raise LedgerError(f"object {object_id} missing from {self.root} — rerun the workflow to recreate it")
        try:
            # safetensors only: a header and raw buffers, never pickle.
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as error:
            raise LedgerError(
                f"object {object_id} in {self.root} is unreadable ({error}) — run stagereplay verify, delete it and rerun the workflow"
            ) from None

    def object_ids(self) -> list[str]:
        """Every stored object, by id (temporary files of interrupted writes are not objects)."""
        return sorted(
            path.name.removesuffix(OBJECT_SUFFIX)
            for path in self.root.glob(f"??/*{OBJECT_SUFFIX}")
            if not path.name.startswith(".")
        )

    def put_tokens(self, tokens) -> str:
        # The metadata says only what the content determines: one token list can be a prefix, a suffix
        # and a transplant suffix at once, and whichever job stored it first must not decide its bytes.
        return self.put({"tokens": torch.tensor(list(tokens), dtype=torch.int64)}, {"kind": "tokens"})

    def get_tokens(self, object_id: str) -> list[int]:
        return self.get(object_id)["tokens"].tolist()


def store_cache(store: ObjectStore, state: KVState, digest: str, model_fingerprint: str, precision: str) -> str:
    """Store a boundary cache as the object ``digest`` (its fingerprint), with what built it as metadata."""
    metadata = {"model_fingerprint": model_fingerprint, "precision": precision}
    return store.put(
        state.named_tensors(),
        {"kind": "kv_cache", "positions": f"0:{state.num_positions}", **metadata},
        object_id=digest,
    )
