"""Does another precision's divergence sit where the E1 precision's does? E2's incremental-vs-prefill
comparison at each precision, item by item, over the same E1 prefix.

    python bench/precision_overlap.py ledger/factors-llamacpp

E3 shows the incremental cache is the live one (bit-exact bridge), so E2's incremental-vs-prefill rows are
live vs prefill at each precision on the same tokens. For the E1 precision and each other one, prints
how many items' caches and suffixes differ in both, in only one, or in neither, and the first differing
layers. On llama.cpp, where the precision is the cache type, this says whether a quantized cache still
differs only where the fp16 cache differs. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.ledger.layout import LedgerLayout


def overlap(root: str | Path) -> list[dict]:
    ledger = LedgerLayout(root)
    e1 = json.loads(Path(ledger.provenance).read_text())["config"]["matched"]["precision"]
    rows = [
        row
        for row in pq.read_table(ledger.table("comparisons")).to_pylist()
        if (row["experiment"], row["relation"]) == ("E2", "construction") and row["b"].startswith("prefill/")
    ]
    by_precision: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_precision.setdefault(row["precision"], {})[row["item_id"]] = row
    reference = by_precision[e1]
    table = []
    for precision, items in sorted(by_precision.items()):
        if precision == e1:
            continue
        shared = sorted(set(items) & set(reference))
        for what, differs in (("caches", lambda r: not r["cache_exact"]), ("suffixes", lambda r: r["suffix_differs"])):
            counts = Counter((differs(reference[item]), differs(items[item])) for item in shared)
            layers = [
                (reference[item]["first_differing_layer"], items[item]["first_differing_layer"])
                for item in shared
                if what == "caches" and differs(reference[item]) and differs(items[item])
            ]
            table.append(
                {
                    "pair": f"{e1} vs {precision}",
                    "what": what,
                    "items": len(shared),
                    "both": counts[True, True],
                    "only_reference": counts[True, False],
                    "only_other": counts[False, True],
                    "neither": counts[False, False],
                    "layers": layers,
                }
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", help="a ledger whose E2 ran at more than one precision")
    args = parser.parse_args()
    print(
        "| precisions | live vs prefill | items | differ in both | only the first | only the second | neither | first differing layers (both) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for row in overlap(args.ledger):
        layers = Counter(row["layers"])
        text = ", ".join(f"{a}/{b}: {n}" for (a, b), n in sorted(layers.items())) or "—"
        print(
            f"| {row['pair']} | {row['what']} differ | {row['items']} | {row['both']} | {row['only_reference']} |"
            f" {row['only_other']} | {row['neither']} | {text} |"
        )


if __name__ == "__main__":
    main()
