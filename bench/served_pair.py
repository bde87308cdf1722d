"""Do two served servers answer alike, cell for cell? For an attached server beside a deployed one with its flags.

Reads one ledger's served table (tables/served.parquet) and sets two of its servers side by side, item by item:

- the pinned cells (``alone``, ``control``, ``replay``, ``replay_control``, ``hit``): the same tokens, and the same margins at every step;
- the runs amid other clients: per item, in how many runs the answer differs from the server's own answer alone
  (their timing is not pinned, so these are compared as counts, not as tokens); the copies sent at once: per item,
  how many distinct answers they came back with.

Started with the same flags on the same GGUF and build, two servers should agree on every pinned cell; an
attached server that does not is not the server its flags say, or serves other traffic besides the run's.
Exit status 0 when every pinned cell agrees.

    python bench/served_pair.py ledger/attach default yours
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.design.divergence import first_divergence
from stagereplay.ledger.tables import SERVED_PINNED_CELLS


def cells(rows: list[dict], server: str) -> dict[tuple, dict]:
    """The pinned client's rows of ``server`` (a table from before the client column: every row is)."""
    return {
        (row["item_id"], row["cell"], row["run"]): row
        for row in rows
        if row["server"] == server and (row.get("client") or "pinned") == "pinned"
    }


def load_counts(by_cell: dict[tuple, dict]) -> dict[str, int]:
    """Per item, the runs amid other clients whose answer differs from the item's answer alone."""
    counts: dict[str, int] = {}
    for (item, cell, _), row in by_cell.items():
        if cell == "load":
            alone = by_cell[(item, "alone", 0)]["tokens"]
            counts[item] = counts.get(item, 0) + (first_divergence(list(row["tokens"]), list(alone)) is not None)
    return counts


def distinct_copies(by_cell: dict[tuple, dict]) -> dict[str, int]:
    """Per item, how many distinct answers its copies sent at once came back with."""
    answers: dict[str, set] = {}
    for (item, cell, _), row in by_cell.items():
        if cell == "copies":
            answers.setdefault(item, set()).add(tuple(row["tokens"]))
    return {item: len(found) for item, found in answers.items()}


def _field(a: dict, b: dict, item: str, cell: str, name: str) -> bool:
    """Both servers served every run of ``cell`` of ``item`` (one, or one per slot) and gave the same ``name``
    (tokens, margins) in each."""
    keys = {key for key in (*a, *b) if key[:2] == (item, cell)}
    return all(key in a and key in b and a[key][name] == b[key][name] for key in keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", type=Path)
    parser.add_argument("a", help="a server of the ledger's served block (the reference)")
    parser.add_argument("b", help="another server of it")
    args = parser.parse_args(argv)
    table = Path(args.ledger) / "tables" / "served.parquet"
    if not table.is_file():
        print(f"{table} not found — run a config with a served block there first", file=sys.stderr)
        return 2
    rows = pq.read_table(table).to_pylist()
    a, b = cells(rows, args.a), cells(rows, args.b)
    for name, by_cell in ((args.a, a), (args.b, b)):
        if not by_cell:
            servers = sorted({row["server"] for row in rows})
            print(f"no server {name!r} in {table} — one of {', '.join(servers)}", file=sys.stderr)
            return 2
    items = sorted({item for item, _, _ in a} & {item for item, _, _ in b})
    print(f"{args.a} vs {args.b}: {len(items)} items in both ({table})")
    print("| cell | same tokens | same margins at every step | items that differ |")
    print("|---|---:|---:|---|")
    disagreements = 0
    for cell in SERVED_PINNED_CELLS:
        # A replay is sent only where the answer alone passed the stage boundary: one side without it differs.
        served = [item for item in items if any(key[:2] == (item, cell) for key in (*a, *b))]
        if not served:
            continue
        same_tokens = [item for item in served if _field(a, b, item, cell, "tokens")]
        same_margins = [item for item in served if _field(a, b, item, cell, "margins")]
        differ = sorted(set(served) - (set(same_tokens) & set(same_margins)))
        disagreements += len(differ)
        print(
            f"| {cell} | {len(same_tokens)}/{len(served)} | {len(same_margins)}/{len(served)} |"
            f" {', '.join(differ) or '—'} |"
        )
    count_a, count_b = load_counts(a), load_counts(b)
    runs = max((run for _, cell, run in a if cell == "load"), default=-1) + 1
    same_counts = [item for item in items if count_a.get(item) == count_b.get(item)]
    changed = [f"{item} ({count_a.get(item)}→{count_b.get(item)})" for item in items if item not in same_counts]
    print(
        f"| amid other clients ({runs} runs): runs that differ from alone, per item | {len(same_counts)}/{len(items)}"
        f" items the same count | — | {', '.join(changed) or '—'} |"
    )
    distinct_a, distinct_b = distinct_copies(a), distinct_copies(b)
    if distinct_a or distinct_b:
        same = [item for item in items if distinct_a.get(item) == distinct_b.get(item)]
        changed = [f"{item} ({distinct_a.get(item)}→{distinct_b.get(item)})" for item in items if item not in same]
        print(
            f"| copies at once: distinct answers, per item | {len(same)}/{len(items)} items the same count | — |"
            f" {', '.join(changed) or '—'} |"
        )
    return 0 if disagreements == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
