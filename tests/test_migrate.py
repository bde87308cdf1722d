"""The one file digest (fingerprint.file_digest, xxh3-128) and the migration of a provenance record of
format 1 (tokenizer files hashed with xxh3-64). A small ledger of its own: items, a model record and a
folder of tokenizer files, recorded by build_provenance as the provenance rule does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from stagereplay.audit.migrate import migrate_provenance, old_file_digest
from stagereplay.audit.provenance_check import verify_provenance
from stagereplay.engines.registry import ENGINE_LIBRARIES
from stagereplay.inputs.checkpoints import model_fingerprint
from stagereplay.ledger.fingerprint import FILE_BLOCK, bytes_digest, file_digest
from stagereplay.ledger.provenance import (
    OldFileDigests,
    ProvenanceError,
    build_provenance,
    folder_tokenizer,
    read_provenance,
    value_digest,
    write_provenance,
)
from stagereplay.report.stamp import stamp, stamp_problem

REPO_ITEMS = "data/items.jsonl"


def test_the_file_digest_is_the_bytes_digest_of_its_content_for_any_size(tmp_path):
    for size in (0, 1, FILE_BLOCK - 1, FILE_BLOCK, FILE_BLOCK + 7):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        path = tmp_path / f"f{size}"
        path.write_bytes(data)
        assert file_digest(path) == bytes_digest(data) == xxhash.xxh3_128(data).hexdigest()


def test_the_stamp_keeps_its_digests():
    text = stamp("# card\n", b"{}")
    source, body = xxhash.xxh3_128(b"{}").hexdigest(), xxhash.xxh3_128(b"# card\n").hexdigest()
    assert text == f"# card\n<!-- stagereplay stamp: source xxh3-128 {source}; body xxh3-128 {body} -->\n"
    assert stamp_problem(text, b"{}") is None


@pytest.fixture()
def ledger(tmp_path):
    """A ledger holding items.jsonl, one folder checkpoint (tokenizer files, a template) and its provenance."""
    root = tmp_path / "ledger"
    folder = root / "models" / "tiny" / "random"
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (folder / "vocab.json").write_text('{"a": 0}')
    (folder / "model.safetensors").write_bytes(b"weights")  # only hashed here, never loaded
    record = {"folder": "random", "fingerprint": model_fingerprint(folder), "source": "random:0"}
    (root / "models" / "tiny" / "model.json").write_text(json.dumps(record))
    shutil.copy(Path(__file__).resolve().parents[1] / REPO_ITEMS, root / "items.jsonl")
    document = build_provenance(
        {"ledger_dir": str(root), "stage": {}},
        root / "items.jsonl",
        {"tiny": {**record, "folder": str(folder), "engine": "transformers"}},
        ENGINE_LIBRARIES,
    )
    write_provenance(root / "provenance.json", document)
    return root


def make_format_1(root) -> dict:
    """Rewrite the ledger's provenance.json as format 1 wrote it (64-bit file digests); returns the current one."""
    path = root / "provenance.json"
    current = json.loads(path.read_text())
    old = json.loads(path.read_text())
    for name, checkpoint in old["checkpoints"].items():
        folder = root / "models" / name / "random"
        checkpoint["tokenizer_fingerprint"] = folder_tokenizer(folder, old_file_digest)[0]
    old["format"] = 1
    body = {key: value for key, value in old.items() if key != "digest"}
    path.write_text(json.dumps({**body, "digest": value_digest(body)}, indent=2))
    return current


def test_a_format_1_record_is_named_with_its_migration_and_migrates_to_the_same_record(ledger):
    current = make_format_1(ledger)
    with pytest.raises(OldFileDigests) as error:
        read_provenance(ledger / "provenance.json")
    assert str(error.value) == (
        f"{ledger / 'provenance.json'}: the ledger's provenance uses the old 64-bit file digests (format 1, before"
        f" xxh3-128) — migrate it: python -m stagereplay.audit.migrate {ledger}"
    )
    faults = []
    assert verify_provenance(ledger, True, faults) is None
    assert [str(fault) for fault in faults] == [
        "provenance.json: the ledger's provenance uses the old 64-bit file digests (format 1, before xxh3-128)"
        f" — migrate it: python -m stagereplay.audit.migrate {ledger}"
    ]

    result = subprocess.run(
        [sys.executable, "-m", "stagereplay.audit.migrate", str(ledger)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "checkpoint tiny: tokenizer fingerprint" in result.stdout
    assert json.loads((ledger / "provenance.json").read_text()) == current
    faults = []
    assert verify_provenance(ledger, True, faults) == current
    assert faults == []


def test_the_migration_refuses_changed_files_and_a_current_record(ledger):
    with pytest.raises(ProvenanceError, match="is of format 2, not 1"):
        migrate_provenance(ledger)
    make_format_1(ledger)
    (ledger / "models" / "tiny" / "random" / "vocab.json").write_text('{"b": 0}')
    before = (ledger / "provenance.json").read_text()
    with pytest.raises(
        ProvenanceError, match="the tokenizer files of checkpoint tiny are not the ones the run recorded"
    ):
        migrate_provenance(ledger)
    assert (ledger / "provenance.json").read_text() == before


def test_the_audit_refuses_a_format_1_record_naming_its_migration(ledger):
    from stagereplay.audit.recorded_design import AuditRefused, audit_config

    make_format_1(ledger)
    (ledger / "tables").mkdir()
    (ledger / "summary.json").write_text("{}")
    with pytest.raises(AuditRefused) as error:
        audit_config({"ledger_dir": str(ledger)})
    assert str(error.value) == (
        f"audit: {ledger / 'provenance.json'}: the ledger's provenance uses the old 64-bit file digests (format 1,"
        f" before xxh3-128) — migrate it: python -m stagereplay.audit.migrate {ledger}"
    )
