"""Print the GPU check's table from a finished ledger: what the numbers depend on, and E1/E3.

python bench/gpu_report.py ledger/gpu_check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stagereplay.ledger.layout import LedgerLayout


def fraction(entry: dict, key: str) -> str:
    return f"{entry[key]}/{entry['n']}"


def rows(summary: dict) -> list[list[str]]:
    primary = summary["checkpoints"][0]
    e1, e3 = summary["E1"]["checkpoints"][primary], summary["E3"]["checkpoints"][primary]["precisions"]
    e1_precision = e1["precision"]
    replicas = e1.get("replicas_exact", {})
    table = []
    for entry in summary["environment"]:
        if entry["checkpoint"] != primary:
            continue
        precision = entry["precision"]
        is_e1 = precision == e1_precision
        table.append(
            [
                precision,
                entry["device_name"],
                "on" if entry["tf32"] else "off",
                "yes" if entry["deterministic"] else "no",
                f"{e1['suffixes_differ']['count']}/{e1['suffixes_differ']['n']}" if is_e1 else "—",
                fraction(e3[precision]["bit_exact"], "count") if precision in e3 else "—",
                ", ".join(f"{side} {fraction(value, 'count')}" for side, value in replicas.items()) if is_e1 else "—",
            ]
        )
    return table


def markdown(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", type=Path, help="ledger_dir of a finished run (holds summary.json)")
    args = parser.parse_args(argv)
    path = Path(LedgerLayout(args.ledger).summary)
    if not path.is_file():
        print(f"gpu_report: {path} not found — run the workflow to the end first", file=sys.stderr)
        return 1
    summary = json.loads(path.read_text())
    header = [
        "precision",
        "device",
        "TF32",
        "deterministic",
        "E1 suffixes differ",
        "E3 bridge bit-exact",
        "E1 replicas exact",
    ]
    print(markdown(header, rows(summary)))
    if "E6" in summary:  # the E6 sweep on the GPU: one sentence per factor level, as the card reads it
        from stagereplay.report.factor_reading import e6_reading

        print("\n" + "\n".join(f"- {line}" for line in e6_reading(summary["E6"])))
    if any(entry["device"] == "cuda" and entry["tf32"] for entry in summary["environment"]):
        print("\nTF32 was on for a CUDA run: its fp32 arm is not fp32 — report this as a bug", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
