"""E5's figures in summary.json: follows-donor counts over divergent items, for the all-layer transplants
of each selection (items following the donor both ways counted over items), the layer sweep, and the
cross-precision casts."""

from __future__ import annotations

import pyarrow as pa

from stagereplay.report.stats import grouped, share


def _is_all_layers(row: dict) -> bool:
    """Every layer of the row's own model (checkpoints may differ in depth), K and V, every position."""
    return row["kv"] == "kv" and row["last_positions"] is None and len(row["layers"]) == len(row["layer_k"])


def _counted(rows: list[dict], outcome: str) -> dict:
    return share(sum(row["outcome"] == outcome for row in rows), len(rows))


def _follows_donor(rows: list[dict]) -> dict:
    return _counted(rows, "follows_donor")


def _items_following_both_ways(rows: list[dict]) -> dict:
    """Divergent items whose continuation follows the donor in every direction it was transplanted (live into
    prefill and back), x/N over items: an item's two directions are one observation, not two."""
    by_item = grouped(rows, lambda r: r["item_id"])
    return share(
        sum(all(row["outcome"] == "follows_donor" for row in group) for group in by_item.values()), len(by_item)
    )


def e5_summary(transplants: pa.Table, primary: str | None) -> dict:
    """Follows-donor counts over divergent items: all layers per selection, the sweep, cross-precision."""
    every = transplants.to_pylist()
    rows = [row for row in every if row["divergent"]]
    figures: dict = {"name": "transplant", "counted": "divergent items only (donor and recipient suffixes differ)"}
    blind = sorted({row["checkpoint"] for row in every if row["selection"] == "outcome_blind"})
    if blind:
        figures["outcome_blind_checkpoint"] = (
            f"the outcome-blind replication uses the primary checkpoint {primary!r} again (no second checkpoint is"
            " configured): it repeats the test on a seeded sample, not on a later checkpoint"
            if blind == [primary]
            else f"outcome-blind replication on checkpoint {', '.join(map(repr, blind))}"
        )
    all_layers: dict[str, dict] = {}
    for selection in ("selected", "outcome_blind"):
        for checkpoint in sorted({row["checkpoint"] for row in rows if row["selection"] == selection}):
            chosen = [
                row
                for row in rows
                if row["selection"] == selection and row["checkpoint"] == checkpoint and _is_all_layers(row)
            ]
            all_layers[f"{selection}/{checkpoint}"] = (
                {"items_follow_donor_both_ways": _items_following_both_ways(chosen)}
                | {outcome: _counted(chosen, outcome) for outcome in ("follows_donor", "follows_recipient", "neither")}
                | {
                    "by_direction": {
                        direction: _follows_donor(group)
                        for direction, group in grouped(chosen, lambda r: f"{r['donor']} -> {r['recipient']}").items()
                    }
                }
            )
    figures["all_layers"] = all_layers
    sweep_rows = [row for row in rows if row["selection"] == "selected"]
    sweep = []
    for subset, group in grouped(sweep_rows, lambda r: r["subset"]).items():
        sweep.append(
            {
                "subset": subset,
                "layers": len(group[0]["layers"]),
                "kv": group[0]["kv"],
                "positions": group[0]["last_positions"],
                "follows_donor": _follows_donor(group),
            }
        )
    figures["sweep"] = sweep
    sufficient = [
        entry
        for entry in sweep
        if entry["follows_donor"]["rate"] == 1.0 and entry["kv"] == "kv" and entry["positions"] is None
    ]
    figures["smallest_sufficient_layer_set"] = (
        min(sufficient, key=lambda e: e["layers"])["subset"] if sufficient else None
    )
    figures["cross_precision"] = cross_precision_figures(
        [row for row in every if row["selection"] == "cross_precision"]
    )
    return figures


def cross_precision_figures(rows: list[dict]) -> dict:
    """Two questions, kept apart because they have different causes.

    ``follows_donor``: does a cast cache reproduce its donor's own suffix? The donor's suffix
    was decoded at the donor's precision, so a "no" mixes the cache with the precision change.
    ``divergence_survives_cast``: at the recipient's precision, do the continuations from the
    cast live cache and from the cast prefill cache still differ? Both are decoded at the same
    precision, so the answer is about the caches alone.
    """
    divergent = [row for row in rows if row["divergent"]]
    survives: dict[str, dict] = {}
    for precision, group in grouped(rows, lambda r: r["precision"]).items():
        by_item = grouped(group, lambda r: r["item_id"])
        pairs = [sorted(item_rows, key=lambda r: r["donor"]) for item_rows in by_item.values() if len(item_rows) == 2]
        survives[precision] = {
            "pair": " vs ".join(f"cast {row['donor']}" for row in pairs[0]) if pairs else None,
            **share(sum(a["suffix_object"] != b["suffix_object"] for a, b in pairs), len(pairs)),
        }
    return {
        "follows_donor": {
            direction: _follows_donor(group)
            for direction, group in grouped(divergent, lambda r: f"{r['donor']} -> {r['recipient']}").items()
        },
        "divergence_survives_cast": survives,
    }
