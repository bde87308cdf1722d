"""What a finished ledger cost: model-job time per stage (saved run and audit) and bytes per part.

    python bench/ledger_costs.py ledger/all200

Reads snakemake's benchmark files (one per model job, under benchmarks/ and benchmarks/audit/) and
the files of the ledger; prints two Markdown tables. Per stage: each job's wall seconds summed (with
N jobs side by side the run's wall time is shorter than their sum) and its CPU seconds summed (what
the work costs, whatever else shared the cores).
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

from stagereplay.ledger.layout import LedgerLayout


def job_seconds(ledger: LedgerLayout) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(tree, stage) -> each job's (wall, CPU) seconds; tree is 'run' or 'audit', stage the job kind (live, ...)."""
    folder = Path(ledger.directory) / "benchmarks"
    seconds: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for path in sorted(folder.rglob("*.tsv")):
        parts = path.relative_to(folder).parts
        tree, stage = ("audit", parts[1]) if parts[0] == "audit" else ("run", parts[0])
        with open(path, newline="") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
        seconds[(tree, stage)].append((float(rows[-1]["s"]), float(rows[-1]["cpu_time"])))
    return seconds


def part_bytes(ledger: LedgerLayout) -> dict[str, int]:
    """Bytes of each top-level part of the ledger (objects/, tables/, audit/, models/, ...), files summed."""
    root = Path(ledger.directory)
    sizes: dict[str, int] = defaultdict(int)
    for path in root.rglob("*"):
        if path.is_file():
            part = path.relative_to(root).parts[0]
            sizes[part if (root / part).is_dir() else "(top-level files)"] += path.stat().st_size
    return dict(sorted(sizes.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", type=Path, help="a finished ledger_dir")
    args = parser.parse_args(argv)
    ledger = LedgerLayout(args.ledger)
    print("| tree | stage | jobs | wall s (sum of jobs) | CPU s (sum of jobs) | longest job (wall s) |")
    print("|---|---|---|---|---|---|")
    for (tree, stage), values in sorted(job_seconds(ledger).items()):
        wall, cpu = [value[0] for value in values], [value[1] for value in values]
        print(f"| {tree} | {stage} | {len(values)} | {sum(wall):,.0f} | {sum(cpu):,.0f} | {max(wall):,.0f} |")
    print()
    print("| part | bytes |")
    print("|---|---|")
    sizes = part_bytes(ledger)
    for part, size in sizes.items():
        print(f"| {part} | {size:,} |")
    print(f"| total | {sum(sizes.values()):,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
