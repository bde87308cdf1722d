"""Do two ledgers of the same config hold the same results? For checking a change that must not change behaviour.

Compares, between ledger A (say, made before a refactoring) and ledger B (after):
- the set of stored objects (content-addressed ids: every prefix, cache and suffix);
- every table's rows, less the wall-time column (``model_seconds``), in key order;
- summary.json, value by value, less the keys that name the run's own wall time;
and prints one line per difference, then a one-line verdict. Exit status 0 when they agree.

    python bench/same_ledger.py /path/to/ledger-before ledger [--ignore-summary-key E5.old_key ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.ledger.jsondiff import differences as json_differences
from stagereplay.ledger.jsondiff import path_text, value_at
from stagereplay.ledger.layout import LedgerLayout
from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import SCHEMAS

WALL_TIME_COLUMNS = {"model_seconds"}


def table_rows(layout: LedgerLayout, name: str) -> list[dict] | None:
    path = Path(layout.table(name))
    if not path.is_file():
        return None
    rows = pq.read_table(path).to_pylist()
    rows = [{key: value for key, value in row.items() if key not in WALL_TIME_COLUMNS} for row in rows]
    return sorted(rows, key=lambda row: json.dumps(row, sort_keys=True, default=str))


def differences(a: Path, b: Path, ignored_summary_keys: list[str]) -> list[str]:
    found = []
    layout_a, layout_b = LedgerLayout(a), LedgerLayout(b)
    objects_a = set(ObjectStore(layout_a.objects).object_ids())
    objects_b = set(ObjectStore(layout_b.objects).object_ids())
    if objects_a != objects_b:
        found.append(
            f"objects: {len(objects_a - objects_b)} only in A, {len(objects_b - objects_a)} only in B "
            f"(of {len(objects_a)} and {len(objects_b)})"
        )
    for name in SCHEMAS:
        if name == "prompts":
            continue  # one file per checkpoint, not a gathered table
        rows_a, rows_b = table_rows(layout_a, name), table_rows(layout_b, name)
        if rows_a != rows_b:
            count = lambda rows: "absent" if rows is None else f"{len(rows)} rows"  # noqa: E731
            found.append(f"table {name}: rows differ ({count(rows_a)} in A, {count(rows_b)} in B)")
    summary_a = json.loads(Path(layout_a.summary).read_text())
    summary_b = json.loads(Path(layout_b.summary).read_text())

    def kept(key: str) -> bool:
        return not any(key == prefix or key.startswith(prefix + ".") for prefix in ignored_summary_keys)

    # Every key path where the summaries differ (NaN equals NaN; 1 and 1.0 are the same figure).
    paths = {path_text(path): path for path in json_differences(summary_a, summary_b, strict=False)}
    for key in sorted(paths):
        if kept(key):
            found.append(
                f"summary {key}: {value_at(summary_a, paths[key], '<absent>')!r} in A,"
                f" {value_at(summary_b, paths[key], '<absent>')!r} in B"
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument(
        "--ignore-summary-key", action="append", default=[], help="a summary.json key (dotted) whose values may differ"
    )
    args = parser.parse_args()
    found = differences(args.a, args.b, args.ignore_summary_key)
    for line in found:
        print(line)
    objects = len(ObjectStore(LedgerLayout(args.a).objects).object_ids())
    print(
        f"{'DIFFERENT' if found else 'SAME'}: {args.a} vs {args.b} ({objects} objects in A, {len(found)} differences)"
    )
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
