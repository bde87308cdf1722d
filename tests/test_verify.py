"""`stagereplay verify` and the audit against a damaged copy of a real ledger: each fault is caught and named."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from workflow_helpers import copy_run, snakemake, stagereplay

from stagereplay.verify import verify_ledger

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

    audit = snakemake(tmp_path / "copy", config, "audit")
    assert audit.returncode != 0
    assert any(where in line and problem in line for line in (audit.stdout + audit.stderr).splitlines()), audit.stderr[-3000:]
    assert not (ledger / "tables" / "audit.parquet").exists()


def test_a_gathered_table_missing_a_row_is_caught(test_run, tmp_path):
    """Rows dropped by a faulty gather, the table rewritten with a valid digest: the counts give it away."""
    from stagereplay.ledger import TRAJECTORY_SCHEMA, write_table

    workdir, _, _ = test_run
    ledger, _ = copy_run(workdir, tmp_path / "copy")
    path = ledger / "tables" / "trajectories.parquet"
    rows = pq.read_table(path).to_pylist()
    write_table(rows[:-1], TRAJECTORY_SCHEMA, path)
    faults = [str(fault) for fault in verify_ledger(ledger).faults]
    assert len(faults) == 1 and "rows for" in faults[0] and "items.jsonl holds 4 items" in faults[0], faults
