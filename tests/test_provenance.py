"""A ledger proves what it was computed from: provenance.json, verify's input and label checks,
the audit of the recorded design, and a changed store_caches as a storage operation. Real runs of
the workflow (config/test.yaml, the tiny random Qwen2) and real ledgers, damaged on copies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pyarrow as pa
import pytest
from workflow_helpers import REPO, copy_run, snakemake, stagereplay, write_config

from stagereplay.audit.faults import Report
from stagereplay.audit.labels import verify_labels
from stagereplay.design.schema import load_config
from stagereplay.ledger.provenance import design_of, value_digest
from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, VOCAB_SCHEMA, read_table, write_table

pytestmark = pytest.mark.slow


def fault_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("stagereplay: fault:")]


def rewrite_provenance(ledger, change) -> None:
    """Edit provenance.json and give it a digest that fits (what a careful forger would do)."""
    path = ledger / "provenance.json"
    document = json.loads(path.read_text())
    change(document)
    body = {key: value for key, value in document.items() if key != "digest"}
    path.write_text(json.dumps({**body, "digest": value_digest(body)}, indent=2))


def edit_item(path, index, field, value) -> str:
    lines = path.read_text().splitlines()
    row = json.loads(lines[index])
    row[field] = value
    lines[index] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    return row["id"]


# --- 1. provenance in the ledger ---------------------------------------------------------------


def test_the_run_records_its_design_items_models_and_versions(test_run):
    workdir, ledger, config = test_run
    record = json.loads((ledger / "provenance.json").read_text())
    assert record["config"] == json.loads(json.dumps(design_of(load_config(config))))
    assert list(record["config"]["checkpoints"])[0] == "tiny-qwen2"  # the primary checkpoint stays first
    items = [json.loads(line) for line in (ledger / "items.jsonl").read_text().splitlines()]
    assert sorted(record["items"]) == sorted(row["id"] for row in items)
    assert {record["items"][row["id"]]["answer"] for row in items} <= set("ABCD")
    model = json.loads((ledger / "models" / "tiny-qwen2" / "model.json").read_text())
    checkpoint = record["checkpoints"]["tiny-qwen2"]
    assert checkpoint["model_fingerprint"] == model["fingerprint"]
    assert checkpoint["tokenizer_fingerprint"] and checkpoint["chat_template_fingerprint"]
    import torch

    assert record["environment"]["torch"] == torch.__version__
    # Nothing depends on where the ledger lies: no absolute path in the record or in the model record.
    assert str(workdir) not in (ledger / "provenance.json").read_text()
    assert not model["folder"].startswith("/")


def test_a_ledger_copied_elsewhere_verifies_the_same(test_run, tmp_path):
    _, ledger, _ = test_run
    copy = tmp_path / "elsewhere" / "ledger"
    shutil.copytree(ledger, copy)
    result = stagereplay("verify", copy)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("verify: ledger OK")


# --- 2. verify checks the inputs and the derived labels -----------------------------------------


@pytest.fixture()
def ledger_copy(test_run, tmp_path):
    _, ledger, _ = test_run
    copy = tmp_path / "ledger"
    shutil.copytree(ledger, copy)
    return copy


def test_a_changed_answer_key_is_one_line_naming_item_and_field(ledger_copy):
    row = json.loads((ledger_copy / "items.jsonl").read_text().splitlines()[1])
    item = edit_item(ledger_copy / "items.jsonl", 1, "answer", "C" if row["answer"] != "C" else "D")
    result = stagereplay("verify", ledger_copy)
    assert result.returncode == 1
    assert fault_lines(result) == [
        f"stagereplay: fault: items.jsonl: item {item}: its answer differs from the one the run used — restore the"
        " items the run used (verify --inputs ITEMS names the file), or rerun snakemake on the new items"
    ]


def test_a_changed_question_is_named(ledger_copy):
    item = edit_item(ledger_copy / "items.jsonl", 0, "question", "What is 2 + 2?")
    faults = fault_lines(stagereplay("verify", ledger_copy))
    assert len(faults) == 1 and f"item {item}: its question differs" in faults[0]


def test_an_edited_provenance_record_is_caught_by_its_digest(ledger_copy):
    path = ledger_copy / "provenance.json"
    path.write_text(path.read_text().replace('"suffix_tokens": 8', '"suffix_tokens": 9'))
    faults = fault_lines(stagereplay("verify", ledger_copy))
    assert faults == [
        "stagereplay: fault: provenance.json: its content does not match its digest (it was edited)"
        " — rerun snakemake --forcerun provenance to record the inputs again"
    ]


def rewrite_rows(ledger, change) -> dict:
    """Change the first row of a shard table the same way there and in the gathered table, each written back
    with a fresh digest of its rows (so the table checks pass). Returns the row as it was."""
    shard = ledger / "runs" / "live" / "tiny-qwen2" / "bf16" / "rep0" / "shard-000.parquet"
    rows = read_table(shard, TRAJECTORY_SCHEMA).to_pylist()
    original = dict(rows[0])
    change(rows[0])
    write_table(rows, TRAJECTORY_SCHEMA, shard)
    gathered = ledger / "tables" / "trajectories.parquet"
    rows = read_table(gathered, TRAJECTORY_SCHEMA).to_pylist()
    for row in rows:
        if row == original:
            change(row)
    write_table(rows, TRAJECTORY_SCHEMA, gathered)
    return original


def test_a_label_rewritten_with_a_fitting_digest_is_recomputed_from_the_answer_key(ledger_copy):
    row = rewrite_rows(ledger_copy, lambda row: row.update(correct=not row["correct"]))
    faults = fault_lines(stagereplay("verify", ledger_copy))
    assert len(faults) == 1, faults
    assert f"item {row['item_id']} (and 1 more rows): correct is {not row['correct']}, but the answer key" in faults[0]


def test_a_suffix_text_is_checked_against_what_its_tokens_spell(test_run, tmp_path):
    # One of the tiny run's rows given tokens a small vocabulary spells whole; its prefix object is not given, so
    # its stage text is named as not rebuilt and the labels are parsed from the recorded one.
    _, ledger, _ = test_run
    root = tmp_path / "ledger"
    (root / "vocab").mkdir(parents=True)
    write_table(
        [{"token_id": 1, "text": "Answer"}, {"token_id": 2, "text": ": "}, {"token_id": 3, "text": "B"}]
        + [{"token_id": 4, "text": "<|im_end|>"}],
        VOCAB_SCHEMA,
        root / "vocab" / "tiny-qwen2.parquet",
    )
    row = read_table(ledger / "tables" / "trajectories.parquet", TRAJECTORY_SCHEMA).to_pylist()[0]
    key = {row["item_id"]: "B"}

    def faults_for(**fields):
        table = pa.Table.from_pylist([{**row, "reasoning_text": "", **fields}], schema=TRAJECTORY_SCHEMA)
        report = Report()
        verify_labels(root, key, {"tables/trajectories.parquet": table}, {}, report)
        (note,) = report.notes
        assert note.startswith("reasoning_text of 1 rows not rebuilt from their tokens")
        return [str(fault) for fault in report.faults]

    labels = {"answer": "B", "parsed": True, "correct": True, "readout_answer": "B", "readout_correct": True}
    spelled = {"suffix_tokens": [1, 2, 3], "suffix_stop": "budget", "suffix_text": "Answer: B", **labels}
    assert faults_for(**spelled) == []
    # A suffix that ended at EOS was decoded without that special token.
    assert faults_for(**{**spelled, "suffix_tokens": [1, 2, 3, 4], "suffix_stop": "eos"}) == []
    (fault,) = faults_for(**{**spelled, "suffix_text": "Answer: C"})
    assert "suffix_text is not what its suffix tokens spell" in fault
    (fault,) = faults_for(**{**spelled, "correct": False})
    assert "correct is False, but the answer key (B) and the suffix tokens give True" in fault


def test_a_changed_model_file_in_the_ledger_is_named(ledger_copy):
    folder = ledger_copy / "models" / "tiny-qwen2" / "random"
    tokenizer = folder / "tokenizer_config.json"
    config = json.loads(tokenizer.read_text())
    config["model_max_length"] = 7
    tokenizer.write_text(json.dumps(config))
    faults = fault_lines(stagereplay("verify", ledger_copy))
    assert any("the tokenizer of checkpoint tiny-qwen2 differs from the one the run used" in line for line in faults)
    assert any("the model of checkpoint tiny-qwen2 differs" in line for line in faults)


def test_a_record_with_64_bit_file_digests_is_one_line_naming_its_migration(ledger_copy):
    from stagereplay.audit.migrate import old_file_digest
    from stagereplay.ledger.provenance import folder_tokenizer

    current = json.loads((ledger_copy / "provenance.json").read_text())
    folder = ledger_copy / "models" / "tiny-qwen2" / "random"

    def as_format_1(document):
        document["format"] = 1
        document["checkpoints"]["tiny-qwen2"]["tokenizer_fingerprint"] = folder_tokenizer(folder, old_file_digest)[0]

    rewrite_provenance(ledger_copy, as_format_1)
    result = stagereplay("verify", ledger_copy)
    assert result.returncode == 1
    assert fault_lines(result) == [
        "stagereplay: fault: provenance.json: the ledger's provenance uses the old 64-bit file digests (format 1,"
        f" before xxh3-128) — migrate it: python -m stagereplay.audit.migrate {ledger_copy}"
    ]
    migrated = subprocess.run(
        [sys.executable, "-m", "stagereplay.audit.migrate", str(ledger_copy)], capture_output=True, text=True
    )
    assert migrated.returncode == 0, migrated.stderr
    assert json.loads((ledger_copy / "provenance.json").read_text()) == current
    result = stagereplay("verify", ledger_copy)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("verify: ledger OK")


def test_a_ledger_without_provenance_is_a_fault_naming_the_fix(ledger_copy):
    (ledger_copy / "provenance.json").unlink()
    faults = fault_lines(stagereplay("verify", ledger_copy))
    assert faults == [
        "stagereplay: fault: provenance.json: missing, though summary.json was computed: nothing records what this"
        " ledger was computed from — rerun snakemake (it records the config, items and models of the run)"
    ]


def test_verify_says_whether_given_inputs_are_the_runs(test_run, tmp_path):
    workdir, ledger, config = test_run
    items = REPO / "data" / "items.jsonl"
    # From the run's working directory, where snakemake resolved the config as verify does now.
    result = stagereplay("verify", ledger, "--inputs", items, "--config", config, cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert f"inputs: {config} is the design the ledger was made from" in result.stdout
    assert f"inputs: {items} holds the 4 items the ledger was made from" in result.stdout

    other = write_config(tmp_path / "other.yaml", ledger_dir=str(ledger), stage={"suffix_tokens": 9})
    result = stagereplay("verify", ledger, "--config", other, cwd=workdir)
    assert fault_lines(result) == [
        f"stagereplay: fault: {other}: stage.suffix_tokens is 9, the ledger was made with 8 — pass the config of"
        " the run, or rerun snakemake with this one to update the ledger"
    ]
    changed = tmp_path / "items.jsonl"
    shutil.copy(items, changed)
    item = edit_item(changed, 3, "choices", ["1", "2", "3", "4"])
    faults = fault_lines(stagereplay("verify", ledger, "--inputs", changed))
    assert faults == [
        f"stagereplay: fault: {changed}: item {item}: its choices differs from the one the run used"
        " — pass the item file of the run"
    ]


# --- 3. the audit reads the design from the ledger (its run on an edited config: test_audit.audited) ---


def test_the_audit_refuses_a_ledger_without_provenance_in_one_line(test_run, tmp_path):
    workdir, _, _ = test_run
    ledger, config = copy_run(workdir, tmp_path / "run")
    (ledger / "provenance.json").unlink()
    result = snakemake(tmp_path / "run", config, "--config", "mode=audit")
    assert result.returncode != 0
    assert "provenance.json is missing, so the design to rerun is unknown — run snakemake once" in result.stderr
    assert not (ledger / "audit").exists()


def test_the_audit_refuses_other_engine_versions_naming_them(test_run, tmp_path):
    workdir, _, _ = test_run
    ledger, config = copy_run(workdir, tmp_path / "run")
    import torch

    rewrite_provenance(ledger, lambda record: record["environment"].update(torch="2.0.0"))
    result = snakemake(tmp_path / "run", config, "--config", "mode=audit")
    assert result.returncode != 0
    assert (
        f"audit: the ledger was computed with torch 2.0.0, this environment has {torch.__version__}"
        " — install torch==2.0.0 to audit it" in result.stderr
    )


def test_the_audit_refuses_a_missing_model_naming_it(test_run, tmp_path):
    workdir, _, _ = test_run
    ledger, config = copy_run(workdir, tmp_path / "run")
    shutil.rmtree(ledger / "models" / "tiny-qwen2" / "random")
    result = snakemake(tmp_path / "run", config, "--config", "mode=audit")
    assert result.returncode != 0
    assert (
        f"audit: the model of checkpoint 'tiny-qwen2' is missing ({ledger / 'models' / 'tiny-qwen2' / 'random'})"
        in result.stderr
    )


def test_the_audit_never_reruns_a_saved_job(test_run, tmp_path):
    workdir, _, _ = test_run
    ledger, config = copy_run(workdir, tmp_path / "run")
    shard = next((ledger / "runs" / "live").rglob("rep0/shard-000.parquet"))
    shard.unlink()
    result = snakemake(tmp_path / "run", config, "--dry-run", "--config", "mode=audit")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Missing input files for rule live" in output
    assert "the-audit-never-reruns-the-saved-ledger--finish-the-run-with-a-plain-snakemake-first" in output
