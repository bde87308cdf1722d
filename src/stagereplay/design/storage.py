"""Which boundary caches a ledger keeps as tensors: the ``store_caches`` policy, in one place.

Every row keeps its tokens, its per-layer K/V fingerprints and (comparison rows) its
per-layer Δ statistics at every setting; only the cache *tensors* are optional, since
they are most of a ledger's bytes (a 14B model's bf16 cache is ~190 KB per position):

- ``all``: every boundary cache is stored (the behaviour before the key existed).
- ``selected``: only the caches a transplant reads (E5 and its audit): the donors and
  recipients of the ``selected``, ``outcome_blind`` and ``cross_precision`` transplants.
  The selection is known only after E1 has been compared, when the model jobs that
  built those caches are long done; so model jobs store no cache, and the transplant
  jobs, which must hold those caches anyway, store each one they rebuilt (after its
  fingerprints matched the ledger's). That costs no model job of its own and stores
  exactly the caches the selection names, and a later transplant job or audit reads
  them instead of rebuilding them.
- ``none``: no cache tensor is stored; every job that needs a cache rebuilds it from
  the saved tokens (``recompute.py``).

Every ledger names its policy in ``storage.json`` (a ledger without it was written at
``all``, like every ledger before the key), so ``verify`` knows when a cache object named
by a row may be absent on purpose. The policy is no job's parameter: a job reads it there
when it stores (``store_policy``), and the storage rule (``experiments.storage_operation``)
settles the store after every job, so a new policy on a finished ledger deletes or
materialises tensors and reruns nothing. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path

from stagereplay.ledger.layout import LedgerLayout

POLICIES = ("all", "selected", "none")
DEFAULT = "all"


class StorageError(ValueError):
    """One-line message naming the problem and the fix."""


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise StorageError(f"store_caches {policy!r} is not a policy — use one of {', '.join(POLICIES)}")
    return policy


def model_jobs_store(policy: str) -> bool:
    """Do the live and rebuild jobs store the caches they build?"""
    return check_policy(policy) == "all"


def transplant_jobs_store(policy: str) -> bool:
    """Do transplant jobs store the donor and recipient caches they rebuilt (not found stored)?"""
    return check_policy(policy) == "selected"


def caches_may_be_absent(policy: str) -> bool:
    return check_policy(policy) != "all"


def storage_document(policy: str) -> dict:
    meaning = (
        "every cache object named by a ledger row is stored"
        if check_policy(policy) == "all"
        else "cache objects named by ledger rows may be absent; their fingerprints are in the rows,"
        " and jobs rebuild them from the saved tokens, checked against those fingerprints"
    )
    return {"store_caches": policy, "meaning": meaning}


def store_policy(store_root: str | Path) -> str:
    """The policy of the ledger whose object store is ``store_root`` (what a model job reads when it stores)."""
    return read_policy(LedgerLayout(Path(store_root).parent).storage)


def read_policy(path: str | Path) -> str:
    """The policy a ledger was written at: that of its storage.json, ``all`` without one."""
    path = Path(path)
    if not path.is_file():
        return DEFAULT
    try:
        policy = json.loads(path.read_text()).get("store_caches")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        policy = None
    if policy not in POLICIES:
        raise StorageError(
            f"{path} names no store_caches policy ({', '.join(POLICIES)}) — rerun snakemake to rewrite it"
        )
    return policy
