"""What E6 cost, per factor level: positions fed through the model per item against the design minimum,
and model-job wall time per item against E1's; what the served traffic battery cost, per server: its job's wall
time per item and per pattern against E1's; then the boundary cache's bytes per item for each cache type the
ledger ran (llama.cpp's precisions are cache types).

    python bench/factor_costs.py ledger/factors
    python bench/factor_costs.py ledger/factors --timed-by audit   # the wall times of E4's recomputation

Measured: each factor row's ``forward_positions`` (counted by the engine as it fed them: builds,
continuations, batch padding, and any reference cache rebuilt because it was not stored) and each factor
job's benchmark file. The design minimum counts each distinct computation once and the reference cell
not at all (it is E2's row): one build under the level (a batch's B rows, padded to the longest on
transformers, as they are on llama.cpp; a prefix hit's reused and new positions) and one continuation per
other cell (B rows per step where it is read in a batch).
E1 per item: the live and prefill jobs of replica 0 at the E1 precision, wall seconds summed over shards
and divided by the items. ``--timed-by audit`` takes every wall time from the audit's recomputation of the same
jobs instead (``snakemake --config mode=audit``): for a ledger whose run shared its cores and whose audit had them
to itself. Cache bytes per item: the stored objects of E2's prefill rows at each precision
(measured, file sizes), beside the plan's projection for the same positions (``design.storage_plan``); a
cache type E6 ran but no row stored (a ``cache_type`` level) is projected only. Prints two Markdown tables.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.design.cells import cell_label
from stagereplay.design.factors import factor_named
from stagereplay.design.storage_plan import cache_object_bytes
from stagereplay.engines.registry import SPECS
from stagereplay.engines.shapes import checkpoint_shapes
from stagereplay.ledger.layout import LedgerLayout


def wall_seconds(benchmark: Path) -> float:
    with open(benchmark, newline="") as handle:
        return float(list(csv.DictReader(handle, delimiter="\t"))[-1]["s"])


def minimum_positions(row: dict, contexts: dict[str, int]) -> int:
    """The positions one cell needs at least, as the design defines it (module docstring)."""
    batch = 1 + len(row["companions"])  # only a batch's rows (batch, kv_unified) name companions
    continuation = len(row["suffix_tokens"]) * (batch if row["read"] == "test" else 1)
    if row["cell"] != cell_label(factor_named(row["factor"]).cells[0]):
        return continuation  # the level's first cell built the cache; the others continue it or the reference
    members = [contexts[member] for member in (row["item_id"], *row["companions"])]
    built = batch * max(members) if SPECS[row["engine"]].pads_batches else sum(members)
    return built + continuation


def factor_costs(root: str | Path, timed_by: str = "run") -> list[dict]:
    """Per factor level: positions fed and wall time per item, beside E1's. ``timed_by``: ``run`` (the saved
    ledger's benchmark files) or ``audit`` (the audit's, for the same jobs)."""
    ledger = LedgerLayout(root)

    def benchmark(table: str) -> Path:
        return Path(ledger.job_benchmark(ledger.audited(table) if timed_by == "audit" else table))

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
    e1 = sum(wall_seconds(benchmark(table)) for table in e1_tables)
    levels: dict[tuple, list[dict]] = defaultdict(list)
    for row in factors:
        if row["applicable"]:
            levels[(row["checkpoint"], row["precision"], row["factor"], row["level"])].append(row)
    table = []
    for (checkpoint, precision, factor, level), rows in sorted(levels.items()):
        tables = [ledger.factor_table(checkpoint, precision, factor, level, shard) for shard in shards]
        wall = sum(wall_seconds(benchmark(table)) for table in tables)
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


def e1_seconds_per_item(ledger: LedgerLayout, benchmark, checkpoint: str, precision: str, items: int) -> float:
    """E1's model-job wall time per item: the live and prefill jobs of replica 0 at ``precision``, over its shards."""
    live = Path(ledger.live_table(checkpoint, precision, 0, "000")).parent
    shards = sorted(path.stem.removeprefix("shard-") for path in live.glob("shard-*.parquet"))
    tables = [ledger.live_table(checkpoint, precision, 0, shard) for shard in shards]
    tables += [ledger.rebuilt_table(checkpoint, precision, precision, "prefill", 0, shard) for shard in shards]
    return sum(wall_seconds(benchmark(table)) for table in tables) / items


def served_costs(root: str | Path, timed_by: str = "run") -> list[dict]:
    """Per served server: its job's wall time per item and per traffic pattern sent (each client's patterns of the
    battery, summary.json's ``battery``), beside E1's wall time per item: what the battery costs a server."""
    ledger = LedgerLayout(root)

    def benchmark(table: str) -> Path:
        return Path(ledger.job_benchmark(ledger.audited(table) if timed_by == "audit" else table))

    summary = json.loads(Path(ledger.summary).read_text())
    config = json.loads(Path(ledger.provenance).read_text())["config"]
    checkpoint = summary["checkpoints"][0]
    servers = summary["served"]["servers"]
    items = next(iter(servers.values()))["items"]
    e1 = e1_seconds_per_item(ledger, benchmark, checkpoint, config["matched"]["precision"], items)
    table = []
    for name, entry in servers.items():
        patterns = sum(len(battery) for battery in entry["battery"].values())
        wall = wall_seconds(benchmark(ledger.served_table(name)))
        table.append(
            {
                "server": name,
                "items": entry["items"],
                "patterns": patterns,
                "wall": wall / entry["items"],
                "per_pattern": wall / entry["items"] / patterns,
                "e1": e1,
            }
        )
    return table


def cache_bytes(root: str | Path) -> list[dict]:
    """Per cache type: bytes per item of the stored boundary caches (E2's prefill rows, replica 0) and the
    projection's figure for the same positions."""
    ledger = LedgerLayout(root)
    trajectories = pq.read_table(ledger.table("trajectories")).to_pylist()
    factors = pq.read_table(ledger.table("factors")).to_pylist() if Path(ledger.table("factors")).is_file() else []
    config = json.loads(Path(ledger.provenance).read_text())["config"]
    prefill = [r for r in trajectories if (r["construction"], r["replica"]) == ("prefill", 0)]
    checkpoint = prefill[0]["checkpoint"]
    shapes = checkpoint_shapes(config["checkpoints"][checkpoint])
    positions = {r["item_id"]: r["cache_positions"] for r in prefill}
    types = sorted({r["precision"] for r in prefill} | {r["level"] for r in factors if r["factor"] == "cache_type"})
    table = []
    for cache_type in types:
        stored = [
            Path(ledger.objects, r["cache_object"][:2], f"{r['cache_object']}.safetensors")
            for r in prefill
            if r["precision"] == cache_type
        ]
        sizes = [path.stat().st_size for path in stored if path.is_file()]
        projected = [cache_object_bytes(shapes, cache_type, count) for count in positions.values()] if shapes else []
        table.append(
            {
                "cache_type": cache_type,
                "items": len(positions),
                "stored": sum(sizes) / len(sizes) if sizes else None,
                "projected": sum(projected) / len(projected) if projected else None,
            }
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", help="a ledger with E6 (tables/factors.parquet), or with served requests")
    parser.add_argument(
        "--timed-by",
        choices=("run", "audit"),
        default="run",
        help="whose benchmark files give the wall times: the run's (default) or its audit's recomputation",
    )
    args = parser.parse_args()
    if args.timed_by == "audit" and not Path(LedgerLayout(args.ledger).e4).is_file():
        parser.error(f"{args.ledger} has no audit — run snakemake with --config mode=audit first, or drop --timed-by")
    ledger = LedgerLayout(args.ledger)
    if Path(ledger.table("factors")).is_file():
        print(
            "| factor level | items | positions fed / item | design minimum / item | fed / minimum | wall s / item | E1 wall s / item | wall vs E1 |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for row in factor_costs(args.ledger, args.timed_by):
            print(
                f"| {row['level']} | {row['items']} | {row['fed']:.0f} | {row['minimum']:.0f} | {row['ratio']:.2f} |"
                f" {row['wall']:.2f} | {row['e1']:.2f} | {row['wall'] / row['e1']:.2f}× |"
            )
        print()
    if Path(ledger.table("served")).is_file():
        print(
            "| served server | items | patterns (all clients) | wall s / item | wall s / item / pattern | E1 wall s / item"
            " | per pattern vs E1 |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for row in served_costs(args.ledger, args.timed_by):
            print(
                f"| {row['server']} | {row['items']} | {row['patterns']} | {row['wall']:.2f} | {row['per_pattern']:.2f} |"
                f" {row['e1']:.2f} | {row['per_pattern'] / row['e1']:.2f}× |"
            )
        print()
    print("| cache type | items | stored bytes / item | projected bytes / item |")
    print("|---|---:|---:|---:|")
    for row in cache_bytes(args.ledger):
        stored = f"{row['stored']:,.0f}" if row["stored"] is not None else "— (not stored)"
        projected = f"{row['projected']:,.0f}" if row["projected"] is not None else "—"
        print(f"| {row['cache_type']} | {row['items']} | {stored} | {projected} |")


if __name__ == "__main__":
    main()
