"""Every example sentence of docs/report.md is one the card's code writes: each is generated here from hand-built
figures by the functions the card calls, and docs/report.md must quote it verbatim, as a blockquote; and every
blockquote there must be one of them, so an example typed by hand, or left behind by a change of wording, fails.

The figures are hand-built (no model), computed by report.summary and audit.reproduction from rows shaped like the ledger's.
Where an example carries the counts of a findings run (docs/findings.md), the rows reproduce those counts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_card_wording import server_audit
from test_factor_controls import _rows, _same
from test_factor_verdicts import cache_differs, rows_of, served_as

from stagereplay.audit.reproduction import e4_summary
from stagereplay.report.card import e4_panel
from stagereplay.report.controls import controls_blocks, controls_card_row
from stagereplay.report.factor_reading import e6_level_reading, flip_margins_reading, sides_correction_reading
from stagereplay.report.factor_summary import e6_controls, e6_level, sides_correction
from stagereplay.report.reading import e2_reading, e4_reading
from stagereplay.report.render import to_markdown
from stagereplay.report.summary import e2_summary

DOC = Path(__file__).resolve().parents[1] / "docs" / "report.md"


def e2_zero_of_eight() -> str:
    """The FP32 arm of E2 with no decoded disagreement on 8 items: the zero-count sentence."""
    rows = [
        {
            "precision": "fp32",
            "a": "incremental/fp32/rep0",
            "b": "prefill/fp32/rep0",
            "suffix_differs": False,
            "label_differs": False,
            "cache_exact": True,
            "a_correct": True,
            "b_correct": True,
            "first_divergence": None,
        }
        for _ in range(8)
    ]
    summary = {"checkpoints": ["m"], "E2": {"checkpoints": {"m": e2_summary(rows)}}}
    (line,) = e2_reading(summary)
    return line


def level_of(factor: str, level: str, counts: dict[tuple, int], reference: str = "ref", **columns) -> list[dict]:
    """A level's rows with ``counts`` items of each pattern (test-ref, ref-test, test-test differ; None: no cell)."""
    items, index = {}, 0
    for differs, count in counts.items():
        for _ in range(count):
            items[f"item-{index:02d}"] = differs
            index += 1
    rows = rows_of(factor, level, items)
    return [{**row, "reference_level": reference, **columns} for row in rows]


def chunk_7() -> str:
    """The findings run's chunk 7: 48 items, every cache differs from layer 1, 19 served suffixes differ."""
    rows = level_of("chunk", "7", {(True, None, None): 19, (False, None, None): 29}, reference="whole")
    rows = [{**row, **cache_differs(True)} for row in rows]
    return e6_level_reading(e6_level(rows))


def write_level() -> str:
    """A level with the full 2x2 whose served changes are all write verdicts, on 3 of 5 of them the served suffix
    being the write cell's: the verdict and what the served continuation is, apart."""
    rows = level_of("batch", "4", {(True, False, True): 5, (False, False, False): 27}, reference="1")
    rows = served_as(rows, "test-ref", {"item-00", "item-02", "item-04"})
    return e6_level_reading(e6_level(rows), sides_correction([e6_level(rows)]))


def findings_family() -> tuple[list[dict], dict]:
    """The write-only and read-only counts of the findings run's six full-2x2 test levels that have a test, in
    the order of its card; both and interaction items leave the test unchanged, so they are left out."""
    sides = {
        ("attention", "eager"): (6, 3),
        ("batch", "2"): (2, 12),
        ("batch", "4"): (2, 7),
        ("batch", "8"): (2, 3),
        ("kernels", "avx2"): (4, 1),
        ("kernels", "default"): (9, 1),
    }
    levels = []
    for (factor, level), (write, read) in sides.items():
        rows = level_of(
            factor, level, {(True, False, True): write, (False, True, True): read, (False, False, False): 1}
        )
        levels.append(e6_level(rows))
    return levels, sides_correction(levels)


def family() -> str:
    (line,) = sides_correction_reading(findings_family()[1])
    return line


def margins() -> str:
    """A bf16 level and a float32 one (another engine's logits): one bf16 step against |top|/128, per level."""
    served = [
        {"first_divergence": 3, "reference_margin_at_divergence": 0.0, "reference_top_logit_at_divergence": 20.0},
        {"first_divergence": 0, "reference_margin_at_divergence": 0.125, "reference_top_logit_at_divergence": 20.0},
        {"first_divergence": 5, "reference_margin_at_divergence": 0.5, "reference_top_logit_at_divergence": 20.0},
    ]
    from stagereplay.report.margins import e6_flip_margins

    def level(factor: str, name: str, bf16: bool) -> dict:
        return {"factor": factor, "level": name, "applicable": True, "flip_margins": e6_flip_margins(served, bf16)}

    summary = {
        "checkpoints": ["m"],
        "E1": {"checkpoints": {}},
        "E6": {"levels": [level("attention", "eager", True), level("flash_attn", "off", False)]},
    }
    (line,) = flip_margins_reading(summary)
    return line


def e4_server() -> str:
    """The E4 answer of an audit whose trajectories all reproduce and 16 of 72 E6 caches do not."""
    return e4_panel(e4_summary(server_audit(caches_lost=16)))[2]


def e4_read() -> str:
    """The same audit's sentence in the reading."""
    (line,) = e4_reading(e4_summary(server_audit(caches_lost=16)))
    return line


def controls() -> str:
    return controls_card_row({"controls": {"paths": 6, "identical": 6, "without_control": []}})[2]


def server_batch_control() -> str:
    """The batch control's row of the card's table of controls, as its Markdown writes it, on llamaserver."""
    rows = [{**row, "engine": "llamaserver"} for row in _rows("1", "1", _same)]
    markdown = to_markdown(controls_blocks({"controls": e6_controls(rows)}))
    return next(line for line in markdown.splitlines() if line.startswith("| batch |"))


EXAMPLES = {
    "E2, a count of 0": e2_zero_of_eight,
    "E6, a build-only level": chunk_7,
    "E6, write verdicts and the served continuation": write_level,
    "E6, the family of write-against-read tests": family,
    "margins at the first divergent step": margins,
    "E4, the reading": e4_read,
    "E4, the answer panel": e4_server,
    "E6 controls, the answer panel": controls,
    "E6 controls, the server's batch control": server_batch_control,
}


def normalised(text: str) -> str:
    return " ".join(text.split())


def blockquotes(markdown: str) -> list[str]:
    """Each blockquote of a Markdown text (consecutive '> ' lines), joined into one line."""
    quotes, current = [], []
    for line in markdown.splitlines():
        if line.startswith(">"):
            current.append(line[1:].strip())
        elif current:
            quotes.append(normalised(" ".join(current)))
            current = []
    if current:
        quotes.append(normalised(" ".join(current)))
    return quotes


@pytest.mark.parametrize("name", EXAMPLES)
def test_docs_report_quotes_the_card_verbatim(name):
    sentence = normalised(EXAMPLES[name]())
    assert sentence in blockquotes(DOC.read_text()), f"docs/report.md does not quote the card's {name}:\n{sentence}"


def test_every_example_in_docs_report_is_one_the_card_writes():
    generated = {normalised(make()) for make in EXAMPLES.values()}
    quoted = blockquotes(DOC.read_text())
    assert quoted, "docs/report.md has no examples"
    assert [quote for quote in quoted if quote not in generated] == []
    # The old zero-count wording is gone from the page, quoted or not.
    assert "cannot rule out a rate below" not in DOC.read_text()
    assert not re.search(r"follows the written cache", DOC.read_text())
