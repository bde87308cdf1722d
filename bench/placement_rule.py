"""Does the key-tile rule predict where an item's cells change the cache it writes? Per E6 placement level of a
llama.cpp ledger (binding or server), item by item.

The rule (docs/engines.md, "Where the item's cells lie"): with flash attention over an fp16 or fp32 cache, a call
of at least ``--tile`` queries (64 in the pinned ggml-cpu, ``GGML_FA_TILE_Q``) runs the tiled kernel, whose key
tiles of ``--tile`` cells (``GGML_FA_TILE_KV``) are counted from cell 0 of the cache; an item whose cells start at
cell C is then summed in the same pieces as alone exactly when C is a multiple of the tile. So it predicts, for
``kv_offset`` C, that the built cache (``test-ref``) differs from the reference exactly on the items whose
one-call prefill has at least a tile of queries, when C is not a multiple of the tile; that every control and
every ``kv_unified`` level (each sequence's cells from cell 0 of its own stream) writes the reference's bytes; and
that no read-side cell (``ref-test``) of these levels differs (a decode step is one query). It prints each
level's predicted and observed counts and every item where the prediction failed. Exit status 0 when none did.

    python bench/placement_rule.py ledger/factors-llamaserver
    python bench/placement_rule.py ledger/placement-llamacpp
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.design.factors import factor_named


def predicted_differs(factor: str, level: str, context: int, tile: int) -> bool:
    """Whether the rule predicts other built bytes for an item of ``context`` positions at this level."""
    if factor == "kv_unified" or factor_named(factor).removes_filler(level):
        return False  # the item's cells from cell 0 (of its own stream, or after the filler left)
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
        if row["factor"] in ("kv_offset", "kv_unified") and row["applicable"]
    ]
    if not factors:
        print(f"{args.ledger}: no kv_offset or kv_unified rows — run a config with those factors")
        return 1
    prefill = {
        row["item_id"]: row["prefix_length"] - 1
        for row in pq.read_table(tables / "trajectories.parquet").to_pylist()
        if (row["construction"], row["replica"]) == ("prefill", 0) and row["precision"] == factors[0]["precision"]
    }
    levels: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for row in factors:
        levels[(row["factor"], row["level"])].setdefault(row["item_id"], {})[row["cell"]] = row
    failed = []
    print("| factor | level | built cache differs: predicted | observed | read side differs | rule failed on |")
    print("|---|---|---:|---:|---:|---|")
    for (factor, level), items in sorted(levels.items(), key=lambda pair: (pair[0][0], _order(pair[0][1]))):
        predicted = observed = read = 0
        wrong = []
        for item_id, cells in sorted(items.items()):
            expect = predicted_differs(factor, level, prefill[item_id], args.tile)
            built = cells["test-ref"]["cache_differs"]
            predicted += expect
            observed += built
            read_differs = "ref-test" in cells and cells["ref-test"]["first_divergence"] is not None
            read += read_differs
            if built != expect or read_differs:
                wrong.append(
                    f"{item_id} ({prefill[item_id]} positions: {'differs' if built else 'same'}"
                    f"{', read side differs' if read_differs else ''})"
                )
        n = len(items)
        failed += wrong
        print(f"| {factor} | {level} | {predicted}/{n} | {observed}/{n} | {read}/{n} | {'; '.join(wrong) or '—'} |")
    print(f"\nthe rule failed on {len(failed)} item-level(s)" if failed else "\nthe rule held on every item and level")
    return 1 if failed else 0


def _order(level: str) -> tuple:
    digits = "".join(ch for ch in level if ch.isdigit())
    return (not level[0].isdigit(), int(digits or 0), level)


if __name__ == "__main__":
    sys.exit(main())
