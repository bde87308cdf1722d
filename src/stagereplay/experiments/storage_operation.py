"""Make a ledger's object store hold exactly the cache tensors its ``store_caches`` policy keeps.

A policy decides which tensors are kept, never what a row holds: every row keeps its tokens and
per-layer fingerprints at every policy. So changing the policy of a finished ledger is a storage
operation, not a new run: the tensors the policy no longer keeps are deleted, and the ones it now
asks for are materialised from the saved prefix tokens (the prefix forward passes ``recompute``
makes, each checked against the row's fingerprints before it is stored). Nothing is decoded.

Model jobs store what the policy said when they ran; this operation, run after every job that
writes or reads caches, settles the store whatever they did. Deleting is safe to interrupt: the
policy file already says the tensors may be absent, and each row still names what they were.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagereplay.design.jobs import trajectory_label
from stagereplay.design.storage import check_policy
from stagereplay.experiments.recompute import CacheSource, ModelPool
from stagereplay.ledger.store import ObjectStore


@dataclass(frozen=True)
class StorageChange:
    policy: str
    kept: int  # cache objects the policy keeps, now all stored
    kept_bytes: int
    dropped: int
    dropped_bytes: int
    materialised: int
    materialised_bytes: int

    def line(self) -> str:
        megabytes = 1e6
        return (
            f"storage: store_caches {self.policy} — {self.kept} cache objects kept ({self.kept_bytes / megabytes:.1f} MB),"
            f" {self.dropped} dropped ({self.dropped_bytes / megabytes:.1f} MB),"
            f" {self.materialised} materialised from the saved tokens ({self.materialised_bytes / megabytes:.1f} MB);"
            " nothing decoded"
        )


def kept_caches(policy: str, trajectories: list[dict], transplants: list[dict]) -> set[str]:
    """The cache objects ``policy`` keeps (stagereplay.design.storage says what each policy means)."""
    if check_policy(policy) == "all":
        return {row["cache_object"] for row in trajectories}
    if policy == "none":
        return set()
    # selected: the donors and recipients of E5's transplants.
    sides = {(row["checkpoint"], row["item_id"], row[side]) for row in transplants for side in ("donor", "recipient")}
    return {
        row["cache_object"]
        for row in trajectories
        if (row["checkpoint"], row["item_id"], trajectory_label(row)) in sides
    }


def apply_policy(
    policy: str, store: ObjectStore, trajectories: list[dict], transplants: list[dict], models: ModelPool | None
) -> StorageChange:
    """Delete the cache objects ``policy`` does not keep; materialise the ones it keeps and ``store`` lacks."""
    keep = kept_caches(policy, trajectories, transplants)
    dropped = dropped_bytes = 0
    for object_id in sorted({row["cache_object"] for row in trajectories} - keep):
        path = store.path_for(object_id)
        if path.exists():
            dropped_bytes += path.stat().st_size
            path.unlink()
            dropped += 1
    missing = {}
    for row in trajectories:
        if row["cache_object"] in keep and not store.path_for(row["cache_object"]).exists():
            missing.setdefault(row["cache_object"], row)
    if missing and models is None:
        raise ValueError(
            f"store_caches {policy} keeps {len(missing)} cache objects that are not stored, and no model was given"
            " to materialise them — rerun snakemake (the storage rule passes the model records)"
        )
    caches = CacheSource([store], models, keep=store)
    for row in missing.values():
        caches.state(row)
    materialised_bytes = sum(store.path_for(object_id).stat().st_size for object_id in missing)
    kept_bytes = sum(store.path_for(object_id).stat().st_size for object_id in keep)
    return StorageChange(policy, len(keep), kept_bytes, dropped, dropped_bytes, len(missing), materialised_bytes)
