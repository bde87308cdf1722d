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
from stagereplay.report.figures import factor_blocks
from stagereplay.report.plots import VERDICT_COLOURS
from stagereplay.report.reading import e6_level_reading, e6_reading
from stagereplay.report.stats import share
from stagereplay.report.summary import e6_level

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
    assert "2 write, 1 read, 1 both (write only 2 against read only 1: exact McNemar p = 1)" in plain_text
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
        "of the items whose served suffix changes: 1 write, 1 read, 1 both, 1 interaction (write only 1 against"
        in attention
    )
    assert "read only 1: exact McNemar p = 1)" in attention
    assert "on 4/11 items a one-sided cell differs but the served suffix does not (latent," in attention
    assert "none 3/11 (Wilson 95% [" in patterns and "test-ref+ref-test 1/11 (" in patterns
    assert "0/" not in patterns  # every pattern was seen once at least
    assert "every item whose served suffix changes (1/2) follows the written cache (write side)" in chunk


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
