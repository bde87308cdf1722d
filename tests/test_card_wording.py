"""The card's words for E4 and E5, on known answers: the E4 answer gives the audit's status and the artifact kind
it reproduced least, not trajectories alone; E5's panel names its unit beside the paper's. The E4 figures are
audit.reproduction's own, computed from hand-built audit rows (no model, no workflow)."""

from __future__ import annotations

from stagereplay.audit.reproduction import e4_line, e4_summary, worst_artifact
from stagereplay.report.card import e4_panel, e5_panel
from stagereplay.report.reading import e4_reading
from stagereplay.report.stats import share


def audit_row(kind: str, artifact: str, item: str, side: str, reproduced: bool = True) -> dict:
    """One row of tables/audit.parquet: a saved fingerprint against its recomputation."""
    return {
        "kind": kind,
        "artifact": artifact,
        "checkpoint": "m",
        "item_id": item,
        "side": side,
        "reproduced": reproduced,
        "saved": "a" * 32,
        "audited": ("a" if reproduced else "b") * 32,
        "first_differing_layer": None if reproduced else 3,
        "first_differing_position": None,
        "detail": None if reproduced else "cache differs",
        "environment_differs": False,
        "environment": None,
    }


def server_audit(items: int = 8, caches_lost: int = 0) -> list[dict]:
    """Every trajectory of ``items`` items reproduced (cache and suffix, live and prefill), and 9 E6 cells per item
    whose caches reproduce but on the first ``caches_lost`` cells, spread over the first items."""
    rows = [
        audit_row("trajectory", artifact, f"item-{i}", side)
        for i in range(items)
        for side in ("live", "prefill")
        for artifact in ("cache", "suffix")
    ]
    cells = [(f"item-{i}", f"batch=2 cell-{c}") for i in range(items) for c in range(9)]
    rows += [
        audit_row("factor", "factor_cache", item, side, index >= caches_lost)
        for index, (item, side) in enumerate(cells)
    ]
    rows += [audit_row("factor", "factor_suffix", item, side) for item, side in cells]
    return rows


def test_the_e4_answer_gives_the_status_and_the_worst_artifact_not_trajectories_alone():
    # The shape of the server ledger: every trajectory reproduces, 16 of 72 E6 caches do not.
    figures = e4_summary(server_audit(caches_lost=16))
    assert figures["status"] == "differences found"
    assert figures["worst_artifact"] == {"artifact": "factor_cache", "reproduced": 56, **share(56, 72)}
    assert (figures["trajectories"]["count"], figures["trajectories"]["n"]) == (16, 16)
    assert (figures["items"]["count"], figures["items"]["n"]) == (6, 8)  # 16 lost cells: items 0 and 1
    panel = e4_panel(figures)
    assert panel[2] == (
        "differences found: worst factor_cache 56/72 (77.8%); trajectories 16/16 (100.0%); items 6/8 (75.0%);"
        " 16 mismatch(es)"
    )
    (line,) = e4_reading(figures)
    assert line.startswith("E4 audit: differences found; 16/16 trajectories and 6/8 items reproduced")
    assert "; the worst-reproduced artifact kind is factor_cache, 56/72; 16 mismatch(es) recorded." in line
    assert "worst reproduced: factor_cache 56/72" in e4_line(figures)


def test_a_full_reproduction_says_every_artifact_kind_and_an_older_e4_json_says_what_it_lacks():
    figures = e4_summary(server_audit())
    worst = figures["worst_artifact"]
    assert figures["status"] == "reproduced" and worst["count"] == worst["n"] > 0
    assert e4_panel(figures)[2] == (
        "reproduced: every artifact kind in full (4 kinds); trajectories 16/16 (100.0%); items 8/8 (100.0%)"
    )
    assert "every artifact kind reproduced in full (4 kinds), with no mismatch." in e4_reading(figures)[0]
    assert "worst reproduced" not in e4_line(figures)
    older = {key: value for key, value in figures.items() if key != "worst_artifact"}
    assert "worst artifact kind not recorded in this e4.json" in e4_panel(older)[2]
    assert e4_panel(None)[2] == "not run yet (snakemake --cores N --config mode=audit)"


def test_the_worst_artifact_is_the_lowest_rate_then_the_most_mismatches():
    artifacts = {"a": share(9, 10), "b": share(18, 20), "c": share(1, 1), "d": share(0, 0)}
    assert worst_artifact(artifacts)["artifact"] == "b"  # 90% both: b has two mismatches, a one
    assert worst_artifact({"d": share(0, 0)}) is None


def test_the_e5_panel_names_its_unit_beside_the_papers():
    e5 = {"all_layers": {"selected/m": {"items_follow_donor_both_ways": share(3, 4)}}}
    ((_, figure, counted, paper),) = e5_panel(e5, "m")
    assert "unit: items, an item's two directions one observation; the paper's unit: continuations" in figure
    assert counted == "3/4 (75.0%)" and paper.startswith("24/24 selected divergent continuations")
