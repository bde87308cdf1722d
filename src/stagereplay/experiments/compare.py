"""Which trajectories are compared, and how: caches layer by layer, suffixes token by token.

Pairs are fixed by the experiment design, never by the data, and always within one checkpoint:
the job list plans them with the trajectories they pair (``design.jobs.comparisons``). The
primary checkpoint runs E1, E2 and E3; any other checkpoint (the outcome-blind replication's)
has only the E1 live and prefill sides of replica 0, so only that pair.
"""

from __future__ import annotations

import pyarrow as pa

from stagereplay.design.divergence import first_divergence
from stagereplay.design.jobs import Comparison
from stagereplay.experiments.difference import cache_difference
from stagereplay.ledger.tables import COMPARISON_SCHEMA, TRAJECTORY_KEY, LedgerError, row_key


def index_trajectories(trajectories: pa.Table) -> dict[tuple, dict]:
    return {row_key(row, TRAJECTORY_KEY): row for row in trajectories.to_pylist()}


def _at(values: list, index: int | None):
    return values[index] if index is not None and index < len(values) else None


def compare_pair(caches, spec: Comparison, a: dict, b: dict) -> dict:
    """One comparison row; ``caches`` (a recompute.CacheSource) gives each row's cache, stored or rebuilt."""
    prefix_equal = a["prefix_object"] == b["prefix_object"]
    if prefix_equal:
        keys, values = cache_difference(caches.state(a), caches.state(b))
    else:
        # Caches over different tokens are not two constructions of one state: no per-layer difference
        # is recorded, and the row is a fault (verify) or a failed reproduction (the audit, whose live
        # side may regenerate another prefix while its rebuilt sides read the saved one).
        keys = values = ()
    differing = [
        (layer, "k" if k.fraction_differ else "v")
        for layer, (k, v) in enumerate(zip(keys, values))
        if k.fraction_differ or v.fraction_differ
    ]
    divergence = first_divergence(a["suffix_tokens"], b["suffix_tokens"])
    return {
        "experiment": spec.experiment,
        "relation": spec.relation,
        "checkpoint": a["checkpoint"],
        "precision": spec.b.precision,
        "item_id": a["item_id"],
        "a": spec.a.label(),
        "b": spec.b.label(),
        "boundary_reason": a["boundary_reason"],
        "prefix_length": a["prefix_length"],
        "prefix_equal": prefix_equal,
        "cache_exact": prefix_equal and not differing,
        "layers_differ": len(differing) if prefix_equal else None,
        "first_differing_layer": differing[0][0] if differing else None,
        "first_differing_kv": differing[0][1] if differing else None,
        "k_max_abs": [d.max_abs for d in keys],
        "k_mean_abs": [d.mean_abs for d in keys],
        "k_fraction_differ": [d.fraction_differ for d in keys],
        "v_max_abs": [d.max_abs for d in values],
        "v_mean_abs": [d.mean_abs for d in values],
        "v_fraction_differ": [d.fraction_differ for d in values],
        "suffix_differs": a["suffix_object"] != b["suffix_object"],
        "first_divergence": divergence,
        "a_margin_at_divergence": _at(a["suffix_margins"], divergence),
        "b_margin_at_divergence": _at(b["suffix_margins"], divergence),
        "a_token_at_divergence": _at(a["suffix_tokens"], divergence),
        "b_token_at_divergence": _at(b["suffix_tokens"], divergence),
        "a_correct": a["correct"],
        "b_correct": b["correct"],
        "a_parsed": a["parsed"],
        "b_parsed": b["parsed"],
        "a_readout_correct": a["readout_correct"],
        "b_readout_correct": b["readout_correct"],
        "label_differs": a["correct"] != b["correct"],
        "trajectory_exact": all(
            a[key] == b[key] for key in ("prefix_object", "cache_object", "layer_k", "layer_v", "suffix_object")
        ),
    }


def comparison_table(trajectories: pa.Table, caches, specs: list[Comparison]) -> pa.Table:
    """Compare the pairs ``specs`` names (each within one checkpoint); every pair must exist for every item."""
    index = index_trajectories(trajectories)
    items = sorted({row["item_id"] for row in trajectories.select(["item_id"]).to_pylist()})
    planned = {spec.a.checkpoint for spec in specs}
    strays = sorted({row["checkpoint"] for row in trajectories.select(["checkpoint"]).to_pylist()} - planned)
    if strays:
        raise LedgerError(
            f"trajectories of checkpoint {strays[0]} are not part of this run's design — rerun snakemake to regather"
        )
    rows = []
    for spec in specs:
        for item_id in items:
            a = index.get(spec.a.key(item_id))
            b = index.get(spec.b.key(item_id))
            if a is None or b is None:
                missing = spec.a if a is None else spec.b
                raise LedgerError(
                    f"item {item_id}: trajectory {missing.label()} of checkpoint {missing.checkpoint} is missing for {spec.experiment} — rerun snakemake to complete the ledger"
                )
            rows.append(compare_pair(caches, spec, a, b))
    return pa.Table.from_pylist(rows, schema=COMPARISON_SCHEMA)
