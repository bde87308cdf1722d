"""What each E6 control exercises and what it does not, per engine: every engine spec declares it for every
factor it runs (``EngineSpec.control_scopes``); summary.json's E6.controls takes it from the spec of the engine
its rows name; the card has one row per control with both; verify names the migration of a summary.json
written before. Hand-built factor rows shaped like the ledger's (fast); the real runs are in test_factors.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
from test_factor_controls import _rows, _same

from stagereplay.audit.faults import Report
from stagereplay.audit.verify_documents import COMPARISONS, FACTORS, TRAJECTORIES, verify_summary
from stagereplay.design.factors import FACTOR_OBJECTS
from stagereplay.engines.registry import SPECS
from stagereplay.ledger.tables import COMPARISON_SCHEMA, FACTOR_SCHEMA, TRAJECTORY_SCHEMA
from stagereplay.report.controls import CONTROL_COLUMNS, controls_blocks, controls_card_row
from stagereplay.report.factor_summary import e6_controls
from stagereplay.report.figures import factor_blocks
from stagereplay.report.summary import summary

DOC = Path(__file__).resolve().parents[1] / "docs" / "experiments.md"


def test_every_engine_declares_what_each_of_its_factors_controls_exercise_and_not():
    for name, spec in SPECS.items():
        assert set(spec.control_scopes) == set(spec.factors), name
        for factor, scope in spec.control_scopes.items():
            assert factor in FACTOR_OBJECTS, (name, factor)
            assert scope.exercises.strip() and scope.does_not.strip(), (name, factor)
            assert spec.control_scope(factor) == scope
    assert SPECS["transformers"].control_scope("kv_offset") is None  # not a factor it runs


def test_the_reference_computation_controls_say_what_they_cannot_fail_on():
    transformers = SPECS["transformers"]
    for factor in ("chunk", "batch"):
        assert "the reference computation itself" in transformers.control_scope(factor).exercises, factor
        assert "it cannot fail on" in transformers.control_scope(factor).does_not, factor
    assert "SDPA drops" in transformers.control_scope("batch").exercises
    assert "padding" in transformers.control_scope("batch").does_not
    assert "another attention kernel" in transformers.control_scope("attention").does_not
    assert "a partial hit" in transformers.control_scope("prefix_reuse").does_not


def test_the_server_load_control_says_it_does_not_put_companions_cells_beside_the_items():
    server, binding = SPECS["llamaserver"], SPECS["llamacpp"]
    batch = server.control_scope("batch")
    assert "cancelled and erased" in batch.exercises and "2048·4 cells" in batch.exercises
    assert "cells beside the item's" in batch.does_not and "kv_offset" in batch.does_not
    assert "reopened" in binding.control_scope("batch").exercises
    assert binding.control_scope("kv_offset").exercises != server.control_scope("kv_offset").exercises
    assert "--no-kv-unified" in server.control_scope("kv_unified").exercises
    for factor in ("threads", "flash_attn", "ubatch", "cache_type"):
        assert "server restart" in server.control_scope(factor).exercises, factor


def _engine_rows(engine: str | None) -> list[dict]:
    rows = _rows("1", "1", _same)  # batch 1, the control, over two items
    return [{**row, "engine": engine} for row in rows] if engine else rows


def test_the_summary_records_each_controls_scope_from_its_rows_engine():
    for engine in ("transformers", "llamacpp", "llamaserver"):
        (control,) = e6_controls(_engine_rows(engine))["levels"]
        scope = SPECS[engine].control_scope("batch")
        assert (control["engine"], control["exercises"], control["does_not"]) == (engine, *scope)
    (control,) = e6_controls(_engine_rows(None))["levels"]  # a row naming no engine is the default's
    assert control["engine"] == "transformers"
    assert control["exercises"] == SPECS["transformers"].control_scope("batch").exercises


def test_the_card_has_one_row_per_control_with_what_it_exercises_and_not():
    rows = [{**row, "checkpoint": "a"} for row in _engine_rows("llamaserver")] + [
        {**row, "checkpoint": "b", "factor": "chunk", "level": "whole", "reference_level": "whole"}
        for row in _engine_rows("transformers")
    ]
    e6 = {"controls": e6_controls(rows)}
    heading, paragraph, table = controls_blocks(e6)
    assert heading[0] == "heading" and "what each control exercises" in heading[2]
    assert table[1] == CONTROL_COLUMNS
    server, chunk = SPECS["llamaserver"].control_scope("batch"), SPECS["transformers"].control_scope("chunk")
    assert table[2] == [
        ["batch", "1", "llamaserver", "2/2", server.exercises, server.does_not],
        ["chunk", "whole", "transformers", "2/2", chunk.exercises, chunk.does_not],
    ]
    # The one-line figure stays, and the E6 section carries the table.
    assert controls_card_row(e6)[2] == "2/2 paths identical on every item"
    section = factor_blocks({"E6": {**e6, "levels": [], "checkpoint": "a", "precision": "fp16", "reference": "r"}})
    assert table in section
    assert controls_blocks({"controls": {**e6["controls"], "levels": []}}) == []


def test_a_summary_from_before_the_scopes_gets_one_line_naming_its_migration():
    rows = [{**row, "layer_max_abs": [0.0, 0.0]} for row in _engine_rows("transformers")]
    tables = {
        COMPARISONS: COMPARISON_SCHEMA.empty_table(),
        TRAJECTORIES: TRAJECTORY_SCHEMA.empty_table(),
        FACTORS: pa.Table.from_pylist(rows, schema=FACTOR_SCHEMA),  # the columns rows lack are null
    }
    current = json.loads(json.dumps(summary(tables[COMPARISONS], tables[TRAJECTORIES], "v", factors=tables[FACTORS])))
    report = Report()
    verify_summary(current, tables, report)
    assert report.faults == []
    old = json.loads(json.dumps(current))
    for control in old["E6"]["controls"]["levels"]:
        del control["exercises"], control["does_not"], control["engine"]
    verify_summary(old, tables, report)
    assert [str(fault) for fault in report.faults] == [
        "summary.json: its E6 controls do not say what each exercises and what it does not (written before the"
        " engine specs declared their controls' scope) — migrate it: rerun snakemake --forcerun summary report"
        " (it rewrites summary.json and the card from the tables)"
    ]


def test_the_documented_control_table_has_a_row_per_factor_and_what_it_does_not_exercise():
    text = DOC.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| factor | control level |"))
    assert "what it does not exercise" in header
    documented = set(re.findall(r"^\| `(\w+)`", text[text.index(header) :].split("\n\n")[0], re.MULTILINE))
    assert documented == set(FACTOR_OBJECTS)
