"""Four-choice items: the Item, loading it from JSONL or a GPQA-style CSV, validating, writing.

Everything here is deterministic across processes (seeded random.Random, never
hash()), because item order and choice order feed content-addressed results.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stagereplay.ledger.atomic import atomic_write

LETTERS = ("A", "B", "C", "D")

# Ids become file names downstream, so no separators, no "..", no leading dot.
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

GPQA_COLUMNS = (
    "Question",
    "Correct Answer",
    "Incorrect Answer 1",
    "Incorrect Answer 2",
    "Incorrect Answer 3",
    "Record ID",
)
_FORMATS_BY_SUFFIX = {".jsonl": "jsonl", ".csv": "gpqa_csv"}


class ItemError(ValueError):
    """One-line message naming the problem (file and 1-based line where relevant) and the fix."""


@dataclass(frozen=True)
class Item:
    item_id: str
    question: str
    choices: tuple[str, str, str, str]  # in presented order A, B, C, D
    answer: str  # correct letter "A".."D"
    source: str  # e.g. "builtin:arith-v1" or the file name it came from

    def __post_init__(self) -> None:
        # Loaders validate with file/line context first; this only guards direct construction.
        if not isinstance(self.choices, tuple) or len(self.choices) != 4:
            raise ItemError(f"item {self.item_id!r}: choices must be a tuple of 4 strings")
        if self.answer not in LETTERS:
            raise ItemError(f"item {self.item_id!r}: answer must be one of A-D, got {self.answer!r}")


def _item_to_json(item: Item) -> dict:
    return {
        "id": item.item_id,
        "question": item.question,
        "choices": list(item.choices),
        "answer": item.answer,
        "source": item.source,
    }


def write_items_jsonl(items: list[Item], path: str | os.PathLike) -> None:
    """Write one JSON object per line, atomically (readers never see a half-written file)."""
    lines = "".join(json.dumps(_item_to_json(item), ensure_ascii=False) + "\n" for item in items)
    atomic_write(path, lambda temporary: temporary.write_text(lines, encoding="utf-8", newline="\n"))


def _nonempty_str(value: object) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _read_text(path: Path, encoding: str) -> str:
    """The whole file decoded; bytes that are not UTF-8 give the line they are on (a file is read
    whole because a streaming decoder fails at a buffer boundary, not at a line)."""
    data = path.read_bytes()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as error:
        # Lines as a text-mode file counts them (universal newlines).
        lines = io.StringIO(data[: error.start].decode(encoding), newline=None).readlines()
        lineno = len(lines) + (1 if not lines or lines[-1].endswith("\n") else 0)
        raise ItemError(
            f"items file {path} line {lineno}: not UTF-8 text (byte 0x{data[error.start]:02x}) — save the file as UTF-8"
        ) from None


def _parse_jsonl(path: Path) -> list[tuple[int, Item]]:
    rows: list[tuple[int, Item]] = []
    with io.StringIO(_read_text(path, "utf-8"), newline=None) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue

            def bad(problem: str, lineno: int = lineno) -> ItemError:
                return ItemError(f"items file {path} line {lineno}: {problem} — fix or remove that line")

            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise bad(f"invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise bad("expected a JSON object")
            for key in ("id", "question", "choices", "answer"):
                if key not in obj:
                    raise bad(f"missing key {key!r}")
            if not _nonempty_str(obj["id"]):
                raise bad("'id' must be a non-empty string")
            if not _nonempty_str(obj["question"]):
                raise bad("'question' must be a non-empty string")
            choices = obj["choices"]
            if not (isinstance(choices, list) and len(choices) == 4 and all(_nonempty_str(c) for c in choices)):
                raise bad("'choices' must be a list of 4 strings")
            answer = obj["answer"]
            # bool is an int subclass; True must not silently mean "B".
            if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer <= 3:
                answer = LETTERS[answer]
            elif answer not in LETTERS:
                raise bad(f"'answer' must be a letter A-D or an index 0-3, got {answer!r}")
            source = obj.get("source", path.name)
            if not _nonempty_str(source):
                raise bad("'source' must be a non-empty string when present")
            item = Item(obj["id"], obj["question"], tuple(choices), answer, source)  # type: ignore[arg-type]
            rows.append((lineno, item))
    return rows


def _shuffled_gpqa_choices(
    correct: str, incorrect: list[str], shuffle_seed: int, record_id: str
) -> tuple[tuple[str, ...], str]:
    # A string seed goes through SHA-512 in random.Random, so the shuffle depends only on
    # (seed, record id): stable across processes and independent of the other rows.
    rng = random.Random(f"{shuffle_seed}:{record_id}")
    texts = [correct, *incorrect]
    order = [0, 1, 2, 3]
    rng.shuffle(order)
    # Track positions rather than texts so a duplicate distractor cannot steal the answer.
    return tuple(texts[i] for i in order), LETTERS[order.index(0)]


def _parse_gpqa_csv(path: Path, shuffle_seed: int) -> list[tuple[int, Item]]:
    rows: list[tuple[int, Item]] = []
    with io.StringIO(_read_text(path, "utf-8-sig"), newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        for column in GPQA_COLUMNS:
            if column not in header:
                raise ItemError(
                    f"items file {path}: missing column {column!r} — GPQA CSV needs columns {', '.join(GPQA_COLUMNS)}"
                )
        while True:
            # GPQA cells contain newlines, so report where the record starts, not where it ends.
            lineno = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                raise ItemError(
                    f"items file {path} line {lineno}: malformed CSV ({e}) — fix or remove that row"
                ) from None
            cells = {c: (row.get(c) or "").strip() for c in GPQA_COLUMNS}
            for column, value in cells.items():
                if not value:
                    raise ItemError(
                        f"items file {path} line {lineno}: empty {column!r} cell — fill it in or remove that row"
                    )
            record_id = cells["Record ID"]
            choices, answer = _shuffled_gpqa_choices(
                cells["Correct Answer"],
                [cells[f"Incorrect Answer {i}"] for i in (1, 2, 3)],
                shuffle_seed,
                record_id,
            )
            rows.append((lineno, Item(record_id, cells["Question"], choices, answer, path.name)))  # type: ignore[arg-type]
    return rows


def load_items(
    path: str | os.PathLike,
    fmt: str = "auto",
    shuffle_seed: int = 0,
    limit: int | None = None,
) -> list[Item]:
    """Load items from JSONL or a GPQA-style CSV, validating ids; keep the first `limit`."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise ItemError(f"limit must be >= 1 (or None for all items), got {limit}")
    if fmt == "auto":
        fmt = _FORMATS_BY_SUFFIX.get(path.suffix.lower(), "")
        if not fmt:
            raise ItemError(
                f"items file {path}: unknown extension {path.suffix!r} — use .jsonl (jsonl) or .csv (gpqa_csv), or pass fmt"
            )
    if fmt not in ("jsonl", "gpqa_csv"):
        raise ItemError(f"unknown items format {fmt!r} — use 'auto', 'jsonl' or 'gpqa_csv'")
    if not path.is_file():
        raise ItemError(f"items file {path} not found — check the path")

    rows = _parse_jsonl(path) if fmt == "jsonl" else _parse_gpqa_csv(path, shuffle_seed)
    if not rows:
        raise ItemError(f"items file {path} contains no items — add at least one")

    first_line: dict[str, int] = {}
    for lineno, item in rows:
        if not _SAFE_ID.match(item.item_id):
            raise ItemError(
                f"items file {path} line {lineno}: id {item.item_id!r} is not file-name safe"
                " — use letters, digits, '.', '_', '-' (not starting with '.' or '-', at most 128 chars)"
            )
        if item.item_id in first_line:
            raise ItemError(
                f"items file {path} line {lineno}: duplicate id {item.item_id!r} (first on line"
                f" {first_line[item.item_id]}) — make ids unique"
            )
        first_line[item.item_id] = lineno

    items = [item for _, item in rows]
    return items if limit is None else items[:limit]


def items_after(order: list[str], item_id: str) -> Iterator[str]:
    """The items after ``item_id`` in ``order``, wrapping round without end: a batch's companions, a filler's
    sources, a served request's other clients (a fixed function of the item list, not of the ledger's item count)."""
    start = order.index(item_id)
    return (order[(start + offset) % len(order)] for offset in itertools.count(1))
