"""`stagereplay verify` and the audit against a damaged copy of a real ledger: each fault is caught and named."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from workflow_helpers import copy_run, rewrite_live_suffix, snakemake, stagereplay

from stagereplay.audit.verify import verify_ledger
from stagereplay.ledger.tables import COMPARISON_SCHEMA, write_table
from stagereplay.report.stamp import stamp, stamp_problem

pytestmark = pytest.mark.slow


def first_live_row(ledger):
    rows = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    return next(row for row in rows if row["construction"] == "live")


def object_path(ledger, object_id):
    return ledger / "objects" / object_id[:2] / f"{object_id}.safetensors"


def flip_a_byte(ledger):
    path = object_path(ledger, first_live_row(ledger)["cache_object"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a tensor buffer: the file still parses
    path.write_bytes(bytes(data))
    return str(path.relative_to(ledger)), "content hashes to"


def truncate(ledger):
    path = object_path(ledger, first_live_row(ledger)["suffix_object"])
    path.write_bytes(path.read_bytes()[:40])
    return str(path.relative_to(ledger)), "unreadable safetensors"


def delete(ledger):
    object_id = first_live_row(ledger)["prefix_object"]
    object_path(ledger, object_id).unlink()
    return object_id, "missing or corrupt"


def edit_a_cell(ledger):
    path = ledger / "tables" / "trajectories.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    rows[0]["correct"] = not rows[0]["correct"]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)  # schema metadata kept, as most tools do
    return "tables/trajectories.parquet", "a cell was edited"


DAMAGE = {"flip one byte": flip_a_byte, "truncate": truncate, "delete": delete, "edit a Parquet cell": edit_a_cell}


def test_an_intact_ledger_verifies(test_run):
    _, ledger, _ = test_run
    report = verify_ledger(ledger)
    assert report.faults == []
    assert report.objects > 0 and report.tables >= 10 and report.rows > 0
    result = stagereplay("verify", ledger)
    assert result.returncode == 0 and "ledger OK" in result.stdout


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_verify_and_the_audit_name_the_damage(damage, test_run, tmp_path):
    workdir, _, _ = test_run
    ledger, config = copy_run(workdir, tmp_path / "copy")
    where, problem = DAMAGE[damage](ledger)

    result = stagereplay("verify", ledger)
    assert result.returncode == 1
    faults = [line for line in result.stderr.splitlines() if line.startswith("stagereplay: fault:")]
    assert any(where in line and problem in line and "—" in line for line in faults), result.stderr

    audit = snakemake(tmp_path / "copy", config, "--config", "mode=audit")
    assert audit.returncode != 0
    assert any(where in line and problem in line for line in (audit.stdout + audit.stderr).splitlines()), audit.stderr[
        -3000:
    ]
    assert not (ledger / "tables" / "audit.parquet").exists()


def test_a_gathered_table_missing_a_row_is_caught(test_run, tmp_path):
    """Rows dropped by a faulty gather, the table rewritten with a valid digest: the counts give it away."""
    from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, write_table

    workdir, _, _ = test_run
    ledger, _ = copy_run(workdir, tmp_path / "copy")
    path = ledger / "tables" / "trajectories.parquet"
    rows = pq.read_table(path).to_pylist()
    write_table(rows[:-1], TRAJECTORY_SCHEMA, path)
    faults = [str(fault) for fault in verify_ledger(ledger).faults]
    assert len(faults) == 1 and "rows for" in faults[0] and "items.jsonl holds 4 items" in faults[0], faults


def fault_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("stagereplay: fault:")]


@pytest.mark.parametrize(
    "table, evidence",
    [
        ("comparisons", "summary.json was computed from it"),
        ("transplants", "summary.json (its E5 figures) was computed from it"),
    ],
)
def test_a_missing_table_is_named(table, evidence, test_run, tmp_path):
    workdir, _, _ = test_run
    ledger, _ = copy_run(workdir, tmp_path / "copy")
    (ledger / "tables" / f"{table}.parquet").unlink()
    result = stagereplay("verify", ledger)
    assert result.returncode == 1
    assert fault_lines(result) == [
        f"stagereplay: fault: tables/{table}.parquet: missing, though {evidence}"
        " — rerun snakemake (it rebuilds what is missing)"
    ], result.stderr


def test_an_edited_summary_figure_is_named(test_run, tmp_path):
    workdir, _, _ = test_run
    ledger, _ = copy_run(workdir, tmp_path / "copy")
    path = ledger / "summary.json"
    summary = json.loads(path.read_text())
    count = summary["E1"]["checkpoints"]["tiny-qwen2"]["suffixes_differ"]["count"]
    summary["E1"]["checkpoints"]["tiny-qwen2"]["suffixes_differ"]["count"] = count + 1
    path.write_text(json.dumps(summary, indent=2) + "\n")
    result = stagereplay("verify", ledger)
    assert result.returncode == 1
    assert fault_lines(result) == [
        f"stagereplay: fault: summary.json: E1.checkpoints.tiny-qwen2.suffixes_differ.count is {count + 1}, but the tables give {count}"
        " (edited, or not rewritten when the tables changed) — rerun snakemake --forcerun summary to rewrite it from the tables",
        # The cards still show the figure as it was: drawn from other bytes.
        "stagereplay: fault: results.md: rendered from another summary.json — rerun snakemake to redraw it",
        "stagereplay: fault: report/results.html: rendered from another summary.json — rerun snakemake to redraw it",
    ], result.stderr
    # The audit's own check reads neither (the workflow rewrites both after it).
    assert verify_ledger(ledger, documents=False).faults == []


def test_a_summary_left_behind_by_regenerated_tables_is_named(test_run, tmp_path):
    workdir, _, _ = test_run
    ledger, config = copy_run(workdir, tmp_path / "copy")
    before = json.loads((ledger / "summary.json").read_text())["E1"]["checkpoints"]["tiny-qwen2"]["replicas_exact"][
        "live"
    ]
    row = rewrite_live_suffix(ledger)
    # Only the tables are regenerated (regather, recompare): summary.json is not asked for.
    result = snakemake(tmp_path / "copy", config, str(ledger / "tables" / "comparisons.parquet"))
    assert result.returncode == 0, result.stderr[-3000:]
    faults = [str(fault) for fault in verify_ledger(ledger).faults]
    assert faults[0] == (
        f"summary.json: E1.checkpoints.tiny-qwen2.replicas_exact.live.count is {before['count']}, but the tables give"
        f" {before['count'] - 1}"
        " (edited, or not rewritten when the tables changed) — rerun snakemake --forcerun summary to rewrite it from the tables"
    ), (faults, row["item_id"])
    assert len(faults) == 1


def test_an_edited_results_card_is_named(test_run, tmp_path):
    workdir, _, _ = test_run
    ledger, _ = copy_run(workdir, tmp_path / "copy")
    path = ledger / "results.md"
    text = path.read_text()
    assert "E1 matched" in text
    path.write_text(text.replace("E1 matched", "E1 matched (checked)", 1))
    result = stagereplay("verify", ledger)
    assert result.returncode == 1
    assert fault_lines(result) == [
        "stagereplay: fault: results.md: edited after it was written — rerun snakemake --forcerun report to redraw it"
    ], result.stderr


def test_a_stamp_names_each_problem():
    source = b'{"E1": {}}\n'
    text = stamp("# card\n\nfigures\n", source)
    assert text.startswith("# card\n\nfigures\n<!-- stagereplay stamp: source xxh3-128 ")
    assert text.count("\n") == 4 and stamp_problem(text, source) is None
    assert stamp_problem(stamp("no final newline", source), source) is None
    assert stamp_problem(text.replace("figures", "figure5"), source).startswith("edited after it was written")
    assert stamp_problem(text, source + b" ").startswith("rendered from another summary.json")
    assert stamp_problem("# card\n", source).startswith("carries no stamp")
    assert stamp_problem(text + "appended\n", source).startswith("carries no stamp")


def test_a_construction_pair_over_different_prefixes_is_a_fault(test_run, tmp_path):
    """Rewritten with a valid row digest, so only the meaning of the row can give it away."""
    workdir, _, _ = test_run
    ledger, _ = copy_run(workdir, tmp_path / "copy")
    path = ledger / "tables" / "comparisons.parquet"
    rows = pq.read_table(path).to_pylist()
    row = next(row for row in rows if row["experiment"] == "E2")
    row["prefix_equal"] = False
    write_table(rows, COMPARISON_SCHEMA, path)
    faults = [str(fault) for fault in verify_ledger(ledger, documents=False).faults]
    assert faults == [
        f"tables/comparisons.parquet item {row['item_id']}: E2 {row['a']} vs {row['b']} compares different"
        " prefixes — delete it and rerun snakemake (the workflow rebuilds what is missing)"
    ], faults
