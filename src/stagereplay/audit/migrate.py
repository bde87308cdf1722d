"""Rewrite a ledger's provenance.json of format 1 as the current format: ``python -m stagereplay.audit.migrate LEDGER``.

Format 1 hashed each tokenizer file of a Hugging Face folder with xxh3-64; the current format hashes
it with xxh3-128 (``ledger.fingerprint.file_digest``, the one file digest). Only the tokenizer
fingerprints of folder checkpoints depend on it (a GGUF's tokenizer is its metadata, the model
fingerprint was xxh3-128 already), so the migration recomputes those: it first checks that the
files still give the recorded 64-bit fingerprint, so it never records files the run did not use,
then writes the record again with the new ones and a new digest. Nothing else in the ledger changes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import xxhash

from stagereplay.inputs.checkpoints import read_model_record
from stagereplay.ledger.layout import RELATIVE
from stagereplay.ledger.provenance import (
    FORMAT,
    OLD_FILE_DIGESTS,
    ProvenanceError,
    folder_tokenizer,
    value_digest,
    write_provenance,
)


def old_file_digest(path: Path) -> str:
    """Format 1's file digest: xxh3-64, streamed."""
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            hasher.update(block)
    return hasher.hexdigest()


def migrate_provenance(root: str | Path) -> list[str]:
    """Rewrite ``root``'s provenance.json of format 1 as the current format; one line per change made.
    ProvenanceError (one line with its fix) when the record is not format 1 or its files changed."""
    root = Path(root)
    path = root / RELATIVE.provenance
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProvenanceError(f"{path} is missing — nothing to migrate") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProvenanceError(f"{path} is not valid JSON ({error}) — nothing to migrate") from None
    if not isinstance(document, dict) or document.get("format") != OLD_FILE_DIGESTS:
        found = document.get("format") if isinstance(document, dict) else None
        raise ProvenanceError(
            f"{path} is of format {found}, not {OLD_FILE_DIGESTS} — only a record of format {OLD_FILE_DIGESTS} is migrated"
        )
    body = {key: value for key, value in document.items() if key != "digest"}
    if value_digest(body) != document.get("digest"):
        raise ProvenanceError(
            f"{path}: its content does not match its digest (it was edited) — rerun snakemake --forcerun provenance"
            " to record the inputs again"
        )
    changes = []
    for name, recorded in body["checkpoints"].items():
        record_path = root / RELATIVE.model_record(name)
        if not record_path.is_file():
            raise ProvenanceError(f"{record_path} is missing — restore the ledger's model record, then migrate")
        record = read_model_record(record_path)
        if "gguf" in record:
            continue  # a GGUF's tokenizer fingerprint is over its metadata: no file digest in it
        folder = Path(record["folder"])
        if not folder.is_dir():
            raise ProvenanceError(
                f"{folder} is missing — the tokenizer files of checkpoint {name} are needed to migrate; restore them"
            )
        old, _ = folder_tokenizer(folder, old_file_digest)
        if old != recorded["tokenizer_fingerprint"]:
            raise ProvenanceError(
                f"{folder}: the tokenizer files of checkpoint {name} are not the ones the run recorded"
                " — restore the run's files, then migrate"
            )
        new, _ = folder_tokenizer(folder)
        recorded["tokenizer_fingerprint"] = new
        changes.append(f"checkpoint {name}: tokenizer fingerprint {old} (64-bit file digests) -> {new}")
    body["format"] = FORMAT
    write_provenance(path, {**body, "digest": value_digest(body)})
    return [*changes, f"{path}: format {OLD_FILE_DIGESTS} -> {FORMAT}"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m stagereplay.audit.migrate LEDGER", file=sys.stderr)
        return 2
    try:
        lines = migrate_provenance(args[0])
    except ProvenanceError as error:
        print(f"stagereplay: {error}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
