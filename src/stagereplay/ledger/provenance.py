"""What a ledger was computed from: ``provenance.json``, written by the run and checked by ``verify``.

It holds the resolved config (every key after the schema's defaults, less ``ledger_dir``: where a
ledger lies is not part of its design), a fingerprint of each field of each item the run used, each
checkpoint's model fingerprint with separate ones of its tokenizer and chat template, the versions of
the libraries and engines, the project version and, in a git checkout, the commit. A digest over all
of it makes an edit of the record itself visible. No absolute path is recorded, so a ledger copied to
another directory or machine verifies and audits the same. No torch here.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import xxhash

from stagereplay.ledger.atomic import atomic_write_text
from stagereplay.ledger.fingerprint import file_digest
from stagereplay.ledger.jsondiff import first_difference

# 2: a tokenizer file is hashed with xxh3-128 (fingerprint.file_digest). 1 hashed it with xxh3-64;
# such a record is rewritten by MIGRATE (stagereplay.audit.migrate), which checks the old digests first.
FORMAT = 2
OLD_FILE_DIGESTS = 1
MIGRATE = "python -m stagereplay.audit.migrate"
ITEM_FIELDS = ("question", "choices", "answer")
# Outside the design: where the ledger lies, and what the audit itself may set (it is the audit's choice).
NOT_DESIGN = ("ledger_dir", "audit", "mode")
# Libraries whose versions every record keeps besides the engines' own (engines.registry.ENGINE_LIBRARIES).
LEDGER_LIBRARIES = ("gguf", "safetensors", "snakemake")
# The files of a Hugging Face folder that make its tokenizer (the chat template is recorded on its own).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class ProvenanceError(ValueError):
    """One-line message naming the problem and the fix."""


class OldFileDigests(ProvenanceError):
    """A record of format 1: its tokenizer fingerprints are over 64-bit file digests; the fix is MIGRATE."""


def value_digest(value) -> str:
    """xxh3-64 of a JSON value in canonical form (sorted keys, UTF-8)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8"))


def design_of(config: dict) -> dict:
    """The keys of a resolved config that decide what a run computes."""
    return {key: value for key, value in config.items() if key not in NOT_DESIGN}


def item_fingerprint(question: str, choices: list[str], answer: str) -> dict[str, str]:
    """An item's question and choices as digests; its answer key as itself (verify recomputes labels from it)."""
    return {"question": value_digest(question), "choices": value_digest(list(choices)), "answer": answer}


def item_fingerprints(items_path: str | Path) -> dict[str, dict[str, str]]:
    """Each item of a normalised item file (``stagereplay items``), by id."""
    rows = [json.loads(line) for line in Path(items_path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return {row["id"]: item_fingerprint(row["question"], row["choices"], row["answer"]) for row in rows}


def folder_tokenizer(folder: Path, digest: Callable[[Path], str] = file_digest) -> tuple[str, str | None]:
    """(digest of the tokenizer files, digest of the chat template or None) of a Hugging Face folder.
    ``digest`` hashes one file (the migration passes format 1's xxh3-64 to check an old record)."""
    files = {name: digest(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()}
    template = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "tokenizer_config.json").is_file():
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    return value_digest(files), (value_digest(template) if template is not None else None)


def _gguf_tokenizer(path: Path) -> tuple[str, str | None]:
    """The same for a GGUF file: its ``tokenizer.*`` metadata, the chat template apart."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields, template = {}, None
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name == "tokenizer.chat_template":
            template = value
        else:
            fields[name] = value
    return value_digest(fields), (value_digest(template) if template is not None else None)


def checkpoint_fingerprints(record: dict) -> dict:
    """What one checkpoint contributes: engine, source, the model fingerprint, tokenizer and template. The
    record names its engine (``engines.registry.record_with_engine`` fills in the default)."""
    if "gguf" in record:
        tokenizer, template = _gguf_tokenizer(Path(record["gguf"]))
    else:
        tokenizer, template = folder_tokenizer(Path(record["folder"]))
    return {
        "engine": record["engine"],
        "source": record["source"],
        "model_fingerprint": record["fingerprint"],
        "tokenizer_fingerprint": tokenizer,
        "chat_template_fingerprint": template,
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of the checkout this code runs from (``+dirty`` with uncommitted changes); None outside git."""
    source = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{commit}+dirty" if dirty else commit


def library_versions(engine_libraries: tuple[str, ...]) -> dict:
    """Python's, the engines' libraries', the ledger's libraries' and stagereplay's versions, and the commit."""
    import platform

    from stagereplay import __version__

    return {
        "python": platform.python_version(),
        **{name: _version(name.replace("_", "-")) for name in (*engine_libraries, *LEDGER_LIBRARIES)},
        "stagereplay": __version__,
        "git_commit": git_commit(),
    }


def build_provenance(
    config: dict, items_path: str | Path, records: dict[str, dict], engine_libraries: tuple[str, ...]
) -> dict:
    """The record of a run: ``config`` resolved, the ledger's item file, each used checkpoint's model record
    (its engine named) and the versions of the engines' libraries."""
    document = {
        "format": FORMAT,
        "config": design_of(config),
        "items": item_fingerprints(items_path),
        "checkpoints": {name: checkpoint_fingerprints(record) for name, record in sorted(records.items())},
        "environment": library_versions(engine_libraries),
    }
    return {**document, "digest": value_digest(document)}


def write_provenance(path: str | Path, document: dict) -> None:
    atomic_write_text(path, json.dumps(document, indent=2, ensure_ascii=False) + "\n")


REWRITE = "rerun snakemake --forcerun provenance to record the inputs again"


def read_provenance(path: str | Path) -> dict:
    """A ledger's provenance.json, its digest checked (ProvenanceError names the problem)."""
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProvenanceError(f"{path} is missing — {REWRITE}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProvenanceError(f"{path} is not valid JSON ({error}) — {REWRITE}") from None
    if isinstance(document, dict) and document.get("format") == OLD_FILE_DIGESTS:
        raise OldFileDigests(
            f"{path}: the ledger's provenance uses the old 64-bit file digests (format {OLD_FILE_DIGESTS}, before"
            f" xxh3-128) — migrate it: {MIGRATE} {shlex.quote(str(path.parent))}"
        )
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ProvenanceError(f"{path} is not a provenance record of format {FORMAT} — {REWRITE}")
    body = {key: value for key, value in document.items() if key != "digest"}
    if value_digest(body) != document.get("digest"):
        raise ProvenanceError(f"{path}: its content does not match its digest (it was edited) — {REWRITE}")
    return document


def first_config_difference(recorded: dict, given: dict) -> tuple | None:
    """The first key path at which two designs differ (keys in sorted order, a list compared whole), or None."""
    return first_difference(recorded, given, sort_keys=True, into_lists=False, strict=False)
