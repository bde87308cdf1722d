"""Do the key-tile and split rules predict where an item's cells change the cache it writes? Per E6 placement
level of a llama.cpp ledger (binding or server), item by item, from the ledger's tables alone (summary.json's
``E6.placement_rule``, drawn on the card and checked by ``stagereplay verify`` as every other figure).

The key-tile rule (docs/engines.md, "Where the item's cells lie"): with flash attention over an fp16 or fp32
cache, a call of at least ``FLASH_ATTENTION_TILE`` queries runs the tiled kernel, whose key tiles of as many cells
are counted from cell 0 of the cache; an item whose cells start at cell C is summed in the same pieces as alone
exactly when C is a multiple of the tile. So for ``kv_offset`` C the built cache (``test-ref``) differs from the
reference exactly on the items whose one-call prefill has at least a tile of queries, when C is not a multiple of
the tile; the control writes the reference's.

The split rule, for ``kv_unified`` (one KV stream per sequence): llama.cpp then cuts a decode call into
micro-batches by ``split_equal`` (``llama-batch.cpp``), which takes consecutive sequence ids in batch order and the
same number of tokens from each. In the binding's batch the item is sequence 0 beside its companions' prompts, so
an item longer than its shortest companion is prefilled in two calls (that length, then the rest): other bytes.

Where the server recorded how it cut the item's prompt (its batch log, for ``kv_unified`` and ``batch`` under load),
the record decides, item by item and run by run, with no rule fitted to the items scored: a prompt not prefilled
alone in one call as the reference's is predicted to write other bytes; one prefilled so is predicted to write the
reference's bytes exactly when its first cell (the server's KV log) is a multiple of the tile, or the prompt is
shorter than a tile. A ``batch`` row without that record is not predicted (counted apart). No read-side cell
(``ref-test``) of these levels is predicted to differ (a decode step is one query). It predicts bytes, not answers.
"""

from __future__ import annotations

import re
from collections import defaultdict

from stagereplay.design.factors import factor_named
from stagereplay.engines.registry import SPECS

# GGML_FA_TILE_Q and GGML_FA_TILE_KV of the vendored ggml-cpu (llama-cpp-python 0.3.36): the query count from which
# CPU flash attention takes its tiled kernel, and its key tiles' cells. A property of the pinned source, not of the
# CPU (tests/test_llamacpp_tile.py checks the rule on the embedded GGUF at this build).
FLASH_ATTENTION_TILE = 64
PLACEMENT_FACTORS = ("kv_offset", "kv_unified", "batch")

# How a server under load recorded the item's prompt split and, where its KV log says, its first cell
# (engines/llamaserver/batches.py), at a row's end.
RECORDED_SPLIT = re.compile(r"(the prompt in \d+ decode calls?: .*?)(?:, from cell (\d+))?$")


def predicted_differs(row: dict, contexts: dict[str, int], tile: int = FLASH_ATTENTION_TILE) -> bool | None:
    """Whether the rules predict other built bytes for the item of a ``test-ref`` row at its level (None: not
    predicted)."""
    factor, level, context = row["factor"], row["level"], contexts[row["item_id"]]
    split = RECORDED_SPLIT.search(row["setting"] or "")
    if split and factor in ("kv_unified", "batch"):
        # The server recorded how it cut the prompt (its batch log): the reference's one call, alone, or not; then
        # where the prompt's cells began (its KV log), against the tile.
        if split.group(1) != f"the prompt in 1 decode call: {context} positions of slot 0 alone":
            return True
        cell = split.group(2)
        if cell is None and factor == "kv_unified":
            cell = 0  # an erased slot's own stream, from cell 0 (a log without the KV lines)
        if cell is None:
            return None if context >= tile else False
        return context >= tile and int(cell) % tile != 0
    if factor == "batch":
        return None  # the item's cells under load are not recorded
    if factor_named(factor).splits_by_sequence:
        # split_equal, as the binding's batch meets it: the item beside its companions' prompts, so an item
        # longer than its shortest companion is prefilled in two calls.
        shortest = min((contexts[name] for name in row["companions"]), default=context)
        return context > shortest
    if factor_named(factor).removes_filler(level):
        return False  # the item's cells from cell 0 after the filler left
    return context >= tile and factor_named(factor).value(level) % tile != 0


def placement_rule(factor_rows: list[dict], trajectory_rows: list[dict]) -> dict | None:
    """Per placement level (and per run under load) of a llama.cpp engine: the items whose built cache the rules
    predict to differ, those observed to, the read side's, those not predicted, and each item the rules missed.
    None where the ledger has no such level."""
    rows = [
        row
        for row in factor_rows
        if row["factor"] in PLACEMENT_FACTORS and row["applicable"] and _runs_ggml(row["engine"])
    ]
    if not rows:
        return None
    precision = rows[0]["precision"]
    # The item's one-call prefill: its context before the boundary token, as the reference prefills it.
    contexts = {
        row["item_id"]: row["prefix_length"] - 1
        for row in trajectory_rows
        if (row["construction"], row["replica"], row["precision"]) == ("prefill", 0, precision)
    }
    levels: dict[tuple[str, str, int], dict[str, dict]] = defaultdict(dict)
    for row in rows:
        run = -1 if row.get("run") is None else row["run"]
        levels[(row["factor"], row["level"], run)].setdefault(row["item_id"], {})[row["cell"]] = row
    figures = []
    for (factor, level, run), items in sorted(
        levels.items(), key=lambda pair: (pair[0][0], _order(pair[0][1]), pair[0][2])
    ):
        predicted = observed = read = 0
        unpredicted, missed = [], []
        for item_id, cells in sorted(items.items()):
            expect = predicted_differs(cells["test-ref"], contexts)
            if expect is None:
                unpredicted.append(item_id)
                continue
            built = cells["test-ref"]["cache_differs"]
            read_differs = "ref-test" in cells and cells["ref-test"]["first_divergence"] is not None
            predicted, observed, read = predicted + expect, observed + built, read + read_differs
            if built != expect or read_differs:
                missed.append(
                    f"{item_id} ({contexts[item_id]} positions: {'differs' if built else 'same'}"
                    f"{', read side differs' if read_differs else ''})"
                )
        figures.append(
            {
                "factor": factor,
                "level": level,
                "run": None if run < 0 else run + 1,
                "n": len(items) - len(unpredicted),
                "predicted_differ": predicted,
                "observed_differ": observed,
                "read_side_differs": read,
                "not_predicted": len(unpredicted),
                "missed": missed,
            }
        )
    return {
        "tile": FLASH_ATTENTION_TILE,
        "levels": figures,
        "missed": sum(len(level["missed"]) for level in figures),
        "predicted": sum(level["n"] for level in figures),
    }


def _runs_ggml(engine: str) -> bool:
    """Whether the engine runs a GGUF on ggml's kernels, whose tiles and splits the rules describe."""
    return engine in SPECS and SPECS[engine].record_kind == "gguf"


def _order(level: str) -> tuple:
    digits = "".join(ch for ch in level if ch.isdigit())
    return (not level[0].isdigit(), int(digits or 0), level)


def placement_blocks(e6: dict) -> list[tuple]:
    """The card's section: per level, predicted and observed built caches that differ, and where the rule missed."""
    rule = e6.get("placement_rule")
    if not rule:
        return []
    rows = [
        [
            level["factor"],
            level["level"] if level["run"] is None else f"{level['level']} run {level['run']}",
            f"{level['predicted_differ']}/{level['n']}",
            f"{level['observed_differ']}/{level['n']}",
            f"{level['read_side_differs']}/{level['n']}",
            str(level["not_predicted"]),
            "; ".join(level["missed"]) or "—",
        ]
        for level in rule["levels"]
    ]
    verdict = (
        f"The rules missed {rule['missed']} item-level(s) of {rule['predicted']} predicted."
        if rule["missed"]
        else f"The rules held on every one of {rule['predicted']} item-levels predicted."
    )
    return [
        ("heading", 3, "Where the item's cells lie: the placement rules, item by item"),
        (
            "paragraph",
            f"Per placement level, whether the item's built cache (test-ref) differs from the reference, as the"
            f" key-tile rule ({rule['tile']}-cell tiles from cell 0) and the split rule predict it, or, on a server"
            " under load, as its batch and KV logs record the prompt's split and first cell; no rule is fitted to"
            " the items scored. A row without that record is not predicted (counted apart). The rules predict"
            f" bytes, not answers. {verdict}",
        ),
        (
            "table",
            [
                "Factor",
                "Level",
                "Built cache differs: predicted",
                "observed",
                "Read side differs",
                "Not predicted",
                "Rules missed",
            ],
            rows,
        ),
    ]
