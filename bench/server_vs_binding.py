"""Do two engines agree on the same design, item by item? For the llama-server ledger beside the binding's.

Both ledgers must come from the same design on the same GGUF (config/llamaserver.yaml and config/llamacpp.yaml
differ in the engine and the names only). Rows are matched by (precision, construction, replica, item), across
the checkpoint names; for each construction it prints, item by item and as totals, whether the two agree on:

- cache bytes: the boundary cache's fingerprint (``cache_object``, xxh3-128 of every layer's K and V);
- prefix tokens: the prompt and stage tokens (``prefix_object``);
- suffix tokens: the continuation (``suffix_object``), and the readout's answer;

then the same for E5's transplants (matched by selection, item, donor, recipient, precision and subset: the
transplanted cache's digest and the suffix), and E6's factor cells (matched by precision, factor, level, cell
and item: the built cache's digest, the suffix, the reused and the converted cache's digests; first-read
logits are not compared, the server records none). Exit status 0 when everything agrees.

Then, per E6 level, the engines' verdicts item by item (``design.cells.item_verdict``, from each ledger's own
cells): how many items each serves differently, on how many the two verdicts agree, and each disagreement
(A's verdict → B's). Where B is the binding's imitation of a server setting (its batch of sequences in one
decode call, its context kept in place of the slot's prompt cache), this says where the imitation is
faithful and where it is not. ``--items-in-both`` compares only the items both ledgers have (a 32-item server
sweep beside the binding's 96).

    python bench/server_vs_binding.py ledger/llamaserver ledger/llamacpp
    python bench/server_vs_binding.py --items-in-both ledger/factors-llamaserver ledger/factors-llamacpp
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.design.cells import CELL_LABELS, item_verdict

TRAJECTORY_KEY = ("precision", "construction", "replica", "item_id")
TRAJECTORY_FIELDS = {
    "cache": "cache_object",
    "prefix": "prefix_object",
    "suffix": "suffix_object",
    "readout": "readout_answer",
}
TRANSPLANT_KEY = ("selection", "item_id", "donor", "recipient", "precision", "subset")
TRANSPLANT_FIELDS = {"cache": "cache_digest", "suffix": "suffix_object"}
# A pinned level's one run (run null) is paired with a level under load's first run (0); the other runs under
# load are in one ledger only.
FACTOR_KEY = ("precision", "factor", "level", "cell", "run", "item_id")
FACTOR_FIELDS = {
    "cache": "cache_digest",
    "suffix": "suffix_object",
    "reused": "reused_digest",
    "converted": "converted_digest",
}


def rows_by_key(ledger: Path, table: str, key: tuple[str, ...]) -> dict[tuple, dict]:
    path = ledger / "tables" / f"{table}.parquet"
    if not path.is_file():
        return {}
    rows = pq.read_table(path).to_pylist()
    return {tuple((row.get(name) or 0) if name == "run" else row[name] for name in key): row for row in rows}


def margin_drift(a: dict[tuple, dict], b: dict[tuple, dict], keys: list[tuple]) -> float | None:
    """The largest difference of two engines' per-token margins (and readout margins) where both chose the same
    tokens: the server's are log-probability differences, the binding's float32 logit differences."""
    largest = None
    for key in keys:
        if "suffix_margins" not in a[key] or a[key]["suffix_tokens"] != b[key]["suffix_tokens"]:
            continue
        pairs = list(zip(a[key]["suffix_margins"], b[key]["suffix_margins"]))
        if a[key]["readout_answer"] == b[key]["readout_answer"]:
            pairs.append((a[key]["readout_margin"], b[key]["readout_margin"]))
        for x, y in pairs:
            largest = max(largest or 0.0, abs(x - y))
    return largest


def compare(a: dict[tuple, dict], b: dict[tuple, dict], fields: dict[str, str], group: int) -> tuple[list[str], bool]:
    """Lines per group (the key's ``group``-th part: the construction or the selection) and whether all agree."""
    lines, agree = [], True
    only = sorted(set(a) ^ set(b), key=str)
    if only:
        agree = False
        lines.append(f"  rows in one ledger only: {len(only)} (first: {only[0]})")
    groups: dict[str, list[tuple]] = defaultdict(list)
    for key in sorted(set(a) & set(b), key=str):
        groups[str(key[group])].append(key)
    for name, keys in groups.items():
        totals = dict.fromkeys(fields, 0)
        for key in keys:
            same = {label: a[key][column] == b[key][column] for label, column in fields.items()}
            for label, equal in same.items():
                totals[label] += equal
            marks = " ".join(f"{label} {'=' if equal else 'DIFF'}" for label, equal in same.items())
            lines.append(f"    {' '.join(str(part) for part in key)}: {marks}")
        summary = ", ".join(f"{label} {totals[label]}/{len(keys)}" for label in fields)
        drift = margin_drift(a, b, keys)
        if drift is not None:
            summary += f"; largest |margin difference| where the tokens agree {drift:.3g}"
        lines.insert(len(lines) - len(keys), f"  {name}: {summary}")
        agree &= all(count == len(keys) for count in totals.values())
    return lines, agree


def level_verdicts(rows: dict[tuple, dict]) -> dict[tuple, dict[str, str]]:
    """Per (precision, factor, level, run): each item's verdict from its applicable cells' suffixes."""
    cells: dict[tuple, dict[str, dict]] = defaultdict(lambda: defaultdict(dict))
    for (precision, factor, level, cell, run, item_id), row in rows.items():
        if row["applicable"]:
            cells[(precision, factor, level, run)][item_id][cell] = row
    verdicts: dict[tuple, dict[str, str]] = {}
    for level, items in cells.items():
        verdicts[level] = {}
        for item_id, by_cell in items.items():
            reference = next(iter(by_cell.values()))["reference_suffix"]
            suffixes = [by_cell[label]["suffix_object"] if label in by_cell else None for label in CELL_LABELS]
            verdicts[level][item_id] = item_verdict(reference, *suffixes)
    return verdicts


def compare_verdicts(a: dict[tuple, dict], b: dict[tuple, dict]) -> list[str]:
    """Per level both ledgers ran: items served differently in each, verdicts that agree, and each disagreement."""
    va, vb = level_verdicts(a), level_verdicts(b)
    lines = []
    for level in sorted(set(va) & set(vb)):
        items = sorted(set(va[level]) & set(vb[level]))
        if not items:
            continue
        served_a = sum(va[level][item] not in ("none", "latent") for item in items)
        served_b = sum(vb[level][item] not in ("none", "latent") for item in items)
        same = sum(va[level][item] == vb[level][item] for item in items)
        moves: dict[str, int] = defaultdict(int)
        for item in items:
            if va[level][item] != vb[level][item]:
                moves[f"{va[level][item]} → {vb[level][item]}"] += 1
        line = (
            f"  {level[1]} {level[2]}{f' run {level[3]}' if level[3] else ''} ({level[0]}): served differently A {served_a}/{len(items)}, B {served_b}/{len(items)};"
            f" verdicts agree on {same}/{len(items)}"
        )
        if moves:
            line += " (" + ", ".join(f"{move} {count}" for move, count in sorted(moves.items())) + ")"
        lines.append(line)
    return lines


def in_both(a: dict[tuple, dict], b: dict[tuple, dict]) -> tuple[dict, dict]:
    """The rows of the items both ledgers have (the item id is each key's last part)."""
    items = {key[-1] for key in a} & {key[-1] for key in b}
    return {k: v for k, v in a.items() if k[-1] in items}, {k: v for k, v in b.items() if k[-1] in items}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ledger_a", type=Path)
    parser.add_argument("ledger_b", type=Path)
    parser.add_argument("--items-in-both", action="store_true", help="compare only the items both ledgers have")
    args = parser.parse_args()
    agree = True
    print(f"A = {args.ledger_a}, B = {args.ledger_b}")
    for title, table, key, fields, group in (
        ("trajectories (E1-E3), per construction", "trajectories", TRAJECTORY_KEY, TRAJECTORY_FIELDS, 1),
        ("transplants (E5), per selection", "transplants", TRANSPLANT_KEY, TRANSPLANT_FIELDS, 0),
        ("factor cells (E6), per factor", "factors", FACTOR_KEY, FACTOR_FIELDS, 1),
    ):
        a, b = rows_by_key(args.ledger_a, table, key), rows_by_key(args.ledger_b, table, key)
        if args.items_in_both:
            a, b = in_both(a, b)
        print(f"{title}: {len(a)} rows in A, {len(b)} in B")
        lines, same = compare(a, b, fields, group)
        print("\n".join(lines))
        agree &= same
        if table == "factors" and a and b:
            print("verdicts (E6), per level, item by item:")
            print("\n".join(compare_verdicts(a, b)))
    print("verdict:", "the two ledgers agree on every compared item" if agree else "the two ledgers differ (above)")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
