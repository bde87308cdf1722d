"""From trajectory rows to the E1 comparison table and the figures in summary.json."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa

from .atomic import atomic_write_text
from .ledger import MATCHED_SCHEMA
from .stats import paired_difference_ci, wilson_interval

BOOTSTRAP = {"confidence": 0.95, "n_resamples": 10000, "seed": 0}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix of the other."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def differing_layers(a: dict, b: dict) -> list[int]:
    return [
        layer for layer, (ka, va, kb, vb) in enumerate(zip(a["layer_k"], a["layer_v"], b["layer_k"], b["layer_v"]))
        if ka != kb or va != vb
    ]


def same_trajectory(a: dict, b: dict) -> bool:
    """Replicas are exact when prefix, every cache layer and suffix fingerprints all agree."""
    return all(a[key] == b[key] for key in ("prefix_object", "cache_object", "layer_k", "layer_v", "suffix_object"))


def _index(trajectories: pa.Table) -> dict[tuple, dict]:
    return {
        (row["checkpoint"], row["precision"], row["construction"], row["replica"], row["item_id"]): row
        for row in trajectories.to_pylist()
    }


def matched_rows(trajectories: pa.Table) -> list[dict]:
    """One row per (checkpoint, precision, item) that has live and prefill trajectories."""
    index = _index(trajectories)
    rows = []
    for (checkpoint, precision, construction, replica, item_id), live in sorted(index.items()):
        if construction != "live" or replica != 0:
            continue
        prefill = index.get((checkpoint, precision, "prefill", 0, item_id))
        if prefill is None:
            continue
        live_rep = index.get((checkpoint, precision, "live", 1, item_id))
        prefill_rep = index.get((checkpoint, precision, "prefill", 1, item_id))
        layers = differing_layers(live, prefill)
        rows.append({
            "checkpoint": checkpoint,
            "precision": precision,
            "item_id": item_id,
            "boundary_reason": live["boundary_reason"],
            "prefix_length": live["prefix_length"],
            "cache_differs": live["cache_object"] != prefill["cache_object"],
            "layers_differ": len(layers),
            "first_differing_layer": layers[0] if layers else None,
            "suffix_differs": live["suffix_object"] != prefill["suffix_object"],
            "first_divergence": first_divergence(live["suffix_tokens"], prefill["suffix_tokens"]),
            "live_correct": live["correct"],
            "prefill_correct": prefill["correct"],
            "live_parsed": live["parsed"],
            "prefill_parsed": prefill["parsed"],
            "label_differs": live["correct"] != prefill["correct"],
            "live_replica_exact": None if live_rep is None else same_trajectory(live, live_rep),
            "prefill_replica_exact": None if prefill_rep is None else same_trajectory(prefill, prefill_rep),
        })
    return rows


def proportion(count: int, n: int) -> dict:
    low, high = wilson_interval(count, n) if n else (None, None)
    return {"count": int(count), "n": int(n), "rate": count / n if n else None, "wilson95": [low, high]}


def e1_figures(matched: pa.Table, trajectories: pa.Table) -> dict:
    rows = matched.to_pylist()
    n = len(rows)
    live = [row["live_correct"] for row in rows]
    prefill = [row["prefill_correct"] for row in rows]
    figures = {
        "name": "matched",
        "checkpoint": sorted({row["checkpoint"] for row in rows}),
        "precision": sorted({row["precision"] for row in rows}),
        "items": n,
        "caches_differ": proportion(sum(row["cache_differs"] for row in rows), n),
        "suffixes_differ": proportion(sum(row["suffix_differs"] for row in rows), n),
        "labels_differ": proportion(sum(row["label_differs"] for row in rows), n),
        "accuracy": {"live": proportion(sum(live), n), "prefill": proportion(sum(prefill), n)},
        "unparsable": {
            "live": int(sum(not row["live_parsed"] for row in rows)),
            "prefill": int(sum(not row["prefill_parsed"] for row in rows)),
        },
        "boundary_reasons": dict(Counter(row["boundary_reason"] for row in rows)),
        "replicas_exact": {
            side: {
                "exact": int(sum(bool(row[f"{side}_replica_exact"]) for row in rows)),
                "n": int(sum(row[f"{side}_replica_exact"] is not None for row in rows)),
            }
            for side in ("live", "prefill")
        },
    }
    if n:
        difference, low, high = paired_difference_ci(live, prefill, **BOOTSTRAP)
        figures["paired_difference"] = {
            "live_minus_prefill": difference,
            "ci95": [low, high],
            "method": "paired percentile bootstrap, 10000 resamples, seed 0",
            "discordant": {
                "live_only_correct": int(sum(a and not b for a, b in zip(live, prefill))),
                "prefill_only_correct": int(sum(b and not a for a, b in zip(live, prefill))),
            },
        }
    environments = trajectories.select(
        ["device", "device_name", "threads", "attn_implementation", "torch_version", "transformers_version", "model_fingerprint"]
    ).to_pylist()
    figures["environment"] = [dict(entry) for entry in {tuple(sorted(e.items())) for e in environments}]
    return figures


def matched_table(trajectories: pa.Table) -> pa.Table:
    return pa.Table.from_pylist(matched_rows(trajectories), schema=MATCHED_SCHEMA)


def write_json(data: dict, path: str | Path) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")
