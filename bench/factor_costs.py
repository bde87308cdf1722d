"""What E6 cost, per factor level: positions fed through the model per item against the design minimum,
and model-job wall time per item against E1's.

    python bench/factor_costs.py ledger/factors

Measured: each factor row's ``forward_positions`` (counted by the engine as it fed them: builds,
continuations, batch padding, and any reference cache rebuilt because it was not stored) and each factor
job's benchmark file. The design minimum counts each distinct computation once and the reference cell
not at all (it is E2's row): one build under the level (a batch's B padded rows; a prefix hit's reused
and new positions) and one continuation per other cell (B rows per step where it is read in a batch).
E1 per item: the live and prefill jobs of replica 0 at the E1 precision, wall seconds summed over shards
and divided by the items. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.ledger.layout import LedgerLayout


def wall_seconds(benchmark: Path) -> float:
    with open(benchmark, newline="") as handle:
        return float(list(csv.DictReader(handle, delimiter="\t"))[-1]["s"])


def minimum_positions(row: dict, contexts: dict[str, int]) -> int:
    """The positions one cell needs at least, as the design defines it (module docstring)."""
    batch = 1 + len(row["companions"]) if row["factor"] == "batch" else 1
    continuation = len(row["suffix_tokens"]) * (batch if row["read"] == "test" else 1)
    if row["build"] != "test" or row["cell"] != "test-ref":
        return continuation  # (t, t) continues the cache (t, r) built: it is built once
    members = [row["item_id"], *row["companions"]]
    return batch * max(contexts[member] for member in members) + continuation


def factor_costs(root: str | Path) -> list[dict]:
    ledger = LedgerLayout(root)
    factors = pq.read_table(ledger.table("factors")).to_pylist()
    trajectories = pq.read_table(ledger.table("trajectories")).to_pylist()
    summary = json.loads(Path(ledger.summary).read_text())
    precision = summary["E6"]["precision"]
    prefill = [
        r for r in trajectories if (r["construction"], r["replica"], r["precision"]) == ("prefill", 0, precision)
    ]
    contexts = {r["item_id"]: r["prefix_length"] - 1 for r in prefill}
    items = len(contexts)
    checkpoint = summary["E6"]["checkpoint"]
    shards = sorted(
        {Path(path).stem.removeprefix("shard-") for path in ledger.shard_tables() if "factor" in path.parts}
    )
    e1_tables = [ledger.live_table(checkpoint, precision, 0, shard) for shard in shards]
    e1_tables += [ledger.rebuilt_table(checkpoint, precision, precision, "prefill", 0, shard) for shard in shards]
    e1 = sum(wall_seconds(Path(ledger.job_benchmark(table))) for table in e1_tables)
    levels: dict[tuple, list[dict]] = defaultdict(list)
    for row in factors:
        if row["applicable"]:
            levels[(row["checkpoint"], row["precision"], row["factor"], row["level"])].append(row)
    table = []
    for (checkpoint, precision, factor, level), rows in sorted(levels.items()):
        tables = [ledger.factor_table(checkpoint, precision, factor, level, shard) for shard in shards]
        wall = sum(wall_seconds(Path(ledger.job_benchmark(table))) for table in tables)
        n = len({row["item_id"] for row in rows})
        fed = sum(row["forward_positions"] for row in rows)
        minimum = sum(minimum_positions(row, contexts) for row in rows)
        table.append(
            {
                "level": f"{factor} {level}",
                "items": n,
                "fed": fed / n,
                "minimum": minimum / n,
                "ratio": fed / minimum,
                "wall": wall / n,
                "e1": e1 / items,
            }
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", help="a ledger with E6 (tables/factors.parquet)")
    args = parser.parse_args()
    print(
        "| factor level | items | positions fed / item | design minimum / item | fed / minimum | wall s / item | E1 wall s / item | wall vs E1 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in factor_costs(args.ledger):
        print(
            f"| {row['level']} | {row['items']} | {row['fed']:.0f} | {row['minimum']:.0f} | {row['ratio']:.2f} |"
            f" {row['wall']:.2f} | {row['e1']:.2f} | {row['wall'] / row['e1']:.2f}× |"
        )


if __name__ == "__main__":
    main()
