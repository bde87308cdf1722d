"""From the comparison table to the figures in summary.json (E1, E2, E3)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa

from .atomic import atomic_write_text
from .ledger import ENVIRONMENT_COLUMNS
from .stats import paired_difference_ci, wilson_interval

BOOTSTRAP = {"confidence": 0.95, "n_resamples": 10000, "seed": 0}


def proportion(count: int, n: int) -> dict:
    low, high = wilson_interval(count, n) if n else (None, None)
    return {"count": int(count), "n": int(n), "rate": count / n if n else None, "wilson95": [low, high]}


def _rows(comparisons: pa.Table, experiment: str, relation: str = "construction") -> list[dict]:
    return [row for row in comparisons.to_pylist() if row["experiment"] == experiment and row["relation"] == relation]


def e1_figures(comparisons: pa.Table) -> dict:
    rows = _rows(comparisons, "E1")
    n = len(rows)
    live = [row["a_correct"] for row in rows]
    prefill = [row["b_correct"] for row in rows]
    replicas: dict[str, list[bool]] = defaultdict(list)
    for row in _rows(comparisons, "E1", "replica"):
        replicas[row["a"].split("/")[0]].append(row["trajectory_exact"])
    figures = {
        "name": "matched",
        "pair": sorted({f"{row['a']} vs {row['b']}" for row in rows}),
        "items": n,
        "caches_differ": proportion(sum(not row["cache_exact"] for row in rows), n),
        "suffixes_differ": proportion(sum(row["suffix_differs"] for row in rows), n),
        "labels_differ": proportion(sum(row["label_differs"] for row in rows), n),
        "accuracy": {"live": proportion(sum(live), n), "prefill": proportion(sum(prefill), n)},
        "unparsable": {
            "live": int(sum(not row["a_parsed"] for row in rows)),
            "prefill": int(sum(not row["b_parsed"] for row in rows)),
        },
        "boundary_reasons": dict(Counter(row["boundary_reason"] for row in rows)),
        "replicas_exact": {
            side: {"exact": int(sum(replicas.get(side, []))), "n": len(replicas.get(side, []))}
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
    return figures


def e2_figures(comparisons: pa.Table) -> dict:
    """Per precision and construction: decoded disagreements with incremental, over fixed prefixes."""
    grouped: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in _rows(comparisons, "E2"):
        grouped[(row["precision"], row["b"].split("/")[0])].append(row)
    by_precision: dict[str, dict] = defaultdict(dict)
    for (precision, construction), rows in sorted(grouped.items()):
        n = len(rows)
        by_precision[precision][f"incremental_vs_{construction}"] = {
            "decoded_disagreements": proportion(sum(row["suffix_differs"] for row in rows), n),
            "labels_differ": proportion(sum(row["label_differs"] for row in rows), n),
            "caches_differ": proportion(sum(not row["cache_exact"] for row in rows), n),
            "median_first_divergence": _median([row["first_divergence"] for row in rows if row["suffix_differs"]]),
        }
    return {"name": "fixed_prefix", "prefix": "E1 live trajectory (never regenerated)", "precisions": dict(by_precision)}


def e3_figures(comparisons: pa.Table) -> dict:
    """Per precision: is token-by-token incremental bit-exact with the retained live cache?"""
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in _rows(comparisons, "E3"):
        grouped[row["precision"]].append(row)
    figures = {}
    for precision, rows in sorted(grouped.items()):
        not_exact = [row for row in rows if not row["cache_exact"]]
        figures[precision] = {
            "bit_exact": {"exact": len(rows) - len(not_exact), "n": len(rows)},
            "suffixes_identical": {"identical": sum(not row["suffix_differs"] for row in rows), "n": len(rows)},
            "not_exact": [
                {"item_id": row["item_id"], "first_differing_layer": row["first_differing_layer"],
                 "kv": row["first_differing_kv"]}
                for row in not_exact
            ],
        }
    return {"name": "bridge", "precisions": figures}


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


def _is_all_layers(row: dict, num_layers: int) -> bool:
    return row["kv"] == "kv" and row["last_positions"] is None and len(row["layers"]) == num_layers


def e5_figures(transplants: pa.Table, notes: dict) -> dict:
    """Follows-donor counts over divergent items: all layers per selection, the sweep, cross-precision."""
    rows = [row for row in transplants.to_pylist() if row["divergent"]]
    num_layers = max((len(row["layer_k"]) for row in rows), default=0)
    figures: dict = {"name": "transplant", "counted": "divergent items only (donor and recipient suffixes differ)"}
    figures.update(notes)
    all_layers: dict[str, dict] = {}
    for selection in ("selected", "outcome_blind"):
        for checkpoint in sorted({row["checkpoint"] for row in rows if row["selection"] == selection}):
            chosen = [row for row in rows if row["selection"] == selection and row["checkpoint"] == checkpoint
                      and _is_all_layers(row, num_layers)]
            all_layers[f"{selection}/{checkpoint}"] = {
                "follows_donor": proportion(sum(row["outcome"] == "follows_donor" for row in chosen), len(chosen)),
                "follows_recipient": int(sum(row["outcome"] == "follows_recipient" for row in chosen)),
                "neither": int(sum(row["outcome"] == "neither" for row in chosen)),
                "by_direction": {
                    direction: f"{sum(r['outcome'] == 'follows_donor' for r in group)}/{len(group)}"
                    for direction, group in _group(chosen, lambda r: f"{r['donor']} -> {r['recipient']}").items()
                },
            }
    figures["all_layers"] = all_layers
    sweep_rows = [row for row in rows if row["selection"] == "selected"]
    sweep = []
    for subset, group in _group(sweep_rows, lambda r: r["subset"]).items():
        followed = sum(row["outcome"] == "follows_donor" for row in group)
        sweep.append({"subset": subset, "layers": len(group[0]["layers"]), "kv": group[0]["kv"],
                      "positions": group[0]["last_positions"], "follows_donor": followed, "n": len(group),
                      "fraction": followed / len(group)})
    figures["sweep"] = sweep
    sufficient = [entry for entry in sweep if entry["fraction"] == 1.0 and entry["kv"] == "kv" and entry["positions"] is None]
    figures["smallest_sufficient_layer_set"] = min(sufficient, key=lambda e: e["layers"])["subset"] if sufficient else None
    cross = [row for row in rows if row["selection"] == "cross_precision"]
    figures["cross_precision"] = {
        f"{direction}": proportion(sum(r["outcome"] == "follows_donor" for r in group), len(group))
        for direction, group in _group(cross, lambda r: f"{r['donor']} -> {r['recipient']}").items()
    }
    return figures


def _group(rows: list[dict], key) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        grouped[key(row)].append(row)
    return dict(sorted(grouped.items()))


def summary(comparisons: pa.Table, trajectories: pa.Table, version: str,
            transplants: pa.Table | None = None, notes: dict | None = None) -> dict:
    result = {
        "stagereplay_version": version,
        "E1": e1_figures(comparisons),
        "E2": e2_figures(comparisons),
        "E3": e3_figures(comparisons),
    }
    if transplants is not None:
        result["E5"] = e5_figures(transplants, notes or {})
    result["environment"] = environment(trajectories)
    return result


def write_json(data: dict, path: str | Path) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2) + "\n")
