"""From the ledger tables to the figures in summary.json: E1, E2 and E3 per checkpoint, E5 and E6.

This is the one step that computes statistics: every x/N with its Wilson interval, and E1's
paired accuracy difference by bootstrap, Newcombe and Wald beside the exact McNemar test. The
card, its reading and the plots only render what is here.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa

from stagereplay.engines.registry import SPECS
from stagereplay.ledger.atomic import atomic_write_text
from stagereplay.ledger.environment import ENVIRONMENT_COLUMNS
from stagereplay.ledger.tables import checkpoint_order
from stagereplay.report.factor_summary import e6_controls, e6_summary
from stagereplay.report.margins import bf16_logits, e1_flip_margins
from stagereplay.report.placement_rule import placement_rule
from stagereplay.report.precision_overlap import precision_overlap
from stagereplay.report.served_summary import served_summary
from stagereplay.report.stats import (
    MCNEMAR,
    mcnemar_exact,
    paired_difference_ci,
    paired_difference_newcombe,
    paired_difference_wald,
    share,
)
from stagereplay.report.transplant_summary import e5_summary

BOOTSTRAP = {"confidence": 0.95, "n_resamples": 10000, "seed": 0}
NEWCOMBE = "Newcombe hybrid score 95% (1998, method 10)"
WALD = "Wald 95% for paired proportions"


def _rows(comparisons: pa.Table, experiment: str, relation: str = "construction") -> list[dict]:
    return [row for row in comparisons.to_pylist() if row["experiment"] == experiment and row["relation"] == relation]


def per_checkpoint(comparisons: pa.Table, experiment: str, figures) -> dict:
    """``figures`` of each checkpoint's own rows: two models' rows are never pooled."""
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in comparisons.to_pylist():
        if row["experiment"] == experiment:
            grouped[row["checkpoint"]].append(row)
    return {
        checkpoint: figures(grouped[checkpoint])
        for checkpoint in checkpoint_order(comparisons)
        if checkpoint in grouped
    }


# The two correctness labels of every trajectory: the parsed "Answer: X" line (no such line counts as
# wrong) and the forced-choice readout after the answer cue (every trajectory has one).
LABELINGS = {
    "parsed": ("a_correct", "b_correct"),
    "readout": ("a_readout_correct", "b_readout_correct"),
}


def e1_summary(rows: list[dict], engines: dict[str, str]) -> dict:
    """E1 of one checkpoint, from its construction and replica rows; ``engines``: each checkpoint's engine (from
    the trajectories: the comparison rows do not name it), which says whether its logits are bf16 values."""
    pairs = [row for row in rows if row["relation"] == "construction"]
    n = len(pairs)
    replicas: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        if row["relation"] == "replica":
            replicas[row["a"].split("/")[0]].append(row["trajectory_exact"])
    labelings = {
        name: labeling_figures([row[a] for row in pairs], [row[b] for row in pairs])
        for name, (a, b) in LABELINGS.items()
    }
    parsed = labelings["parsed"]
    figures = {
        "pair": sorted({f"{row['a']} vs {row['b']}" for row in pairs}),
        "precision": pairs[0]["precision"] if pairs else None,
        "items": n,
        "caches_differ": share(sum(not row["cache_exact"] for row in pairs), n),
        "suffixes_differ": share(sum(row["suffix_differs"] for row in pairs), n),
        # The parsed labeling's figures, under their original keys; both labelings under `labelings`.
        "labels_differ": parsed["labels_differ"],
        "accuracy": parsed["accuracy"],
        "labelings": labelings,
        "unparsable": {
            "live": share(sum(not row["a_parsed"] for row in pairs), n),
            "prefill": share(sum(not row["b_parsed"] for row in pairs), n),
        },
        "boundary_reasons": dict(Counter(row["boundary_reason"] for row in pairs)),
        # Items whose stage ended at EOS before the boundary: nothing is continued, so their suffixes agree by
        # construction; the card shows them apart from the divergence counts they sit in.
        "stage_ended_at_eos": share(sum(row["boundary_reason"] == "eos" for row in pairs), n),
        "flip_margins": e1_flip_margins(
            pairs, bool(pairs) and bf16_logits(SPECS.get(engines.get(pairs[0]["checkpoint"])), pairs[0]["precision"])
        ),
        # Replicas that reproduced their side exactly; n = 0 (one replica) is "not measured", never "all exact".
        "replicas_exact": {
            side: share(sum(replicas.get(side, [])), len(replicas.get(side, []))) for side in ("live", "prefill")
        },
    }
    if n:
        figures["paired_difference"] = parsed["paired_difference"]
    return figures


def labeling_figures(live: list[bool], prefill: list[bool]) -> dict:
    """One labeling of the E1 pairs: accuracy of each side, labels that differ, the paired difference."""
    n = len(live)
    figures = {
        "accuracy": {"live": share(sum(live), n), "prefill": share(sum(prefill), n)},
        "labels_differ": share(sum(a != b for a, b in zip(live, prefill)), n),
    }
    if n:
        difference, low, high = paired_difference_ci(live, prefill, **BOOTSTRAP)
        live_only, prefill_only, p_value = mcnemar_exact(live, prefill)
        figures["paired_difference"] = {
            "live_minus_prefill": difference,
            "ci95": [low, high],
            "method": "paired percentile bootstrap, 10000 resamples, seed 0",
            "discordant": {
                "live_only_correct": int(sum(a and not b for a, b in zip(live, prefill))),
                "prefill_only_correct": int(sum(b and not a for a, b in zip(live, prefill))),
            },
            **{
                key: _difference(function(live, prefill), method)
                for key, function, method in (
                    ("newcombe", paired_difference_newcombe, NEWCOMBE),
                    ("wald", paired_difference_wald, WALD),
                )
            },
            "mcnemar": {
                "live_only_correct": live_only,
                "prefill_only_correct": prefill_only,
                "p_value": float(p_value),
                "method": MCNEMAR,
            },
        }
    return figures


def _difference(result: tuple[float, float, float], method: str) -> dict:
    difference, low, high = result
    return {"live_minus_prefill": float(difference), "ci95": [float(low), float(high)], "method": method}


def e2_summary(rows: list[dict]) -> dict:
    """One checkpoint's E2: per precision and construction, decoded disagreements with incremental."""
    grouped: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        grouped[(row["precision"], row["b"].split("/")[0])].append(row)
    by_precision: dict[str, dict] = defaultdict(dict)
    for (precision, construction), group in sorted(grouped.items()):
        n = len(group)
        by_precision[precision][f"incremental_vs_{construction}"] = {
            "decoded_disagreements": share(sum(row["suffix_differs"] for row in group), n),
            "labels_differ": share(sum(row["label_differs"] for row in group), n),
            "caches_differ": share(sum(not row["cache_exact"] for row in group), n),
            "accuracy": {
                group[0][column].split("/")[0]: share(sum(row[f"{column}_correct"] for row in group), n)
                for column in ("a", "b")
            },
            "median_first_divergence": _median([row["first_divergence"] for row in group if row["suffix_differs"]]),
        }
    return {"precisions": dict(by_precision)}


def e3_summary(rows: list[dict]) -> dict:
    """One checkpoint's E3: per precision, is token-by-token incremental bit-exact with the retained live cache?"""
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        grouped[row["precision"]].append(row)
    figures = {}
    for precision, group in sorted(grouped.items()):
        not_exact = [row for row in group if not row["cache_exact"]]
        figures[precision] = {
            "bit_exact": share(len(group) - len(not_exact), len(group)),
            "suffixes_identical": share(sum(not row["suffix_differs"] for row in group), len(group)),
            "not_exact": [
                {
                    "item_id": row["item_id"],
                    "first_differing_layer": row["first_differing_layer"],
                    "kv": row["first_differing_kv"],
                }
                for row in not_exact
            ],
        }
    return {"precisions": figures}


def _median(values: list[int]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return float(ordered[middle]) if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def environment(trajectories: pa.Table) -> list[dict]:
    columns = ["checkpoint", "precision", *ENVIRONMENT_COLUMNS, "model_fingerprint"]
    unique = {tuple(row.items()) for row in trajectories.select(columns).to_pylist()}
    return [dict(entry) for entry in sorted(unique)]


def summary(
    comparisons: pa.Table,
    trajectories: pa.Table,
    version: str,
    transplants: pa.Table | None = None,
    factors: pa.Table | None = None,
    served: pa.Table | None = None,
) -> dict:
    """Every figure of a run, from its tables alone (so verify can recompute and check it)."""
    order = checkpoint_order(comparisons)
    engines = {row["checkpoint"]: row["engine"] for row in trajectories.select(["checkpoint", "engine"]).to_pylist()}
    result = {
        "stagereplay_version": version,
        "checkpoints": order,
        "E1": {
            "name": "matched",
            "checkpoints": per_checkpoint(comparisons, "E1", lambda rows: e1_summary(rows, engines)),
        },
        "E2": {
            "name": "fixed_prefix",
            "prefix": "E1 live trajectory (never regenerated)",
            "checkpoints": per_checkpoint(comparisons, "E2", e2_summary),
        },
        "E3": {"name": "bridge", "checkpoints": per_checkpoint(comparisons, "E3", e3_summary)},
    }
    _add_precision_overlap(result, comparisons.to_pylist())
    if transplants is not None:
        result["E5"] = e5_summary(transplants, order[0] if order else None)
    if factors is not None:
        factor_rows = factors.to_pylist()
        result["E6"] = e6_summary(factors)
        result["E6"]["controls"] = e6_controls(factor_rows)
        rule = placement_rule(factor_rows, trajectories.to_pylist())
        if rule is not None:
            result["E6"]["placement_rule"] = rule
    if served is not None:
        result["served"] = served_summary(served)
    result["environment"] = environment(trajectories)
    return result


def _add_precision_overlap(result: dict, comparison_rows: list[dict]) -> None:
    """Each checkpoint's E2, where it ran at another precision than E1's: whether that precision's live-vs-prefill
    differences sit on the E1 precision's items (report.precision_overlap)."""
    e1_precision = {row["checkpoint"]: row["precision"] for row in comparison_rows if row["experiment"] == "E1"}
    for checkpoint, e2 in result["E2"]["checkpoints"].items():
        rows = [row for row in comparison_rows if (row["experiment"], row["checkpoint"]) == ("E2", checkpoint)]
        overlap = precision_overlap(rows, e1_precision.get(checkpoint, ""))
        if overlap:
            e2["precision_overlap"] = overlap


def write_json(data: dict, path: str | Path) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")
