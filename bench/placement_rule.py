"""Do the key-tile and split rules predict where an item's cells change the cache it writes? Per E6 placement
level of a llama.cpp ledger (binding or server), item by item.

The key-tile rule (docs/engines.md, "Where the item's cells lie"): with flash attention over an fp16 or fp32
cache, a call of at least ``--tile`` queries (64 in the pinned ggml-cpu, ``GGML_FA_TILE_Q``) runs the tiled
kernel, whose key tiles of ``--tile`` cells (``GGML_FA_TILE_KV``) are counted from cell 0 of the cache; an item
whose cells start at cell C is summed in the same pieces as alone exactly when C is a multiple of the tile. So
for ``kv_offset`` C the built cache (``test-ref``) differs from the reference exactly on the items whose one-call
prefill has at least a tile of queries, when C is not a multiple of the tile; the control writes the reference's.

The split rule, for ``kv_unified`` (one KV stream per sequence): llama.cpp then cuts a decode call into
micro-batches by ``split_equal`` (``llama-batch.cpp``), which takes consecutive sequence ids in batch order and the
same number of tokens from each. In the binding's batch the item is sequence 0 beside its companions' prompts, so
an item longer than its shortest companion is prefilled in two calls (that length, then the rest): other bytes.
On the server the companions' generated tokens come first in the call and the item (slot 0) after them, so it
gets a micro-batch of its own: the reference's bytes.

Where the server recorded how it cut the item's prompt (its batch log, for ``kv_unified`` and ``batch`` under load),
the record decides, item by item and run by run, with no rule fitted to the items scored: a prompt not prefilled
alone in one call as the reference's is predicted to write other bytes; one prefilled so is predicted to write the
reference's bytes exactly when its first cell (the server's KV log) is a multiple of the tile, or the prompt is
shorter than a tile. A ``batch`` row without that record is not predicted (counted apart). No read-side cell
(``ref-test``) of these levels is predicted to differ (a decode step is one query). It predicts bytes, not answers.
It prints each level's predicted and observed counts and every item where a prediction failed. Exit status 0 when
none did.

    python bench/placement_rule.py ledger/factors-llamaserver
    python bench/placement_rule.py ledger/placement-llamacpp
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.design.factors import factor_named

# How a server under load recorded the item's prompt split and, where its KV log says, its first cell
# (engines/llamaserver/batches.py), at a row's end.
RECORDED_SPLIT = re.compile(r"(the prompt in \d+ decode calls?: .*?)(?:, from cell (\d+))?$")


def predicted_differs(row: dict, contexts: dict[str, int], tile: int) -> bool | None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--tile", type=int, default=64, help="the key and query tile of the build's kernel")
    args = parser.parse_args(argv)
    tables = args.ledger / "tables"
    factors = [
        row
        for row in pq.read_table(tables / "factors.parquet").to_pylist()
        if row["factor"] in ("kv_offset", "kv_unified", "batch") and row["applicable"]
    ]
    if not factors:
        print(f"{args.ledger}: no kv_offset, kv_unified or batch rows — run a config with those factors")
        return 1
    prefill = {
        row["item_id"]: row["prefix_length"] - 1
        for row in pq.read_table(tables / "trajectories.parquet").to_pylist()
        if (row["construction"], row["replica"]) == ("prefill", 0) and row["precision"] == factors[0]["precision"]
    }
    # Each run of a level under load (the server's kv_unified) is checked on its own.
    levels: dict[tuple[str, str, int], dict[str, dict]] = defaultdict(dict)
    for row in factors:
        run = -1 if row.get("run") is None else row["run"]
        levels[(row["factor"], row["level"], run)].setdefault(row["item_id"], {})[row["cell"]] = row
    failed = []
    print(
        "| factor | level | built cache differs: predicted | observed | read side differs | not predicted"
        " | rule failed on |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for (factor, level, run), items in sorted(
        levels.items(), key=lambda pair: (pair[0][0], _order(pair[0][1]), pair[0][2])
    ):
        predicted = observed = read = unpredicted = 0
        wrong = []
        for item_id, cells in sorted(items.items()):
            expect = predicted_differs(cells["test-ref"], prefill, args.tile)
            built = cells["test-ref"]["cache_differs"]
            if expect is None:
                unpredicted += 1
                continue
            predicted += expect
            observed += built
            read_differs = "ref-test" in cells and cells["ref-test"]["first_divergence"] is not None
            read += read_differs
            if built != expect or read_differs:
                wrong.append(
                    f"{item_id} ({prefill[item_id]} positions: {'differs' if built else 'same'}"
                    f"{', read side differs' if read_differs else ''})"
                )
        n = len(items) - unpredicted
        failed += wrong
        name = level if run < 0 else f"{level} run {run + 1}"
        print(
            f"| {factor} | {name} | {predicted}/{n} | {observed}/{n} | {read}/{n} | {unpredicted}"
            f" | {'; '.join(wrong) or '—'} |"
        )
    print(f"\nthe rule failed on {len(failed)} item-level(s)" if failed else "\nthe rule held on every item and level")
    return 1 if failed else 0


def _order(level: str) -> tuple:
    digits = "".join(ch for ch in level if ch.isdigit())
    return (not level[0].isdigit(), int(digits or 0), level)


if __name__ == "__main__":
    sys.exit(main())
