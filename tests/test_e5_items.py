"""E5 counts items, not transplant rows: an item's two directions (live into prefill and back) are one
observation, so 81 items are 81/81, never 162/162, and an item with one direction that does not follow
its donor is not counted. Known answers on hand-built transplant tables."""

import pyarrow as pa

from stagereplay.ledger.tables import TRANSPLANT_SCHEMA
from stagereplay.report.card import e5_panel
from stagereplay.report.transplant_summary import e5_summary

LIVE, PREFILL = "live/bf16/rep0", "prefill/bf16/rep0<-bf16"


def row(item: str, donor: str, recipient: str, outcome: str, selection: str = "selected", checkpoint: str = "m"):
    return {
        "selection": selection,
        "checkpoint": checkpoint,
        "item_id": item,
        "divergent": True,
        "donor": donor,
        "recipient": recipient,
        "precision": "bf16",
        "subset": "layers=0-1 kv=kv positions=all",
        "layers": [0, 1],
        "kv": "kv",
        "last_positions": None,
        "outcome": outcome,
        "layer_k": ["0" * 32, "1" * 32],
    }


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(
        [{name: r.get(name) for name in TRANSPLANT_SCHEMA.names} for r in rows], TRANSPLANT_SCHEMA
    )


def both_ways(item: str, back: str = "follows_donor", **where) -> list[dict]:
    return [row(item, LIVE, PREFILL, "follows_donor", **where), row(item, PREFILL, LIVE, back, **where)]


def test_items_count_once_and_only_when_both_directions_follow():
    rows = both_ways("a") + both_ways("b") + both_ways("c", back="follows_recipient")
    figures = e5_summary(table(rows), "m")["all_layers"]["selected/m"]
    items = figures["items_follow_donor_both_ways"]
    assert (items["count"], items["n"]) == (2, 3)  # over items
    assert (figures["follows_donor"]["count"], figures["follows_donor"]["n"]) == (5, 6)  # over rows, kept apart
    assert items["wilson95"][1] < 1.0 and items["measured"]


def test_a_same_checkpoint_sample_is_not_set_beside_the_papers_later_checkpoint():
    rows = both_ways("a") + both_ways("b", selection="outcome_blind")
    panel = e5_panel(e5_summary(table(rows), "m"), "m")
    blind = next(r for r in panel if r[0] == "E5 outcome-blind")
    assert "same checkpoint" in blind[1] and blind[2].startswith("1/1")
    assert blind[3] == "not comparable: the paper's replication is at a later checkpoint"
    elsewhere = e5_panel(
        e5_summary(table(both_ways("a") + both_ways("b", selection="outcome_blind", checkpoint="later")), "m"), "m"
    )
    assert next(r for r in elsewhere if r[0] == "E5 outcome-blind")[3] == "43/43 at a later checkpoint"
