"""Four-choice items: a built-in generator, loaders, prompts and answer scoring.

Everything here is deterministic across processes (seeded random.Random, never
hash()), because item order and choice order feed content-addressed results.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .atomic import atomic_write

LETTERS = ("A", "B", "C", "D")
BUILTIN_SOURCE = "builtin:arith-v1"

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

    @property
    def correct_choice(self) -> str:
        return self.choices[LETTERS.index(self.answer)]


# --------------------------------------------------------------------------
# Built-in arithmetic items

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Greg", "Hana", "Ivan", "Jo")

# A template draws numbers and returns (question, correct value, likely mistakes).
_Template = Callable[[random.Random], tuple[str, int, list[int]]]


def _pencils(rng: random.Random) -> tuple[str, int, list[int]]:
    boxes, per_box = rng.randint(3, 9), rng.randint(4, 12)
    total = boxes * per_box
    sold = rng.randint(2, total // 2)
    q = (
        f"A shop has {boxes} boxes with {per_box} pencils in each box. "
        f"It sells {sold} pencils. How many pencils are left?"
    )
    # Forgetting the sale, selling one box too many/few, adding instead of subtracting.
    return q, total - sold, [total, total - sold - per_box, total - sold + per_box, boxes + per_box - sold]


def _apples(rng: random.Random) -> tuple[str, int, list[int]]:
    name = rng.choice(_NAMES)
    start, bags, per_bag = rng.randint(2, 30), rng.randint(2, 8), rng.randint(3, 12)
    q = (
        f"{name} has {start} apples. {name} buys {bags} bags with {per_bag} apples in each bag. "
        f"How many apples does {name} have now?"
    )
    return q, start + bags * per_bag, [bags * per_bag, start + bags + per_bag, start + (bags - 1) * per_bag]


def _train(rng: random.Random) -> tuple[str, int, list[int]]:
    start = rng.randint(30, 100)
    off, on = rng.randint(3, start // 2), rng.randint(3, 40)
    q = (
        f"A train carries {start} passengers. At the first stop {off} people get off "
        f"and {on} people get on. How many passengers are on the train now?"
    )
    return q, start - off + on, [start - off - on, start + off + on, start - off]


def _groups(rng: random.Random) -> tuple[str, int, list[int]]:
    groups, size = rng.randint(2, 9), rng.randint(3, 15)
    students, extra = groups * size, rng.randint(2, 6)
    q = (
        f"{students} students are split equally into {groups} groups. "
        f"Then {extra} more students join each group. How many students are in each group now?"
    )
    return q, size + extra, [size, students + extra, size + extra * groups, size + extra + 1]


def _cookies(rng: random.Random) -> tuple[str, int, list[int]]:
    per_hour, hours = rng.randint(6, 20), rng.randint(2, 8)
    baked = per_hour * hours
    friends = rng.randint(2, 6)
    each = rng.randint(1, max(1, baked // (2 * friends)))
    q = (
        f"A baker makes {per_hour} cookies each hour for {hours} hours. "
        f"The baker gives {each} cookies to each of {friends} friends. How many cookies are left?"
    )
    return q, baked - each * friends, [baked, baked - each, baked - each - friends, baked - each * friends + each]


_TEMPLATES: tuple[_Template, ...] = (_pencils, _apples, _train, _groups, _cookies)


def _pick_distractors(rng: random.Random, correct: int, mistakes: list[int]) -> list[int]:
    wrong: list[int] = []
    candidates = list(mistakes)
    rng.shuffle(candidates)  # so the same kind of mistake is not always picked first
    for value in candidates:
        if value > 0 and value != correct and value not in wrong:
            wrong.append(value)
        if len(wrong) == 3:
            return wrong
    # Templates can collide (e.g. zero sold); pad with near misses, which are always plausible.
    offsets = [-10, -3, -2, -1, 1, 2, 3, 5, 10]
    while len(wrong) < 3:
        value = correct + rng.choice(offsets)
        if value > 0 and value != correct and value not in wrong:
            wrong.append(value)
    return wrong


def make_default_items(n: int = 200, seed: int = 0) -> list[Item]:
    """Deterministic grade-school arithmetic items: same (n, seed) -> same list in any process."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    items = []
    positions: list[int] = []
    for i in range(n):
        template = _TEMPLATES[i % len(_TEMPLATES)]  # cycle so every template is equally represented
        question, correct, mistakes = template(rng)
        values = _pick_distractors(rng, correct, mistakes)
        if not positions:
            # Deal answer positions from shuffled blocks of four so A-D stay balanced
            # (exactly, for n divisible by 4) and position bias cannot masquerade as accuracy.
            positions = list(range(4))
            rng.shuffle(positions)
        values.insert(positions.pop(), correct)
        choices = tuple(str(v) for v in values)
        items.append(
            Item(
                item_id=f"arith-{i:03d}",
                question=question,
                choices=choices,  # type: ignore[arg-type]
                answer=LETTERS[values.index(correct)],
                source=BUILTIN_SOURCE,
            )
        )
    return items


# --------------------------------------------------------------------------
# Writing and loading


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
        lines = io.StringIO(data[:error.start].decode(encoding), newline=None).readlines()
        lineno = len(lines) + (1 if not lines or lines[-1].endswith("\n") else 0)
        raise ItemError(f"items file {path} line {lineno}: not UTF-8 text (byte 0x{data[error.start]:02x})"
                        " — save the file as UTF-8") from None


def _parse_jsonl(path: Path) -> list[tuple[int, Item]]:
    rows: list[tuple[int, Item]] = []
    with io.StringIO(_read_text(path, "utf-8"), newline=None) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue

            def bad(problem: str) -> ItemError:
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


def _shuffled_gpqa_choices(correct: str, incorrect: list[str], shuffle_seed: int, record_id: str) -> tuple[tuple[str, ...], str]:
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
                raise ItemError(f"items file {path} line {lineno}: malformed CSV ({e}) — fix or remove that row") from None
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


# --------------------------------------------------------------------------
# Prompting and scoring

_INSTRUCTION = (
    "Answer the following multiple-choice question. Think step by step, "
    "then finish with a final line of the form \"Answer: X\" where X is one of A, B, C, D."
)


def prompt_text(item: Item) -> str:
    options = "\n".join(f"{letter}) {choice}" for letter, choice in zip(LETTERS, item.choices))
    return f"{_INSTRUCTION}\n\nQuestion: {item.question}\n\n{options}"


def build_messages(item: Item) -> list[dict]:
    """Chat messages for tokenizer.apply_chat_template."""
    return [{"role": "user", "content": prompt_text(item)}]


# Keyword is case-insensitive, letter is not: "answer: a" is more often prose than a choice.
# Optional markdown bold around the keyword/colon and brackets around the letter.
# "The answer is X" is accepted too: small chat models write it far more often
# than the requested "Answer: X", and counting it unparsable would hide real labels.
_ANSWER_RE = re.compile(r"\b(?i:answer)(?:\s*\**\s*:|\s+is)\s*\**\s*[(\[]?\s*([A-D])\b")


def extract_answer(text: str) -> str | None:
    """The letter of the last "Answer: X" (or "answer is X") in text, or None."""
    matches = _ANSWER_RE.findall(text)
    return matches[-1] if matches else None


def score(item: Item, generated_text: str) -> tuple[str | None, bool]:
    """(parsed letter or None, correct); an unparseable answer counts as wrong."""
    letter = extract_answer(generated_text)
    return letter, letter is not None and letter == item.answer
