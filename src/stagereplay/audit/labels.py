"""Verify each trajectory row's texts and labels from its tokens: ``verify_labels``.

A row's ``reasoning_text`` (its stage tokens, after the prompt) and ``suffix_text`` must be what those tokens spell
(``ledger.text``), rebuilt through the run's vocabulary table; ``answer``, ``parsed``, ``correct`` and
``readout_correct`` are then parsed again from the rebuilt text and the answer key provenance.json recorded.

Two rows are not faults, each named in one line instead (``Report.notes``):

- a text the vocabulary cannot rebuild (a token it lacks, or an absent prefix object): the
  recorded text is used;
- a text written before special tokens were kept in it: the rebuild with every ``<…>`` token left out equals it.
  Its labels were parsed from that text and are checked against it; a rerun of the model jobs rewrites it.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pyarrow as pa

from stagereplay.audit.faults import RERUN, Fault, Report
from stagereplay.inputs.scoring import extract_answer
from stagereplay.ledger.layout import RELATIVE
from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, LedgerError, read_vocabulary
from stagereplay.ledger.text import rebuilt_text, spelled_tokens

# How a special token is spelled, by convention (<|im_end|>, <|endoftext|>, </s>, <eos>): the tokens the writer
# before stagereplay kept special tokens left out of a text.
_SPECIAL_SPELLING = re.compile(r"<[^<>\s]+>")

NOT_REBUILT = "not rebuilt"
WITHOUT_SPECIALS = "without special tokens"


def _vocabulary(root: Path, checkpoint: str) -> dict[int, str] | None:
    path = root / RELATIVE.vocab(checkpoint)
    if not path.is_file():
        return None
    try:
        return read_vocabulary(path)
    except LedgerError:  # verify names the table itself; its texts are then not rebuilt (one note)
        return None


def _without_specials(tokens: list[int], vocabulary: dict[int, str], stopped: bool) -> str | None:
    kept = [
        token for token in spelled_tokens(tokens, stopped) if not _SPECIAL_SPELLING.fullmatch(vocabulary.get(token, ""))
    ]
    return rebuilt_text(kept, vocabulary)


def checked_text(tokens, stopped: bool, recorded: str, vocabulary: dict[int, str] | None) -> tuple[str, str | None]:
    """(the text the labels are parsed from, how it was checked): "" when the tokens spell ``recorded``, "fault"
    when they do not, NOT_REBUILT or WITHOUT_SPECIALS (see the module's docstring)."""
    if vocabulary is None or tokens is None:
        return recorded, NOT_REBUILT
    tokens = list(tokens)
    rebuilt = rebuilt_text(tokens, vocabulary, stopped)
    if rebuilt is None:
        return recorded, NOT_REBUILT
    if rebuilt == recorded:
        return rebuilt, ""
    if _without_specials(tokens, vocabulary, stopped) == recorded:
        return recorded, WITHOUT_SPECIALS
    return recorded, "fault"


def verify_labels(
    root: Path, answer_key: dict[str, str], tables: dict[str, pa.Table], prefixes: dict[str, tuple], report: Report
) -> None:
    """Each trajectory row's two texts rebuilt from its tokens (``prefixes``: the prefix objects' tokens, by object
    id) and its labels parsed again from them. One fault per item and problem, however many rows repeat it; one
    note per kind of text not checked in full."""
    vocabularies: dict[str, dict[int, str] | None] = {}
    found: dict[tuple[str, str], list] = {}  # (item, problem) -> [rows, first table]
    notes: Counter = Counter()  # (field, how) -> rows
    for relative, table in tables.items():
        if not table.schema.equals(TRAJECTORY_SCHEMA):
            continue
        for row in table.to_pylist():
            item_id = row["item_id"]
            if item_id not in answer_key:
                found.setdefault((item_id, "is not an item of the run (provenance.json)"), [0, relative])[0] += 1
                continue
            if row["checkpoint"] not in vocabularies:
                vocabularies[row["checkpoint"]] = _vocabulary(root, row["checkpoint"])
            vocabulary = vocabularies[row["checkpoint"]]
            prefix = prefixes.get(row["prefix_object"])
            spans = {
                "reasoning_text": (prefix[row["prompt_length"] :] if prefix else None, row["boundary_reason"]),
                "suffix_text": (row["suffix_tokens"], row["suffix_stop"]),
            }
            texts, misspelled = {}, False
            for field, (tokens, stop) in spans.items():
                texts[field], how = checked_text(tokens, stop == "eos", row[field], vocabulary)
                if how == "fault":
                    what = "stage" if field == "reasoning_text" else "suffix"
                    found.setdefault((item_id, f"{field} is not what its {what} tokens spell"), [0, relative])[0] += 1
                    misspelled = True
                elif how:
                    notes[field, how] += 1
            if misspelled:
                continue
            answer = extract_answer(texts["reasoning_text"] + texts["suffix_text"])
            key = answer_key[item_id]
            expected = {
                "answer": answer,
                "parsed": answer is not None,
                "correct": answer is not None and answer == key,
                "readout_correct": row["readout_answer"] == key,
            }
            for field, value in expected.items():
                if row[field] != value:
                    problem = f"{field} is {row[field]}, but the answer key ({key}) and the suffix tokens give {value}"
                    found.setdefault((item_id, problem), [0, relative])[0] += 1
                    break
    for (item_id, problem), (rows, first) in found.items():
        where = f"{first} item {item_id}" + (f" (and {rows - 1} more rows)" if rows > 1 else "")
        report.faults.append(Fault(where, problem, RERUN))
    for (field, how), rows in sorted(notes.items()):
        report.notes.append(_note(field, how, rows))


def _note(field: str, how: str, rows: int) -> str:
    if how == NOT_REBUILT:
        return (
            f"{field} of {rows} rows not rebuilt from their tokens (the vocabulary table lacks a token, or the"
            " prefix object is absent): their labels are parsed from the"
            " recorded text"
        )
    return (
        f"{field} of {rows} rows was written without the special tokens it holds (by stagereplay before special"
        " tokens were kept): checked as such; snakemake --forcerun live rebuild rewrites it"
    )
