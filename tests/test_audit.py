"""E4: the audit recomputes a real ledger into its own tree and reproduces every fingerprint."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from workflow_helpers import (
    copy_run,
    ledger_snapshot,
    rewrite_live_suffix,
    snakemake,
    stagereplay,
    write_config,
)

from stagereplay.audit.reproduction import e4_line, e4_summary
from stagereplay.audit.rerun import (
    audit_comparisons,
    audit_rows,
    audit_trajectories,
    audit_transplants,
)
from stagereplay.design.jobs import trajectory_label
from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import AUDIT_SCHEMA, COMPARISON_SCHEMA, TRAJECTORY_SCHEMA, TRANSPLANT_SCHEMA, read_table
from stagereplay.report.reading import e4_reading

pytestmark = pytest.mark.slow


def saved_files(ledger):
    """The saved ledger, without what the audit adds (its tree with e4.json, its table, logs) and the card, which
    the audit redraws with E4: summary.json included, since the audit writes only its own files and the card."""
    return {
        path: digest
        for path, digest in ledger_snapshot(ledger).items()
        if path.split("/")[0] not in ("audit", "logs", "benchmarks", "report")
        and path not in ("tables/audit.parquet", "results.md")
    }


@pytest.fixture(scope="module")
def audited(test_run, tmp_path_factory):
    """The audit of a copy of the test run, with the config on disk edited since the run: the audit must rerun
    the design recorded in the ledger (provenance.json), not this one, and say where they differ."""
    workdir, _, _ = test_run
    copy = tmp_path_factory.mktemp("audited")
    ledger, config = copy_run(workdir, copy / "run")
    edited = yaml.safe_load(config.read_text())
    edited["stage"]["suffix_tokens"] += 3
    config.write_text(yaml.safe_dump(edited))
    before = saved_files(ledger)
    result = snakemake(copy / "run", config, "--config", "mode=audit")
    assert result.returncode == 0, result.stderr[-4000:]
    return copy / "run", ledger, config, before, result


def reproduced_of(entry: dict) -> tuple:
    """The x/N of an E4 entry (which also carries the rate and Wilson interval of stats.share)."""
    return entry["reproduced"], entry["n"]


def test_the_audit_reproduces_every_fingerprint(audited):
    _, ledger, _, _, result = audited
    e4 = json.loads((ledger / "audit" / "e4.json").read_text())
    assert e4["status"] == "reproduced" and e4["mismatches"] == [] and e4["environment_differences"] == []
    trajectories = pq.read_table(ledger / "tables" / "trajectories.parquet").num_rows
    assert reproduced_of(e4["trajectories"]) == (trajectories, trajectories)
    assert reproduced_of(e4["items"]) == (4, 4)
    for kind in (
        "prefix",
        "stage_end",
        "cache",
        "layer_k",
        "layer_v",
        "suffix",
        "label",
        "readout",
        "comparison",
        "outcome",
        "selection",
        "model_folder",
    ):
        assert e4["artifacts"][kind]["n"] > 0 and e4["artifacts"][kind]["reproduced"] == e4["artifacts"][kind]["n"], (
            kind
        )
    table = read_table(ledger / "tables" / "audit.parquet", AUDIT_SCHEMA)
    assert table.num_rows == sum(entry["n"] for entry in e4["artifacts"].values())
    assert "E4 audit:" in result.stdout + result.stderr
    assert "the config given differs at stage.suffix_tokens (11 here, 8 in the ledger)" in result.stderr
    assert e4["audit_runtime"]["tiny-qwen2"]["engine"] == "transformers"
    # `snakemake audit` alone ends with the card showing E4: its status and worst artifact kind first.
    assert e4["worst_artifact"]["count"] == e4["worst_artifact"]["n"] > 0
    shown = (
        f"| reproduced: every artifact kind in full ({len(e4['artifacts'])} kinds); trajectories"
        f" {e4['trajectories']['reproduced']}/{e4['trajectories']['n']} (100.0%); items 4/4 (100.0%) |"
    )
    assert shown in (ledger / "results.md").read_text()


def test_the_recomputed_readout_catches_a_saved_readout_changed_in_its_last_bit(audited):
    """Against the real recomputation: every readout reproduces, and a saved readout whose margin moved by one
    float32 step (or whose letter changed) is the one failed readout, named on its item and side."""
    _, ledger, _, _, _ = audited
    saved = read_table(ledger / "tables" / "trajectories.parquet", TRAJECTORY_SCHEMA)
    recomputed = read_table(ledger / "audit" / "tables" / "trajectories.parquet", TRAJECTORY_SCHEMA)
    store = ObjectStore(ledger / "objects")
    audit_store = ObjectStore(ledger / "audit" / "objects")

    def failed(table):
        checks = audit_rows(audit_trajectories(table, recomputed, store, audit_store))
        assert {row["artifact"] for row in checks} >= {"readout"}
        return [(row["item_id"], row["side"], row["artifact"]) for row in checks if not row["reproduced"]]

    assert failed(saved) == []
    rows = saved.to_pylist()
    assert all(row["readout_answer"] in "ABCD" for row in rows)  # every trajectory has a label
    rows[3]["readout_margin"] = float(np.nextafter(np.float32(rows[3]["readout_margin"]), np.float32(np.inf)))
    other = next(letter for letter in "ABCD" if letter != rows[5]["readout_answer"])
    rows[5]["readout_answer"] = other
    tampered = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
    side = trajectory_label
    assert failed(tampered) == [
        (rows[3]["item_id"], side(rows[3]), "readout"),
        (rows[5]["item_id"], side(rows[5]), "readout"),
    ]


def test_the_audit_never_writes_over_the_saved_ledger(audited):
    _, ledger, _, before, _ = audited
    assert saved_files(ledger) == before
    # Its own tree: recomputed shards, a separate object store.
    assert list((ledger / "audit" / "runs" / "live").rglob("shard-*.parquet"))
    assert list((ledger / "audit" / "objects").rglob("*.safetensors"))


def test_verify_recomputes_e4_from_the_audit_table(audited, tmp_path):
    _, ledger, _, _, _ = audited
    assert stagereplay("verify", ledger).returncode == 0
    copy = tmp_path / "ledger"
    shutil.copytree(ledger, copy)
    path = copy / "audit" / "e4.json"
    e4 = json.loads(path.read_text())
    n = e4["trajectories"]["n"]
    e4["trajectories"]["reproduced"] = n - 1
    path.write_text(json.dumps(e4, indent=2) + "\n")
    result = stagereplay("verify", copy)
    assert result.returncode == 1
    assert (
        f"stagereplay: fault: audit/e4.json: trajectories.reproduced is {n - 1}, but the audit table's rows give {n}"
        in result.stderr
    ), result.stderr
    (copy / "tables" / "audit.parquet").unlink()
    result = stagereplay("verify", copy)
    assert "tables/audit.parquet: missing, though audit/e4.json was computed from it" in result.stderr, result.stderr


def test_a_complete_audit_is_not_rerun(audited):
    workdir, ledger, config, _, _ = audited
    result = snakemake(workdir, config, "--dry-run", "--config", "mode=audit")
    assert result.returncode == 0 and "Nothing to be done" in result.stdout + result.stderr
    # The main target never runs the audit: after it, a plain run only redraws the card once (the audit drew it
    # with e4.json as an input, a plain run takes e4.json's digest as a parameter), still with E4; then nothing.
    result = snakemake(workdir, config, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(re.findall(r"^([a-z_]+) +\d+$", result.stdout, flags=re.MULTILINE)) == {"report", "all", "total"}
    result = snakemake(workdir, config)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| E4 audit | trajectories reproduced from the saved ledger |" in (ledger / "results.md").read_text()
    assert "Nothing to be done" in snakemake(workdir, config, "--dry-run").stdout
    assert stagereplay("verify", ledger).returncode == 0


def test_the_audit_target_without_the_mode_flag_stops_naming_the_flag(test_run):
    """The audit's jobs come from the design recorded in the ledger, chosen when the workflow is parsed, so the
    audit is asked for by a flag; the bare target stops before any job, naming it, and writes nothing."""
    workdir, ledger, config = test_run
    result = snakemake(workdir, config, "--dry-run", "audit")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "MissingInputException" in output and "the-audit-runs-as--snakemake--config-mode=audit" in output, output
    assert not (ledger / "audit").exists()


def test_another_runtime_is_reported_as_environment(audited, tmp_path):
    workdir, ledger, _, _, _ = audited
    copy_ledger, _ = copy_run(workdir, tmp_path / "eager")
    config = write_config(
        tmp_path / "eager.yaml", ledger_dir=str(copy_ledger), audit={"runtime": {"attn_implementation": "eager"}}
    )
    # A copy carries no snakemake metadata for its paths, so the changed params cannot trigger the rerun: force it.
    result = snakemake(tmp_path / "eager", config, "--config", "mode=audit", "--forcerun", "audit_register_model")
    assert result.returncode == 0, result.stderr[-3000:]
    e4 = json.loads((copy_ledger / "audit" / "e4.json").read_text())
    assert e4["audit_runtime"]["tiny-qwen2"]["attn_implementation"] == "eager"
    assert [entry["difference"] for entry in e4["environment_differences"]] == ["attn_implementation sdpa -> eager"]
    rows = read_table(copy_ledger / "tables" / "audit.parquet", AUDIT_SCHEMA).to_pylist()
    assert all(row["environment_differs"] for row in rows if row["kind"] == "trajectory")
    for mismatch in e4["mismatches"]:  # a result difference, if any, is named apart from the environment
        assert mismatch["item_id"] and mismatch["artifact"]


def test_a_mismatch_names_item_artifact_and_first_layer_or_position(test_run, tmp_path):
    _, ledger, _ = test_run
    saved = read_table(ledger / "tables" / "trajectories.parquet", TRAJECTORY_SCHEMA)
    rows = saved.to_pylist()
    rows[0]["layer_v"] = [rows[0]["layer_v"][0], "0" * 32]
    rows[0]["cache_object"] = "1" * 32
    rows[1]["suffix_tokens"] = (
        rows[1]["suffix_tokens"][:2] + [rows[1]["suffix_tokens"][2] + 1] + rows[1]["suffix_tokens"][3:]
    )
    rows[1]["suffix_object"] = "2" * 32
    rows[2]["threads"] = rows[2]["threads"] + 1
    audited = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
    store = ObjectStore(ledger / "objects")
    checks = audit_rows(audit_trajectories(saved, audited, store, store))
    failed = [
        (row["item_id"], row["artifact"], row["first_differing_layer"], row["first_differing_position"])
        for row in checks
        if not row["reproduced"]
    ]
    assert sorted(failed, key=str) == sorted(
        [
            (rows[0]["item_id"], "cache", None, None),
            (rows[0]["item_id"], "layer_v", 1, None),
            (rows[1]["item_id"], "suffix", None, 2),
        ],
        key=str,
    )
    environment = {row["environment"] for row in checks if row["environment_differs"]}
    assert environment == {f"threads {rows[2]['threads'] - 1} -> {rows[2]['threads']}"}
    figures = e4_summary(checks)
    assert figures["status"] == "differences found"
    assert reproduced_of(figures["artifacts"]["layer_v"]) == (len(rows) - 1, len(rows))
    # Every check of that one trajectory, and no other, carries the environment difference.
    side = trajectory_label(rows[2])
    of_that_row = [row for row in checks if (row["item_id"], row["side"]) == (rows[2]["item_id"], side)]
    assert len(of_that_row) >= 8
    assert figures["environment_differences"] == [{"difference": environment.pop(), "rows": len(of_that_row)}]


def test_a_missing_transplant_row_is_named(test_run):
    _, ledger, _ = test_run
    saved = read_table(ledger / "tables" / "transplants.parquet", TRANSPLANT_SCHEMA)
    audited = saved.slice(1)
    checks = audit_rows(audit_transplants(saved, audited))
    missing = [row for row in checks if not row["reproduced"]]
    assert len(missing) == 1 and missing[0]["detail"] == "missing from the audit tree"
    assert missing[0]["item_id"] == saved.to_pylist()[0]["item_id"]


def test_a_recomputed_difference_that_verify_cannot_see_is_found_by_the_audit(test_run, audited, tmp_path):
    """A saved suffix replaced by other tokens with every digest valid: the ledger verifies, only the audit's
    recomputation finds the difference, on that item and artifact alone. The recomputation is the audited copy's
    (of the intact ledger, every fingerprint reproduced); the audit's last step compares it with the damaged one."""
    workdir, _, _, _, _ = audited
    ledger, config = copy_run(workdir, tmp_path / "copy")
    # The run's own config, not the audited copy's edited one (which would change the design of the rerun below).
    config.write_text(yaml.safe_dump({**yaml.safe_load(test_run[2].read_text()), "ledger_dir": str(ledger)}))
    row = rewrite_live_suffix(ledger)
    # Newer than the gathered tables: snakemake regathers, recompares, resummarises and redraws the card.
    result = snakemake(tmp_path / "copy", config)
    assert result.returncode == 0, result.stderr[-3000:]
    verified = stagereplay("verify", ledger)
    assert verified.returncode == 0 and "ledger OK" in verified.stdout, verified.stderr

    e4_file = ledger / "audit" / "e4.json"
    audit_table = ledger / "tables" / "audit.parquet"
    result = stagereplay(
        "audit", "--ledger", ledger, "--checkpoints", row["checkpoint"], "--out", audit_table, "--e4", e4_file
    )
    assert result.returncode == 0, result.stderr[-3000:]
    e4 = json.loads(e4_file.read_text())
    side = trajectory_label(row)
    assert e4["status"] == "differences found"
    assert [(m["kind"], m["artifact"], m["item_id"], m["side"]) for m in e4["mismatches"]] == [
        ("trajectory", "suffix", row["item_id"], side),
        # The saved replica comparison was computed from the rewritten suffix; the recomputed one was not.
        ("comparison", "comparison", row["item_id"], f"E1: live/{row['precision']}/rep0 vs {side}"),
    ]
    assert e4["mismatches"][0]["first_differing_position"] == 0
    assert e4["mismatches"][0]["saved"] == row["suffix_object"]
    assert e4["artifacts"]["suffix"]["reproduced"] == e4["artifacts"]["suffix"]["n"] - 1
    assert e4["items"]["reproduced"] == e4["items"]["n"] - 1
    assert f"item {row['item_id']} {side} suffix first differing position 0" in result.stdout + result.stderr


def test_a_live_stage_that_ended_differently_is_a_mismatch(test_run):
    """The same prefix, but the recomputed stage says it ended on the marker: how a stage ended is a result."""
    _, ledger, _ = test_run
    saved = read_table(ledger / "tables" / "trajectories.parquet", TRAJECTORY_SCHEMA)
    rows = saved.to_pylist()
    edited = next(index for index, row in enumerate(rows) if row["construction"] == "live")
    rows[edited] = {**rows[edited], "boundary_reason": "marker", "marker_match": "token_ids"}
    store = ObjectStore(ledger / "objects")
    checks = audit_rows(audit_trajectories(saved, pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), store, store))
    failed = [check for check in checks if not check["reproduced"]]
    assert [check["artifact"] for check in failed] == ["stage_end"]
    assert failed[0]["audited"] == "marker (token_ids)" and failed[0]["item_id"] == rows[edited]["item_id"]


def test_a_rebuilt_prefix_is_copied_so_it_is_not_counted_as_reproduced(test_run):
    _, ledger, _ = test_run
    saved = read_table(ledger / "tables" / "trajectories.parquet", TRAJECTORY_SCHEMA)
    rows = saved.to_pylist()
    live = [row for row in rows if row["construction"] == "live"]
    rebuilt = next(index for index, row in enumerate(rows) if row["construction"] != "live")
    # A rebuilt row naming another (real) prefix object: never compared, since it is never recomputed.
    rows[rebuilt]["prefix_object"] = next(
        row["prefix_object"] for row in live if row["prefix_object"] != rows[rebuilt]["prefix_object"]
    )
    store = ObjectStore(ledger / "objects")
    checks = audit_rows(audit_trajectories(saved, pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), store, store))
    prefixes = [check for check in checks if check["artifact"] == "prefix"]
    assert sorted(check["side"] for check in prefixes) == sorted(trajectory_label(r) for r in live)
    assert all(check["reproduced"] for check in checks)
    figures = e4_summary(checks)
    assert reproduced_of(figures["artifacts"]["prefix"]) == (len(live), len(live))
    assert reproduced_of(figures["artifacts"]["suffix"]) == (len(rows), len(rows))


@pytest.mark.parametrize("where", ["saved", "audited"])
def test_a_duplicate_key_fails_its_trajectory(where, test_run):
    _, ledger, _ = test_run
    saved = read_table(ledger / "tables" / "trajectories.parquet", TRAJECTORY_SCHEMA)
    doubled = pa.concat_tables([saved, saved.slice(0, 1)])
    tables = (doubled, saved) if where == "saved" else (saved, doubled)
    store = ObjectStore(ledger / "objects")
    checks = audit_rows(audit_trajectories(*tables, store, store))
    failed = [check for check in checks if not check["reproduced"]]
    first = saved.to_pylist()[0]
    key = (
        first["checkpoint"],
        first["construction"],
        first["precision"],
        first["prefix_precision"],
        first["replica"],
        first["item_id"],
    )
    place = "the saved ledger" if where == "saved" else "the audit tree"
    assert [(check["item_id"], check["artifact"], check["detail"]) for check in failed] == [
        (
            first["item_id"],
            "trajectory",
            f"2 rows share the key {key} in {place} — rebuild that table (rerun snakemake)",
        )
    ]
    figures = e4_summary(checks)
    assert figures["status"] == "differences found"
    assert reproduced_of(figures["trajectories"]) == (saved.num_rows - 1, saved.num_rows)


def test_a_construction_pair_over_different_prefixes_is_not_reproduced(test_run):
    _, ledger, _ = test_run
    table = read_table(ledger / "tables" / "comparisons.parquet", COMPARISON_SCHEMA)
    rows = table.to_pylist()
    construction = next(index for index, row in enumerate(rows) if row["relation"] == "construction")
    replica = next(index for index, row in enumerate(rows) if row["relation"] == "replica")
    # The same on both sides, so no field differs: only the pair's own premise is broken.
    rows[construction]["prefix_equal"] = False
    rows[replica]["prefix_equal"] = False  # replicas generate their prefixes anew: they may differ
    edited = pa.Table.from_pylist(rows, schema=COMPARISON_SCHEMA)
    failed = [check for check in audit_rows(audit_comparisons(edited, edited)) if not check["reproduced"]]
    assert [(check["item_id"], check["side"], check["detail"]) for check in failed] == [
        (
            rows[construction]["item_id"],
            f"{rows[construction]['experiment']}: {rows[construction]['a']} vs {rows[construction]['b']}",
            "prefixes of the construction pair differ (every construction is built over the same prefix)",
        )
    ]


def test_an_audit_of_nothing_is_not_measured():
    figures = e4_summary([])
    assert figures["status"] == "not measured"
    for entry in (figures["trajectories"], figures["items"]):
        assert reproduced_of(entry) == (None, 0) and entry["status"] == "not measured" and not entry["measured"]
    assert e4_line(figures) == "E4 audit: not measured (no saved row was audited)"
    assert e4_reading(figures) == [
        "E4 audit: not measured: the audit recomputed no trajectory, so nothing is shown to reproduce."
    ]
