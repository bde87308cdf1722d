import csv
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from stagereplay.experiments.prompts import build_messages, prompt_text
from stagereplay.inputs.default_items import make_default_items
from stagereplay.inputs.items import LETTERS, Item, ItemError, load_items, write_items_jsonl
from stagereplay.inputs.scoring import extract_answer, score

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "data" / "items.jsonl"

# Independent re-derivation of each template's answer from the question text,
# so a bug in the generator's bookkeeping cannot hide behind itself.
_SOLVERS = [
    (r"has (\d+) boxes with (\d+) pencils in each box\. It sells (\d+) pencils", lambda a, b, c: a * b - c),
    (r"has (\d+) apples\. \w+ buys (\d+) bags with (\d+) apples", lambda a, b, c: a + b * c),
    (
        r"carries (\d+) passengers\. At the first stop (\d+) people get off and (\d+) people get on",
        lambda a, b, c: a - b + c,
    ),
    (r"^(\d+) students are split equally into (\d+) groups\. Then (\d+) more", lambda a, b, c: a // b + c),
    (
        r"makes (\d+) cookies each hour for (\d+) hours\. The baker gives (\d+) cookies to each of (\d+)",
        lambda a, b, c, d: a * b - c * d,
    ),
]


def _solve(question: str) -> int:
    for pattern, fn in _SOLVERS:
        m = re.search(pattern, question)
        if m:
            return fn(*map(int, m.groups()))
    raise AssertionError(f"no solver matches question: {question}")


# ---------------------------------------------------------------- default items


def test_default_items_deterministic():
    assert make_default_items(200, 0) == make_default_items(200, 0)
    assert make_default_items(50, 1) != make_default_items(50, 0)
    # A prefix of a longer run is the shorter run: generation does not look ahead.
    assert make_default_items(20, 0) == make_default_items(200, 0)[:20]


def test_default_items_deterministic_across_processes():
    code = "from stagereplay.inputs.default_items import make_default_items as m; print(repr(m(30, 7)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(make_default_items(30, 7))


def correct_choice(item: Item) -> str:
    """The text of the choice the answer letter names."""
    return item.choices[LETTERS.index(item.answer)]


def test_default_items_values_are_sensible():
    items = make_default_items(200, 0)
    assert [it.item_id for it in items] == [f"arith-{i:03d}" for i in range(200)]
    for it in items:
        assert len(set(it.choices)) == 4, it
        assert all(c.isdigit() and int(c) > 0 for c in it.choices), it
        assert it.answer in LETTERS
        assert int(correct_choice(it)) == _solve(it.question), it
        assert int(correct_choice(it)) < 200
        assert it.source == "builtin:arith-v1"


def test_default_items_answer_letters_balanced():
    counts = Counter(it.answer for it in make_default_items(200, 0))
    assert set(counts) == set(LETTERS)
    assert all(30 <= c <= 70 for c in counts.values()), counts


def test_shipped_items_equal_regeneration(tmp_path):
    fresh = tmp_path / "items.jsonl"
    write_items_jsonl(make_default_items(200, 0), fresh)
    assert SHIPPED.read_bytes() == fresh.read_bytes(), "data/items.jsonl was edited by hand; regenerate it"


# ---------------------------------------------------------------- jsonl


def test_jsonl_round_trip(tmp_path):
    items = make_default_items(25, 3)
    path = tmp_path / "sub" / "items.jsonl"
    write_items_jsonl(items, path)
    assert load_items(path) == items
    assert [p.name for p in path.parent.iterdir()] == ["items.jsonl"]  # no temp file left behind


def test_jsonl_defaults_and_numeric_answer(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"id": "q1", "question": "2+2?", "choices": ["3", "4", "5", "6"], "answer": 1},
        {"id": "q2", "question": "1+1?", "choices": ["2", "3", "4", "5"], "answer": "A", "source": "x"},
    ]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    items = load_items(path)
    assert items[0] == Item("q1", "2+2?", ("3", "4", "5", "6"), "B", "mine.jsonl")
    assert items[1].source == "x"
    assert load_items(path, limit=1) == items[:1]


GOOD = {"id": "ok", "question": "q?", "choices": ["a", "b", "c", "d"], "answer": "A"}


@pytest.mark.parametrize(
    "bad_line,needle",
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "question"} | {"id": "x"}), "'question'"),
        (json.dumps(GOOD | {"id": "x", "choices": ["a", "b", "c"]}), "'choices' must be a list of 4 strings"),
        (json.dumps(GOOD | {"id": "x", "choices": ["a", "b", "c", 4]}), "'choices'"),
        (json.dumps(GOOD | {"id": "x", "choices": ["a", "b", "c", " "]}), "'choices'"),
        (json.dumps(GOOD | {"id": "x", "answer": "E"}), "'answer'"),
        (json.dumps(GOOD | {"id": "x", "answer": 4}), "'answer'"),
        (json.dumps(GOOD | {"id": "x", "answer": True}), "'answer'"),
        (json.dumps(GOOD | {"id": 7}), "'id'"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad_line, needle):
    path = tmp_path / "broken.jsonl"
    # Blank line 2 must still count, so the bad line is physical line 3.
    path.write_text(json.dumps(GOOD) + "\n\n" + bad_line + "\n")
    with pytest.raises(ItemError) as exc:
        load_items(path)
    msg = str(exc.value)
    assert "broken.jsonl" in msg and "line 3" in msg and needle in msg, msg
    assert "\n" not in msg


def test_duplicate_ids_name_both_lines(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text("\n".join(json.dumps(GOOD | {"id": i}) for i in ["a", "b", "a"]) + "\n")
    with pytest.raises(ItemError, match=r"dup\.jsonl line 3: duplicate id 'a' \(first on line 1\)"):
        load_items(path)


@pytest.mark.parametrize("bad_id", ["../x", "a/b", ".hidden", "-x", "a b", "x" * 129])
def test_unsafe_ids_rejected(tmp_path, bad_id):
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD | {"id": bad_id}) + "\n")
    with pytest.raises(ItemError) as exc:
        load_items(path)
    assert "ids.jsonl line 2" in str(exc.value) and repr(bad_id) in str(exc.value)


def test_safe_ids_accepted(tmp_path):
    path = tmp_path / "ids.jsonl"
    ids = ["recABC123", "a.b_c-d", "0", "x" * 128]
    path.write_text("".join(json.dumps(GOOD | {"id": i}) + "\n" for i in ids))
    assert [it.item_id for it in load_items(path)] == ids


def test_empty_missing_unknown_and_bad_limit(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ItemError, match="empty.jsonl contains no items"):
        load_items(empty)
    with pytest.raises(ItemError, match="nope.jsonl not found"):
        load_items(tmp_path / "nope.jsonl")
    odd = tmp_path / "items.txt"
    odd.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(ItemError, match=r"items\.txt.*jsonl.*gpqa_csv"):
        load_items(odd)
    assert len(load_items(odd, fmt="jsonl")) == 1
    with pytest.raises(ItemError, match="limit"):
        load_items(odd, fmt="jsonl", limit=0)
    with pytest.raises(ItemError, match="format"):
        load_items(odd, fmt="yaml")


def test_jsonl_not_utf8_names_file_line_and_fix(tmp_path):
    path = tmp_path / "latin1.jsonl"
    # Windows line endings count as one line each; the bad byte is on physical line 3.
    lines = [
        json.dumps(GOOD),
        json.dumps(GOOD | {"id": "b"}),
        json.dumps(GOOD | {"id": "c", "question": "café?"}, ensure_ascii=False),
    ]
    path.write_bytes("\r\n".join(lines).encode("latin-1") + b"\r\n")
    with pytest.raises(ItemError) as exc:
        load_items(path)
    assert str(exc.value) == f"items file {path} line 3: not UTF-8 text (byte 0xe9) — save the file as UTF-8"
    # The same items saved as UTF-8 load.
    path.write_bytes("\r\n".join(lines).encode("utf-8") + b"\r\n")
    assert [item.question for item in load_items(path)][-1] == "café?"


# ---------------------------------------------------------------- GPQA CSV

GPQA_HEADER = [
    "Pre-Revision Question",
    "Question",
    "Correct Answer",
    "Incorrect Answer 1",
    "Incorrect Answer 2",
    "Incorrect Answer 3",
    "Record ID",
    "Subdomain",
]


def _gpqa_rows(n: int) -> list[list[str]]:
    return [
        [
            "old",
            f"Question {i}?\nSecond line.",
            f" right{i} ",
            f"wrong{i}a",
            f"wrong{i}b",
            f"wrong{i}c",
            f"rec{i:04d}",
            "Physics",
        ]
        for i in range(n)
    ]


def _write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_gpqa_csv_loads_and_records_correct_letter(tmp_path):
    path = _write_csv(tmp_path / "gpqa.csv", GPQA_HEADER, _gpqa_rows(12))
    items = load_items(path)
    assert len(items) == 12
    for i, it in enumerate(items):
        assert it.item_id == f"rec{i:04d}"
        assert it.question == f"Question {i}?\nSecond line."
        assert correct_choice(it) == f"right{i}"  # whitespace stripped
        assert sorted(it.choices) == sorted([f"right{i}", f"wrong{i}a", f"wrong{i}b", f"wrong{i}c"])
        assert it.source == "gpqa.csv"
    # With 12 items, a shuffle that never moves the correct answer off "A" would be a bug.
    assert len({it.answer for it in items}) > 1


def test_gpqa_shuffle_stable_and_row_order_independent(tmp_path):
    rows = _gpqa_rows(12)
    a = load_items(_write_csv(tmp_path / "a.csv", GPQA_HEADER, rows), shuffle_seed=5)
    b = load_items(_write_csv(tmp_path / "b.csv", GPQA_HEADER, rows[::-1][:7]), shuffle_seed=5)
    assert a == load_items(tmp_path / "a.csv", shuffle_seed=5)
    by_id = {it.item_id: it for it in a}
    for it in b:
        assert it.choices == by_id[it.item_id].choices
        assert it.answer == by_id[it.item_id].answer


def test_gpqa_seed_changes_shuffle(tmp_path):
    path = _write_csv(tmp_path / "g.csv", GPQA_HEADER, _gpqa_rows(12))
    seed0 = [it.choices for it in load_items(path, shuffle_seed=0)]
    seed1 = [it.choices for it in load_items(path, shuffle_seed=1)]
    assert seed0 != seed1


def test_gpqa_missing_column(tmp_path):
    header = [h for h in GPQA_HEADER if h != "Incorrect Answer 2"]
    rows = [r[:4] + r[5:] for r in _gpqa_rows(2)]
    path = _write_csv(tmp_path / "g.csv", header, rows)
    with pytest.raises(ItemError, match=r"g\.csv: missing column 'Incorrect Answer 2'"):
        load_items(path)


def test_gpqa_empty_cell_reports_starting_line(tmp_path):
    rows = _gpqa_rows(3)
    rows[2][3] = "  "
    path = _write_csv(tmp_path / "g.csv", GPQA_HEADER, rows)
    # Header is line 1; each record spans two lines because of the embedded newline.
    with pytest.raises(ItemError, match=r"g\.csv line 6: empty 'Incorrect Answer 1' cell"):
        load_items(path)


def test_gpqa_unsafe_record_id(tmp_path):
    rows = _gpqa_rows(2)
    rows[1][6] = "../etc"
    path = _write_csv(tmp_path / "g.csv", GPQA_HEADER, rows)
    with pytest.raises(ItemError, match=r"g\.csv line 4: id '\.\./etc'"):
        load_items(path)


# ---------------------------------------------------------------- prompts and scoring

ITEM = Item("t1", "What is 6 x 7?", ("41", "42", "43", "44"), "B", "test")


def test_prompt_and_messages():
    text = prompt_text(ITEM)
    assert "step by step" in text and "Answer: X" in text
    assert "What is 6 x 7?" in text
    assert "A) 41\nB) 42\nC) 43\nD) 44" in text
    assert text.index("step by step") < text.index("What is 6 x 7?") < text.index("A) 41")
    assert build_messages(ITEM) == [{"role": "user", "content": text}]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("6 x 7 = 42.\nAnswer: B", "B"),
        ("Answer: A\nWait, recheck.\nAnswer: C", "C"),
        ("so the Answer: (B)", "B"),
        ("answer:D", "D"),
        ("**Answer:** C", "C"),
        ("**Answer**: A", "A"),
        ("Final answer: [D].", "D"),
        ("The answer is 42.", None),
        ("The answer is D) 35.", "D"),
        ("Answer: A. Hmm, no: the answer is (C)", "C"),
        ("Answer: E", None),
        ("Answer: Because 42 is right", None),
        ("answer: b", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_score():
    assert score(ITEM, "42\nAnswer: B") == ("B", True)
    assert score(ITEM, "Answer: A") == ("A", False)
    assert score(ITEM, "I think it's 42") == (None, False)


def test_gpqa_not_utf8_names_file_line_and_fix(tmp_path):
    rows = _gpqa_rows(3)  # each question spans two physical lines
    rows[2][2] = "naïve"
    path = _write_csv(tmp_path / "g.csv", GPQA_HEADER, rows)
    path.write_bytes(path.read_bytes().decode("utf-8").encode("latin-1"))
    with pytest.raises(ItemError) as exc:
        load_items(path)
    assert str(exc.value) == f"items file {path} line 7: not UTF-8 text (byte 0xef) — save the file as UTF-8"
