"""A level under concurrent load runs each item several times (``load_runs``), each with fresh companions: the
summary counts per item in how many runs the served suffix differs, and the audit compares a recomputed run with
the spread of the saved runs, never with one saved run that nothing pins.

The rows are written through the ledger's own schema and read back by the real summary and audit code; the runs
themselves, on a real llama-server, are tests/test_llamaserver_factors.py's.
"""

from __future__ import annotations

import pyarrow as pa

from stagereplay.audit.reproduction import e4_summary
from stagereplay.audit.rerun import audit_factors, audit_rows
from stagereplay.ledger.tables import FACTOR_SCHEMA
from stagereplay.report.factor_summary import e6_summary
from stagereplay.report.figures import load_blocks
from stagereplay.report.text import under_load_text

REFERENCE = "r" * 32
OTHER = "o" * 32
THIRD = "t" * 32
CELLS = (("test", "ref", "test-ref"), ("ref", "test", "ref-test"), ("test", "test", "test-test"))


def rows(served: dict[str, list[str]], level: str = "2") -> list[dict]:
    """Factor rows of batch ``level`` whose served suffix of each item is, run by run, ``served[item]``; the
    one-sided cells continue as the reference."""
    made = []
    for item_id, runs in served.items():
        for run, suffix in enumerate(runs):
            for build, read, cell in CELLS:
                row = dict.fromkeys(FACTOR_SCHEMA.names)
                row.update(
                    checkpoint="tiny",
                    precision="fp16",
                    factor="batch",
                    level=level,
                    reference_level="1",
                    item_id=item_id,
                    cell=cell,
                    run=run,
                    build=build,
                    read=read,
                    applicable=True,
                    companions=[],
                    reference_cache="c" * 32,
                    reference_suffix=REFERENCE,
                    cache_digest="c" * 32,
                    layer_k=["k"],
                    layer_v=["v"],
                    cache_differs=False,
                    layer_max_abs=[0.0],
                    suffix_object=suffix if cell == "test-test" else REFERENCE,
                    suffix_tokens=[1, 2] if (suffix if cell == "test-test" else REFERENCE) == REFERENCE else [1, 3],
                    engine="llamaserver",
                )
                made.append(row)
    return made


def table(made: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(made, schema=FACTOR_SCHEMA)


SAVED = {"a": [OTHER, OTHER, OTHER], "b": [REFERENCE, OTHER, REFERENCE], "c": [REFERENCE] * 3}


def test_the_summary_counts_per_item_in_how_many_runs_the_served_suffix_differs():
    e6 = e6_summary(table(rows(SAVED)))
    [load] = e6["under_load"]
    assert (load["runs"], load["items"]) == (3, 3)
    assert load["served_differs_in"] == {"0": 1, "1": 1, "2": 0, "3": 1}
    assert [load[name]["count"] for name in ("every_run", "unstable", "no_run")] == [1, 1, 1]
    assert load["unstable_items"] == ["b"]
    # Each run is a level of its own in the counts, named by its run.
    assert [(level["label"], level["suffixes_differ"]["count"]) for level in e6["levels"]] == [
        ("batch 2 run 1/3", 1),
        ("batch 2 run 2/3", 2),
        ("batch 2 run 3/3", 1),
    ]
    [(_, _, [row])] = [block for block in load_blocks(e6) if block[0] == "table"]
    assert row[:3] == ["batch", "2", "3"] and row[4].endswith("(b)")


def test_a_pinned_level_has_no_runs_under_load():
    pinned = [{**row, "run": None} for row in rows({"a": [OTHER]})]
    e6 = e6_summary(table(pinned))
    assert e6["under_load"] == [] and [level["label"] for level in e6["levels"]] == ["batch 2"]


def test_the_audit_compares_a_run_under_load_with_the_saved_runs_spread():
    """Recomputed runs that meet the saved outcomes in another order are within the spread; a suffix no saved run
    had is outside it, named as such, and neither counts as a reproduced artifact nor changes the status."""
    reordered = {"a": [OTHER] * 3, "b": [OTHER, REFERENCE, REFERENCE], "c": [REFERENCE] * 3}
    checks = audit_factors(table(rows(SAVED)), table(rows(reordered)))
    assert {check.artifact for check in checks} == {
        "factor_applicable",
        "factor_cache_in_spread",
        "factor_suffix_in_spread",
        "factor_first_read_in_spread",
        "factor_margins_in_spread",
    }
    assert all(check.reproduced for check in checks)
    # Compared run by run instead, b's first two runs would not reproduce: the spread is what E4 compares.
    outside = {"a": [OTHER] * 3, "b": [OTHER, REFERENCE, THIRD], "c": [REFERENCE] * 3}
    failed = [check for check in audit_factors(table(rows(SAVED)), table(rows(outside))) if not check.reproduced]
    assert [(check.artifact, check.item_id, check.side) for check in failed] == [
        ("factor_suffix_in_spread", "b", "batch=2 test-test run 2")
    ]
    assert failed[0].detail == "outside the spread of the 3 saved runs under load"
    assert failed[0].saved == "2 distinct in 3 saved runs"
    figures = e4_summary(audit_rows(audit_factors(table(rows(SAVED)), table(rows(outside)))))
    assert all(not name.endswith("_in_spread") for name in figures["artifacts"])
    assert figures["mismatches"] == []
    suffixes = figures["under_load"]["artifacts"]["factor_suffix"]
    assert (suffixes["count"], suffixes["n"]) == (26, 27)  # 3 items, 3 runs, 3 cells
    # Per level and cell, never pooled: the one run outside the spread is test-test's.
    levels = {name: (entry["count"], entry["n"]) for name, entry in figures["under_load"]["levels"].items()}
    assert levels == {"batch=2 ref-test": (36, 36), "batch=2 test-ref": (36, 36), "batch=2 test-test": (35, 36)}
    assert under_load_text(figures["under_load"]).endswith(
        "per level and cell: batch=2 ref-test 36/36; batch=2 test-ref 36/36; batch=2 test-test 35/36"
    )


def test_a_served_check_under_load_is_counted_with_its_server_cell_and_client():
    from stagereplay.audit.reproduction import spread_level

    assert spread_level("served default load run 0 item arith-001") == "served default load"
    assert spread_level("served np-1 together run 2 item arith-003 (default client)") == (
        "served np-1 together (default client)"
    )
