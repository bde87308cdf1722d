"""The ledger: a content-addressed object store and the Parquet tables that index it.

Objects are safetensors files named by the fingerprint of the tensors they
hold (``objects/ab/abcdef….safetensors``), so identical artifacts — a live
cache and its bit-exact incremental twin — are stored once. Every object and
every table is written to a temporary name and renamed into place, so an
interrupted job never leaves anything that looks complete.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from .atomic import atomic_write
from .fingerprint import fingerprint_tensors


class LedgerError(RuntimeError):
    """One-line message naming the problem and the fix."""


class ObjectStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path_for(self, object_id: str) -> Path:
        if len(object_id) != 32 or any(c not in "0123456789abcdef" for c in object_id):
            raise LedgerError(f"malformed object id {object_id!r} — ledger rows must name 32-hex-digit xxh3-128 ids")
        return self.root / object_id[:2] / f"{object_id}.safetensors"

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
        atomic_write(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))
        return object_id

    def get(self, object_id: str) -> dict[str, torch.Tensor]:
        path = self.path_for(object_id)
        if not path.exists():
            raise LedgerError(f"object {object_id} missing from {self.root} — rerun the workflow to recreate it")
        return load_file(str(path))

    def put_tokens(self, tokens, metadata: dict[str, str]) -> str:
        return self.put({"tokens": torch.tensor(list(tokens), dtype=torch.int64)}, {"kind": "tokens", **metadata})

    def get_tokens(self, object_id: str) -> list[int]:
        return self.get(object_id)["tokens"].tolist()


# One row per (item, checkpoint, precision, construction, replica, prefix precision):
# a boundary state and its continuation. ``prefix_precision`` names the live run
# whose saved integer prefix was rebuilt (for ``live`` rows: its own precision).
TRAJECTORY_SCHEMA = pa.schema([
    ("checkpoint", pa.string()),
    ("precision", pa.string()),
    ("construction", pa.string()),
    ("replica", pa.int32()),
    ("prefix_precision", pa.string()),
    ("item_id", pa.string()),
    ("model_fingerprint", pa.string()),
    ("prompt_length", pa.int32()),
    ("prefix_length", pa.int32()),
    ("boundary_reason", pa.string()),
    ("reasoning_text", pa.string()),
    ("prefix_object", pa.string()),
    ("cache_object", pa.string()),
    ("cache_positions", pa.int32()),
    ("layer_k", pa.list_(pa.string())),
    ("layer_v", pa.list_(pa.string())),
    ("suffix_object", pa.string()),
    ("suffix_tokens", pa.list_(pa.int64())),
    ("suffix_margins", pa.list_(pa.float32())),
    ("suffix_stop", pa.string()),
    ("suffix_text", pa.string()),
    ("answer", pa.string()),
    ("parsed", pa.bool_()),
    ("correct", pa.bool_()),
    ("device", pa.string()),
    ("device_name", pa.string()),
    ("threads", pa.int32()),
    ("attn_implementation", pa.string()),
    ("tf32", pa.bool_()),
    ("deterministic", pa.bool_()),
    ("torch_version", pa.string()),
    ("transformers_version", pa.string()),
    ("model_seconds", pa.float64()),
])

_PER_LAYER = pa.list_(pa.float64())

# One row per compared pair of trajectories of one item (E1 live vs prefill and
# replicas, E2 incremental vs other constructions, E3 incremental vs live).
COMPARISON_SCHEMA = pa.schema([
    ("experiment", pa.string()),
    ("relation", pa.string()),  # "construction" or "replica"
    ("checkpoint", pa.string()),
    ("precision", pa.string()),
    ("item_id", pa.string()),
    ("a", pa.string()),  # side labels, e.g. "live/bf16/rep0", "prefill/fp32/rep0<-bf16"
    ("b", pa.string()),
    ("boundary_reason", pa.string()),
    ("prefix_length", pa.int32()),
    ("prefix_equal", pa.bool_()),
    ("cache_exact", pa.bool_()),
    ("layers_differ", pa.int32()),
    ("first_differing_layer", pa.int32()),
    ("first_differing_kv", pa.string()),
    ("k_max_abs", _PER_LAYER),
    ("k_mean_abs", _PER_LAYER),
    ("k_fraction_differ", _PER_LAYER),
    ("v_max_abs", _PER_LAYER),
    ("v_mean_abs", _PER_LAYER),
    ("v_fraction_differ", _PER_LAYER),
    ("suffix_differs", pa.bool_()),
    ("first_divergence", pa.int32()),
    ("a_margin_at_divergence", pa.float32()),
    ("b_margin_at_divergence", pa.float32()),
    ("a_token_at_divergence", pa.int64()),
    ("b_token_at_divergence", pa.int64()),
    ("a_correct", pa.bool_()),
    ("b_correct", pa.bool_()),
    ("a_parsed", pa.bool_()),
    ("b_parsed", pa.bool_()),
    ("label_differs", pa.bool_()),
    ("trajectory_exact", pa.bool_()),  # prefix, every cache layer and suffix fingerprints agree
])

# One row per transplant: a donor's cache (part of it) in a recipient's state, continued.
TRANSPLANT_SCHEMA = pa.schema([
    ("selection", pa.string()),  # "selected", "outcome_blind" or "cross_precision"
    ("checkpoint", pa.string()),
    ("item_id", pa.string()),
    ("divergent", pa.bool_()),  # did the donor's and the recipient's own suffixes differ?
    ("donor", pa.string()),  # side labels as in the comparisons table
    ("recipient", pa.string()),
    ("precision", pa.string()),  # of the continuation (the recipient's)
    ("subset", pa.string()),  # e.g. "layers=0-29 kv=kv positions=all"
    ("layers", pa.list_(pa.int32())),
    ("kv", pa.string()),
    ("last_positions", pa.int32()),
    ("outcome", pa.string()),  # follows_donor, follows_recipient or neither
    ("first_divergence_vs_donor", pa.int32()),
    ("first_divergence_vs_recipient", pa.int32()),
    ("cache_digest", pa.string()),
    ("layer_k", pa.list_(pa.string())),
    ("layer_v", pa.list_(pa.string())),
    ("suffix_object", pa.string()),
    ("suffix_tokens", pa.list_(pa.int64())),
    ("suffix_stop", pa.string()),
    ("model_fingerprint", pa.string()),
    ("device", pa.string()),
    ("threads", pa.int32()),
    ("torch_version", pa.string()),
    ("transformers_version", pa.string()),
])

SCHEMAS = {"trajectories": TRAJECTORY_SCHEMA, "comparisons": COMPARISON_SCHEMA, "transplants": TRANSPLANT_SCHEMA}


def write_table(rows: list[dict], schema: pa.Schema, path: str | Path) -> Path:
    """Write rows as Parquet with ``schema``, atomically."""
    table = pa.Table.from_pylist(rows, schema=schema)
    return atomic_write(path, lambda temporary: pq.write_table(table, temporary))


def read_table(path: str | Path, schema: pa.Schema | None = None) -> pa.Table:
    path = Path(path)
    if not path.exists():
        raise LedgerError(f"ledger table {path} not found — run the workflow to create it")
    table = pq.read_table(path)
    if schema is not None and not table.schema.equals(schema):
        raise LedgerError(f"ledger table {path} does not have the expected schema — rerun the workflow to rebuild it")
    return table


def concat_tables(paths: list[str | Path], schema: pa.Schema) -> pa.Table:
    tables = [read_table(path, schema) for path in paths]
    return pa.concat_tables(tables) if tables else schema.empty_table()
