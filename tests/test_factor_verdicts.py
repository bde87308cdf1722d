"""E6's verdicts served first, and the patterns of differing cells, on known answers (no model, no workflow).

Each item's cells are given as which of them continue differently from the reference: test-ref (the cache
built under the level, read as the reference reads), ref-test (the reference cache read under the level),
test-test (the level as a server runs it). Only an item whose served suffix differs gets a side
(write, read, both, interaction; served for a server-only factor); a one-sided cell alone is latent.
"""

from __future__ import annotations

import pytest

from stagereplay.audit.verify_documents import counts_e6_one_sided
from stagereplay.design.cells import (
    CELL_LABELS,
    FULL,
    READ,
    SERVED_VERDICTS,
    SERVER,
    VERDICTS,
    WRITE,
    cell_patterns,
    differing_cells,
    item_verdict,
    pattern_name,
)
from stagereplay.ledger.tables import FACTOR_LOGIT_COLUMNS
from stagereplay.report.factor_reading import e6_level_reading, e6_reading
from stagereplay.report.factor_summary import e6_level
from stagereplay.report.figures import factor_blocks
from stagereplay.report.plots import VERDICT_COLOURS
from stagereplay.report.stats import share

REFERENCE = [7, 8, 9]
NOT_THERE = None  # a cell the factor does not have (build-only: ref-test, test-test; server-only: both one-sided)


def suffix(differs: bool | None, token: int) -> list[int] | None:
    """A cell's suffix: the reference's, or one that parts from it at step 1 (each cell its own token)."""
    if differs is None:
        return NOT_THERE
    return [7, token, 9] if differs else list(REFERENCE)


# (test-ref differs, ref-test differs, test-test differs) -> (verdict, pattern); None: the factor lacks the cell.
# The three latent rows of the full 2x2 are the ones the verdicts before served-first got wrong: they called
# them write, read and both, although the served suffix is the reference's.
KNOWN = [
    # the full 2x2: the served suffix is the reference's
    ((False, False, False), "none", "none"),
    ((True, False, False), "latent", "test-ref"),
    ((False, True, False), "latent", "ref-test"),
    ((True, True, False), "latent", "test-ref+ref-test"),
    # the full 2x2: the served suffix differs, and where it enters
    ((False, False, True), "interaction", "test-test"),
    ((True, False, True), "write", "test-ref+test-test"),
    ((False, True, True), "read", "ref-test+test-test"),
    ((True, True, True), "both", "test-ref+ref-test+test-test"),
    # build-only: test-ref alone, the served cell
    ((True, None, None), "write", "test-ref"),
    ((False, None, None), "none", "none"),
    # server-only: test-test alone
    ((None, None, True), "served", "test-test"),
    ((None, None, False), "none", "none"),
]


@pytest.mark.parametrize(("differs", "verdict", "pattern"), KNOWN, ids=[f"{p}->{v}" for _, v, p in KNOWN])
def test_known_verdicts_and_patterns(differs, verdict, pattern):
    write, read, server = (suffix(d, token) for d, token in zip(differs, (1, 2, 3)))
    assert item_verdict(REFERENCE, write, read, server) == verdict
    assert pattern_name(differing_cells(REFERENCE, write, read, server)) == pattern


def test_equal_differing_suffixes_are_still_different_from_the_reference():
    # Two cells that part from the reference the same way each differ from it.
    other = [7, 1, 9]
    assert item_verdict(REFERENCE, other, list(REFERENCE), other) == "write"
    assert item_verdict(REFERENCE, other, other, list(REFERENCE)) == "latent"


@pytest.mark.parametrize(
    ("write", "read", "server"),
    [(REFERENCE, REFERENCE, None), (None, REFERENCE, REFERENCE), (REFERENCE, None, REFERENCE), (None, None, None)],
)
def test_a_shape_no_factor_has_is_refused(write, read, server):
    with pytest.raises(ValueError, match="test-ref alone \\(build-only\\), test-test alone \\(server-only\\)"):
        item_verdict(REFERENCE, write, read, server)


def test_patterns_of_each_factor_shape():
    assert cell_patterns(FULL) == (
        "none",
        "test-ref",
        "ref-test",
        "test-ref+ref-test",
        "test-test",
        "test-ref+test-test",
        "ref-test+test-test",
        "test-ref+ref-test+test-test",
    )
    assert cell_patterns((WRITE,)) == ("none", "test-ref")
    assert cell_patterns((SERVER,)) == ("none", "test-test")
    assert CELL_LABELS == ("test-ref", "ref-test", "test-test") and (WRITE, READ, SERVER) == FULL


def test_the_plot_stacks_every_verdict_in_order():
    assert tuple(VERDICT_COLOURS) == VERDICTS
    assert set(VERDICTS) - set(SERVED_VERDICTS) == {"none", "latent"}


def rows_of(
    factor: str, level: str, items: dict[str, tuple], unbuilt: tuple[str, ...] = (), converted: bool = False
) -> list[dict]:
    """A factor table's rows for one level, by hand: per item, which cells differ (None: the factor lacks it);
    ``converted``: the one-sided cells read a cache converted to the other type (as cache_type's do)."""
    rows = []
    for item_id, differs in items.items():
        for label, cell_differs in zip(CELL_LABELS, differs):
            if cell_differs is None and label not in unbuilt:
                continue
            built = label.startswith("test")
            rows.append(
                {
                    "factor": factor,
                    "level": level,
                    "reference_level": "ref",
                    "engine": "transformers",
                    "precision": "bf16",
                    "item_id": item_id,
                    "cell": label,
                    "applicable": label not in unbuilt,
                    "reason": "cannot be built" if label in unbuilt else None,
                    "reference_suffix": "S-reference",
                    "suffix_object": f"S-{label}-{item_id}" if cell_differs else "S-reference",
                    "cache_differs": built and bool(cell_differs),
                    "first_differing_layer": 1 if built and cell_differs else None,
                    "layer_max_abs": [0.5, 0.25] if built else [],
                    "reused_tokens": None,
                    "converted_digest": f"C-{label}-{item_id}" if converted and label != "test-test" else None,
                    "first_divergence": 0 if cell_differs else None,
                    **dict.fromkeys(FACTOR_LOGIT_COLUMNS),  # no logits recorded: their figures count nothing
                }
            )
    return rows


# A hand-built level of the full 2x2 with a known count of each pattern (11 items).
PATTERN_COUNTS = {
    (False, False, False): 3,
    (True, False, False): 2,
    (False, True, False): 1,
    (True, True, False): 1,
    (False, False, True): 1,
    (True, False, True): 1,
    (False, True, True): 1,
    (True, True, True): 1,
}


def full_level_rows() -> list[dict]:
    items, index = {}, 0
    for differs, count in PATTERN_COUNTS.items():
        for _ in range(count):
            items[f"item-{index:02d}"] = differs
            index += 1
    return rows_of("attention", "eager", items)


def test_eight_pattern_counts_of_a_hand_built_level():
    figures = e6_level(full_level_rows())
    n = sum(PATTERN_COUNTS.values())
    assert figures["items"] == n and figures["served_cell"] == "test-test"
    expected = {
        pattern_name([label for label, d in zip(CELL_LABELS, differs) if d]): share(count, n)
        for differs, count in PATTERN_COUNTS.items()
    }
    assert figures["differing_cells"] == expected
    assert list(figures["differing_cells"]) == list(cell_patterns(FULL))
    verdicts = {name: counted["count"] for name, counted in figures["verdicts"].items()}
    assert verdicts == {"none": 3, "latent": 4, "write": 1, "read": 1, "both": 1, "interaction": 1, "served": 0}
    assert figures["verdicts"]["latent"] == share(4, n)
    # The served suffix differs on exactly the items the sides classify.
    assert figures["suffixes_differ"] == share(4, n)
    assert sum(verdicts[name] for name in SERVED_VERDICTS) == figures["suffixes_differ"]["count"]


def test_write_against_read_is_an_exact_test_over_served_divergences():
    # 6 write, 1 read, 2 both, 1 interaction and 3 latent items: only the 10 served divergences count, and
    # of those only the 7 where exactly one side differs; two-sided binomial of 6 of 7 at 1/2: 16/128.
    counts = {(True, False, True): 6, (False, True, True): 1, (True, True, True): 2, (False, False, True): 1}
    items = {f"item-{i:02d}": differs for i, differs in enumerate(d for d, n in counts.items() for _ in range(n))}
    items |= {f"latent-{i}": (True, True, False) for i in range(3)}
    figures = e6_level(rows_of("batch", "4", items))
    assert figures["write_vs_read"] == {
        "items": 10,
        "write_only": 6,
        "read_only": 1,
        "p_value": pytest.approx(16 / 128),
        "test": "exact McNemar (two-sided binomial test on the discordant pairs)",
    }
    nothing = e6_level(rows_of("batch", "4", {"a": (True, True, False)}))["write_vs_read"]
    assert nothing["items"] == 0 and nothing["p_value"] is None  # no p-value from no served divergence
    assert e6_level(rows_of("chunk", "5", {"a": (True, None, None)}))["write_vs_read"] is None  # one side only


def test_cells_that_read_converted_caches_name_cells_not_sides():
    # The same outcomes read as sides on a level whose cells read the caches as built, as cells on one whose
    # one-sided cells read converted caches (cache_type), where no comparison of the sides is stated.
    items = {"a": (True, False, True), "b": (True, False, True), "c": (True, True, True), "d": (False, True, True)}
    plain = e6_level(rows_of("batch", "2", items))
    converted = e6_level(rows_of("cache_type", "q8_0", items, converted=True))
    assert (plain["converted_cells"], converted["converted_cells"]) == (False, True)
    plain_text = e6_level_reading(plain)
    converted_text = e6_level_reading(converted)
    assert "2 write, 1 read, 1 both; write only 2 against read only 1: exact McNemar p = 1, uncorrected" in plain_text
    assert (
        "2 write, 1 read, 1 both (by the cells that differ: each one-sided cell reads a converted cache"
        in converted_text
    )
    assert "McNemar" not in converted_text
    assert "its caches are another type" in converted_text
    # The control (the run's own type through the conversion path) has the reference's bytes, not another type.
    control = e6_level_reading(e6_level(rows_of("cache_type", "ref", {"a": (False, False, False)}, converted=True)))
    assert "bit-identical to the reference on all 1 items" in control and "another type" not in control


def test_build_only_and_server_only_levels_have_two_patterns():
    chunk = e6_level(
        rows_of("chunk", "5", {"a": (True, None, None), "b": (False, None, None), "c": (True, None, None)})
    )
    assert chunk["served_cell"] == "test-ref" and chunk["cells"] == ["test-ref"]
    assert chunk["differing_cells"] == {"none": share(1, 3), "test-ref": share(2, 3)}
    assert chunk["suffixes_differ"] == share(2, 3) and chunk["verdicts"]["write"] == share(2, 3)
    assert chunk["verdicts"]["latent"] == share(0, 3)
    unbuilt = ("test-ref", "ref-test")
    rotation = e6_level(rows_of("rotation", "off", {"a": (None, None, True), "b": (None, None, False)}, unbuilt))
    assert rotation["served_cell"] == "test-test" and rotation["cells"] == ["test-test"]
    assert rotation["differing_cells"] == {"none": share(1, 2), "test-test": share(1, 2)}
    assert rotation["verdicts"]["served"] == share(1, 2) and rotation["verdicts"]["latent"] == share(0, 2)


def hand_built_e6() -> dict:
    chunk = rows_of("chunk", "5", {"a": (True, None, None), "b": (False, None, None)})
    return {
        "checkpoint": "tiny",
        "precision": "bf16",
        "reference": "E2's prefill row",
        "levels": [e6_level(full_level_rows()), e6_level(chunk)],
    }


def test_card_and_reading_give_the_patterns_and_latent():
    e6 = hand_built_e6()
    blocks = factor_blocks({"E6": e6})
    tables = [block for block in blocks if block[0] == "table"]
    verdict_header, verdict_rows = tables[0][1], tables[0][2]
    assert verdict_header[-len(VERDICTS) :] == list(VERDICTS)
    assert verdict_rows[0][verdict_header.index("latent")] == "4/11 [15.2%, 64.6%]"
    pattern_header, pattern_rows = tables[1][1], tables[1][2]
    assert pattern_header == ["Factor", "Level", *cell_patterns(FULL)]
    assert [row[:2] for row in pattern_rows] == [["attention", "eager"]]  # the build-only level is in a sentence
    assert pattern_rows[0][pattern_header.index("none")].startswith("3/11 [")
    sentences = [block[1] for block in blocks if block[0] == "paragraph"]
    assert any("chunk 5 (test-ref alone): none 1/2 [" in text for text in sentences)
    attention, patterns, chunk = e6_reading(e6)
    assert "suffixes differ on 4/11 as a server runs it" in attention
    assert (
        "of the items whose served suffix changes: 1 write, 1 read, 1 both, 1 interaction; write only 1 against"
        in attention
    )
    assert "read only 1: exact McNemar p = 1, uncorrected;" in attention
    assert "on 4/11 items a one-sided cell differs but the served suffix does not (latent," in attention
    assert "none 3/11 (Wilson 95% [" in patterns and "test-ref+ref-test 1/11 (" in patterns
    assert "0/" not in patterns  # every pattern was seen once at least
    assert (
        "every item whose served suffix changes (1/2) is changed by the cache the level writes (build-only: its"
        " served cell is the write cell)" in chunk
    )


def test_a_summary_of_the_old_shape_is_recognised():
    e6 = hand_built_e6()
    assert not counts_e6_one_sided({"E6": e6})
    for key in ("served_cell", "differing_cells"):
        old = hand_built_e6()
        del old["levels"][1][key]
        assert counts_e6_one_sided({"E6": old})
    old = hand_built_e6()
    del old["levels"][0]["verdicts"]["latent"]
    assert counts_e6_one_sided({"E6": old})
    assert not counts_e6_one_sided({"E1": {}})  # no E6: nothing of its shape to check


def served_as(rows: list[dict], cell: str, items: set[str]) -> list[dict]:
    """The rows with the served cell (test-test) of ``items`` continuing exactly as their ``cell`` does."""
    suffixes = {row["item_id"]: row["suffix_object"] for row in rows if row["cell"] == cell}
    return [
        {**row, "suffix_object": suffixes[row["item_id"]]}
        if row["cell"] == "test-test" and row["item_id"] in items
        else row
        for row in rows
    ]


def test_a_write_verdict_is_counted_apart_from_the_served_continuation_being_the_write_cells():
    # 4 write items, 2 of them serving the write cell's very suffix; 3 read items, 1 serving the read cell's.
    items = {f"w{i}": (True, False, True) for i in range(4)} | {f"r{i}": (False, True, True) for i in range(3)}
    rows = served_as(served_as(rows_of("attention", "eager", items), "test-ref", {"w0", "w2"}), "ref-test", {"r1"})
    figures = e6_level(rows)
    assert figures["verdicts"]["write"] == share(4, 7) and figures["verdicts"]["read"] == share(3, 7)
    assert figures["served_equals_side"] == {"write": share(2, 4), "read": share(1, 3)}
    text = e6_level_reading(figures)
    assert "; the served continuation is the write cell's on 2/4 write items and the read cell's on 1/3 read" in text
    assert "follows the written cache" not in text
    # One verdict only: the sentence says which cells differ, then whether the served continuation is the cell's.
    alone = e6_level(
        served_as(rows_of("batch", "2", {"a": (True, False, True), "b": (True, False, True)}), "test-ref", {"b"})
    )
    text = e6_level_reading(alone)
    assert (
        "every item whose served suffix changes (2/2) changes in the write cell (test-ref) and not in the read cell"
        " (write side)" in text
    )
    assert "the served continuation is the write cell's on 1/2 write items." in text
    # A build-only level's served cell is its write cell: nothing to count.
    assert e6_level(rows_of("chunk", "5", {"a": (True, None, None)}))["served_equals_side"] is None


def cache_differs(differs: bool) -> dict:
    """A built row's cache columns: its bytes differ from the reference's from layer 1, or they do not."""
    return {"cache_differs": differs, "first_differing_layer": 1 if differs else None}


def test_no_comparison_of_the_sides_where_one_side_is_empty_by_construction():
    # The item batched with itself: the caches have the reference's bytes, so no item can differ in the write cell.
    same = {f"i{i}": (False, True, True) for i in range(6)} | {"j": (False, False, False)}
    figures = e6_level(rows_of("batch", "same-2", same))
    assert figures["caches_differ"] == share(0, 7) and figures["write_vs_read"] is None
    text = e6_level_reading(figures)
    assert "no comparison of the sides: every cache it builds has the reference's bytes" in text
    assert "McNemar" not in text
    # The same outcomes with caches that differ are a test (and a p-value from 0 against 6).
    differ = rows_of("batch", "2", same)
    differ = [{**row, **cache_differs(row["cell"] == "test-ref")} for row in differ]
    assert e6_level(differ)["write_vs_read"]["p_value"] == pytest.approx(2 / 64)
    # Cells that read converted caches (cache_type): no test either.
    assert e6_level(rows_of("cache_type", "q8_0", {"a": (True, False, True)}, converted=True))["write_vs_read"] is None
    # Served divergences with neither a write-only nor a read-only item: nothing to compare, no p-value.
    both = e6_level(rows_of("batch", "4", {"a": (True, True, True), "b": (False, False, True)}))["write_vs_read"]
    assert both["items"] == 2 and both["p_value"] is None


def test_the_sides_are_corrected_over_the_levels_that_have_a_test():
    from stagereplay.report.factor_summary import sides_correction

    def level(name: str, write: int, read: int, caches_differ: bool = True) -> dict:
        items = {f"w{i}": (True, False, True) for i in range(write)} | {
            f"r{i}": (False, True, True) for i in range(read)
        }
        rows = rows_of("batch", name, items)
        return e6_level([{**row, **cache_differs(caches_differ and row["cell"] == "test-ref")} for row in rows])

    # 0 vs 12: p = 2/4096; 9 vs 1: p = 22/1024; 2 vs 3: p = 1; same-2 has no test; the control runs none.
    levels = [level("2", 0, 12), level("4", 9, 1), level("8", 2, 3), level("same-2", 0, 5, caches_differ=False)]
    levels.append(e6_level(rows_of("batch", "ref", {"a": (False, False, False)})))  # the control (level = reference)
    correction = sides_correction(levels)
    assert correction["tests"] == 3 and correction["levels"] == ["batch 2", "batch 4", "batch 8"]
    assert correction["threshold"] == pytest.approx(0.05 / 3)
    assert correction["survive"] == ["batch 2"]  # 0.021 is below 0.05 alone, not below 0.05/3
    e6 = {"levels": levels, "sides_compared": correction}
    lines = e6_reading(e6)
    four = next(line for line in lines if line.startswith("E6 batch 4 "))
    assert "exact McNemar p = 0.021, uncorrected, not below the Bonferroni threshold 0.05/3 = 0.017 over the 3" in four
    two = next(line for line in lines if line.startswith("E6 batch 2 "))
    assert "p = 0.00049, uncorrected, below the Bonferroni threshold 0.05/3 = 0.017" in two
    (family,) = [line for line in lines if line.startswith("E6 write side against read side")]
    assert "3 test level(s) have an exact McNemar test (batch 2, batch 4, batch 8)" in family
    assert "(p below 0.05/3 = 0.017), batch 2 survives it." in family
    # Without batch 2 in the family the threshold is 0.05/2, and batch 4's 0.021 is below it.
    assert sides_correction(levels[1:])["survive"] == ["batch 4"]
    none = sides_correction(levels[2:])
    assert none["tests"] == 1 and none["survive"] == []
    assert "none survives it" in e6_reading({"levels": levels[2:], "sides_compared": none})[-1]
