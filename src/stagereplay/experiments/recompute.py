"""A ledger row's boundary cache, whether or not its tensors were stored (``store_caches``).

Every job that needs a row's cache (compare's per-layer Δ, the transplant jobs, the
audit's comparisons) asks a :class:`CacheSource`. It reads the cache object from the
first store that holds it (checked against its name on read, as every object is); when
none does, it rebuilds the cache from the row's saved prefix tokens with the row's own
construction at the row's own precision, on the model the row names:

- ``live`` is rebuilt teacher-forced: the prompt as one forward call, then each saved
  stage token in a forward call of its own. Those are the forward calls live decoding
  made (``decode.decode_greedy`` feeds one token per call after the prompt), which is
  exactly the ``incremental`` construction over the live prefix.
- every other construction is rebuilt by ``constructions.build_boundary_state``, as the
  rebuild job built it.

The rebuilt cache is used only if each layer's K and V fingerprint equals the row's
``layer_k`` / ``layer_v``: a different kernel, thread count or library version that
changed one bit stops the job with one line naming the item, the side and the first
differing layer, instead of computing figures from a state the ledger never held.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from stagereplay.design.jobs import trajectory_label
from stagereplay.engines.base import Engine, Runtime
from stagereplay.engines.registry import load_checkpoint
from stagereplay.experiments.constructions import build_boundary_state
from stagereplay.inputs.checkpoints import read_model_record
from stagereplay.ledger.fingerprint import CacheFingerprint, fingerprint_cache
from stagereplay.ledger.kvstate import KVState, to_host
from stagereplay.ledger.store import ObjectStore, store_cache
from stagereplay.ledger.tables import LedgerError


class CacheMismatch(LedgerError):
    """A rebuilt cache whose fingerprints differ from the ledger's: one line, item, side, layer and fix."""


def rebuild_construction(row: dict) -> str:
    """The construction whose forward calls rebuild ``row``'s cache from its saved prefix."""
    return "incremental" if row["construction"] == "live" else row["construction"]


def first_mismatch(fingerprint: CacheFingerprint, row: dict) -> tuple[int, str] | None:
    """(layer, "K" or "V") of the first layer whose fingerprint differs from the row's; None when all agree."""
    saved_k, saved_v = list(row["layer_k"]), list(row["layer_v"])
    for layer in range(max(len(fingerprint.keys), len(saved_k))):
        for kind, rebuilt, saved in (("K", fingerprint.keys, saved_k), ("V", fingerprint.values, saved_v)):
            if layer >= len(rebuilt) or layer >= len(saved) or rebuilt[layer] != saved[layer]:
                return layer, kind
    return None


def mismatch_message(row: dict, layer: int, kind: str) -> str:
    return (
        f"item {row['item_id']} {trajectory_label(row)} (checkpoint {row['checkpoint']}): the cache rebuilt from the saved"
        f" tokens differs from the ledger's fingerprints at layer {layer} {kind} — this environment does not"
        " reproduce the row (compare its device, threads and versions with the row's); run where the ledger was"
        " written, or rerun the model jobs with store_caches: all"
    )


class ModelPool:
    """The models a job rebuilds caches on: one per (checkpoint, precision), loaded when first needed.

    A job that has loaded its own model already hands it in (``preloaded``), so a
    transplant job loads a second model only for a donor of another precision. Besides
    those, one model is held at a time: loading another drops it, so a compare job holds
    one 14B model, not one per precision (compare takes its pairs one precision at a time).
    """

    def __init__(
        self,
        records: dict[str, str | Path],
        runtime: Runtime,
        preloaded: dict[tuple[str, str], Engine] | None = None,
    ):
        self.records = {name: read_model_record(path) for name, path in records.items()}
        self.runtime = runtime
        self.loaded = dict(preloaded or {})
        self.pinned = set(self.loaded)

    def model_for(self, row: dict) -> Engine:
        checkpoint, precision = row["checkpoint"], row["precision"]
        record = self.records.get(checkpoint)
        if record is None:
            raise LedgerError(
                f"item {row['item_id']} {trajectory_label(row)}: no model record of checkpoint {checkpoint} was given to"
                " rebuild its cache — rerun snakemake (the rule passes every checkpoint's model.json)"
            )
        if row["model_fingerprint"] != record["fingerprint"]:
            raise LedgerError(
                f"item {row['item_id']} {trajectory_label(row)}: the row came from model {row['model_fingerprint']}, not"
                f" {record['fingerprint']} of checkpoint {checkpoint} — rerun the model jobs of this checkpoint"
            )
        key = (checkpoint, precision)
        if key not in self.loaded:
            for other in [other for other in self.loaded if other not in self.pinned]:
                del self.loaded[other]
            self.loaded[key] = load_checkpoint(record, self.runtime.at(precision))
        return self.loaded[key]


class CacheSource:
    """Boundary caches of ledger rows: stored ones read, absent ones rebuilt and checked.

    ``stores`` are searched in order for the cache and the prefix tokens (the audit
    searches its own tree, then the saved ledger). ``models`` is None where nothing may
    be rebuilt. ``keep``: a store the rebuilt caches are written to (``store_caches:
    selected`` in transplant jobs), else None.
    """

    def __init__(self, stores: Sequence[ObjectStore], models: ModelPool | None = None, keep: ObjectStore | None = None):
        self.stores = list(stores)
        self.models = models
        self.keep = keep
        self.rebuilt = 0

    def _holder(self, object_id: str) -> ObjectStore | None:
        return next((store for store in self.stores if store.path_for(object_id).exists()), None)

    def state(self, row: dict) -> KVState:
        holder = self._holder(row["cache_object"])
        if holder is not None:
            return KVState.from_named_tensors(holder.get(row["cache_object"]))
        if self.models is None:
            raise LedgerError(
                f"item {row['item_id']} {trajectory_label(row)}: cache object {row['cache_object']} is not stored and this"
                " job has no model to rebuild it — rerun snakemake (or the model jobs with store_caches: all)"
            )
        return self.rebuild(row)

    def rebuild(self, row: dict) -> KVState:
        """The row's cache rebuilt from its saved tokens, used only when every layer's fingerprint matches."""
        token_holder = self._holder(row["prefix_object"])
        if token_holder is None:
            raise LedgerError(
                f"item {row['item_id']} {trajectory_label(row)}: prefix object {row['prefix_object']} is missing, so its"
                " cache cannot be rebuilt — run stagereplay verify and rerun snakemake"
            )
        prefix = token_holder.get_tokens(row["prefix_object"])
        loaded = self.models.model_for(row)
        state = to_host(build_boundary_state(loaded, list(prefix), rebuild_construction(row), row["prompt_length"]))
        fingerprint = fingerprint_cache(state)
        mismatch = first_mismatch(fingerprint, row)
        if mismatch is None and fingerprint.digest != row["cache_object"]:
            mismatch = (0, "K")  # every layer agrees but the digest does not: the row itself is inconsistent
        if mismatch is not None:
            raise CacheMismatch(mismatch_message(row, *mismatch))
        self.rebuilt += 1
        if self.keep is not None:
            store_cache(self.keep, state, fingerprint.digest, row["model_fingerprint"], row["precision"])
        return state
