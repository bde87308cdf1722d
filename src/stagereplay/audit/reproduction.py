"""E4's figures from the audit's checks (``audit.rerun``): reproduced x/N per artifact, trajectory and item,
the mismatches and environment differences, the one-line result, and ``audit/e4.json``, which keeps them
with the digests of the saved tables they describe."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa

from stagereplay.ledger.atomic import atomic_write_text
from stagereplay.ledger.layout import LedgerLayout
from stagereplay.ledger.tables import SPREAD_SUFFIX, read_table, stored_rows_digest
from stagereplay.report.stats import share
from stagereplay.report.text import under_load_text

MISMATCHES_LISTED = 50
NOT_MEASURED = "not measured"


def _describe(check: dict) -> str:
    where = " ".join(
        part
        for part in (
            f"item {check['item_id']}" if check["item_id"] else None,
            check["side"],
            check["artifact"],
            f"first differing layer {check['first_differing_layer']}"
            if check["first_differing_layer"] is not None
            else None,
            f"first differing position {check['first_differing_position']}"
            if check["first_differing_position"] is not None
            else None,
            check["detail"],
        )
        if part
    )
    return where


def _reproduced(values: list[bool]) -> dict:
    """x/N; with nothing audited there is no count, only the statement that nothing was measured."""
    if not values:
        return {"reproduced": None, **share(0, 0), "status": NOT_MEASURED}
    return {"reproduced": sum(values), **share(sum(values), len(values))}


RUNTIME_COLUMNS = ("engine", "engine_version", "device", "threads", "attn_implementation")


def audit_runtime(trajectories: list[dict]) -> dict:
    """What each checkpoint's audit jobs really ran, read from their rows' environment columns (the
    engine's own account: llama.cpp names its flash attention setting, transformers its kernel)."""
    ran: dict[str, set[tuple]] = defaultdict(set)
    for row in trajectories:
        ran[row["checkpoint"]].add(tuple(row[column] for column in RUNTIME_COLUMNS))
    described = {name: [dict(zip(RUNTIME_COLUMNS, values)) for values in sorted(ran[name])] for name in sorted(ran)}
    return {name: runs[0] if len(runs) == 1 else runs for name, runs in described.items()}


def worst_artifact(artifacts: dict[str, dict]) -> dict | None:
    """The artifact kind reproduced least (lowest rate; then the most mismatches, then by name), as the card's E4
    answer names it: a count over trajectories alone can read 40/40 while E6's caches reproduce 56/72. None when
    no artifact was audited."""
    measured = [(name, entry) for name, entry in artifacts.items() if entry["n"]]
    if not measured:
        return None
    name, entry = min(measured, key=lambda item: (item[1]["rate"], item[1]["count"] - item[1]["n"], item[0]))
    return {"artifact": name, **entry}


def spread_figures(rows: list[dict]) -> dict | None:
    """The runs of cells under load against their saved runs' spread (``audit.rerun._in_spread``): per artifact,
    how many recomputed runs fall within it, and over all of them. An expected spread, not a reproduction: these
    checks neither count as reproduced artifacts nor make the status. None where no cell ran under load."""
    by_artifact: dict[str, list[bool]] = defaultdict(list)
    by_level: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        by_artifact[row["artifact"].removesuffix(SPREAD_SUFFIX)].append(row["reproduced"])
        by_level[spread_level(row["side"])].append(row["reproduced"])
    if not by_artifact:
        return None
    within = [value for values in by_artifact.values() for value in values]
    return {
        "method": "each recomputed run of a cell under load against the artifacts of its saved runs",
        "within": share(sum(within), len(within)),
        "artifacts": {name: share(sum(values), len(values)) for name, values in sorted(by_artifact.items())},
        # Per level and cell (an E6 level's cell, a control's apart; a served server's cell and client): the
        # figure the card gives, never the pooled one.
        "levels": {name: share(sum(values), len(values)) for name, values in sorted(by_level.items())},
    }


def spread_level(side: str) -> str:
    """The level and cell a check under load belongs to, from its side: 'batch=2 ref-test run 1' -> 'batch=2
    ref-test'; 'served default load run 0 item arith-001 (default client)' -> 'served default load (default
    client)'."""
    level, _, rest = side.partition(" run ")
    client = rest[rest.index(" (") :] if " (" in rest else ""
    return level + client


def e4_summary(rows: list[dict], audit_runtime: dict | None = None) -> dict:
    """Reproduced x/N per artifact kind, per trajectory and per item; mismatches and environment differences;
    apart from these, the runs under load against their saved spread (``spread_figures``)."""
    spread = [row for row in rows if row["artifact"].endswith(SPREAD_SUFFIX)]
    rows = [row for row in rows if not row["artifact"].endswith(SPREAD_SUFFIX)]
    by_artifact: dict[str, list[bool]] = defaultdict(list)
    by_trajectory: dict[tuple, bool] = {}
    by_item: dict[tuple, bool] = {}
    for row in rows:
        by_artifact[row["artifact"]].append(row["reproduced"])
        if row["kind"] == "trajectory":
            key = (row["checkpoint"], row["item_id"], row["side"])
            by_trajectory[key] = by_trajectory.get(key, True) and row["reproduced"]
        if row["item_id"] is not None:
            key = (row["checkpoint"], row["item_id"])
            by_item[key] = by_item.get(key, True) and row["reproduced"]
    mismatches = [row for row in rows if not row["reproduced"]]
    artifacts = {name: _reproduced(values) for name, values in sorted(by_artifact.items())}
    environment = Counter(row["environment"] for row in rows if row["environment_differs"])
    # A run is reproduced only if trajectories were recomputed: a model fingerprint alone reproduces no result.
    status = "differences found" if mismatches else "reproduced" if by_trajectory else NOT_MEASURED
    figures = {
        "name": "audit",
        "status": status,
        "method": "every saved row recomputed from its saved inputs into audit/, every fingerprint compared",
        "items": _reproduced(list(by_item.values())),
        "trajectories": _reproduced(list(by_trajectory.values())),
        "artifacts": artifacts,
        "worst_artifact": worst_artifact(artifacts),
        "under_load": spread_figures(spread),
        "mismatches": [
            {
                key: row[key]
                for key in (
                    "kind",
                    "artifact",
                    "checkpoint",
                    "item_id",
                    "side",
                    "first_differing_layer",
                    "first_differing_position",
                    "detail",
                    "saved",
                    "audited",
                )
            }
            for row in mismatches[:MISMATCHES_LISTED]
        ],
        "mismatches_not_listed": max(len(mismatches) - MISMATCHES_LISTED, 0),
        "environment_differences": [{"difference": text, "rows": count} for text, count in sorted(environment.items())],
    }
    if audit_runtime:
        figures["audit_runtime"] = audit_runtime
    return figures


def _fraction(entry: dict) -> str:
    return NOT_MEASURED if entry["n"] == 0 else f"{entry['reproduced']}/{entry['n']}"


def e4_line(figures: dict) -> str:
    artifacts = sum(entry["n"] for entry in figures["artifacts"].values())
    reproduced = sum(entry["reproduced"] or 0 for entry in figures["artifacts"].values())
    if not artifacts:
        return f"E4 audit: {NOT_MEASURED} (no saved row was audited)"
    line = (
        f"E4 audit: {figures['status']}; {reproduced}/{artifacts} artifacts reproduced; trajectories "
        f"{_fraction(figures['trajectories'])}, items {_fraction(figures['items'])}"
    )
    worst = figures["worst_artifact"]
    if worst["count"] < worst["n"]:
        line += f"; worst reproduced: {worst['artifact']} {worst['count']}/{worst['n']}"
    if figures["mismatches"]:
        line += f"; first mismatch: {_describe(figures['mismatches'][0])}"
    if figures["environment_differences"]:
        line += f"; environment differs ({figures['environment_differences'][0]['difference']})"
    if figures.get("under_load"):
        line += f"; {under_load_text(figures['under_load'])}"
    return line


# --- e4.json: the audit's own output, beside tables/audit.parquet ---------------------------------
# It holds the E4 figures and the row digests of the saved tables they were audited against, so a
# reader (the results card) can tell whether they still describe the ledger: after the ledger changes,
# the card says "not run" until the next audit, as summary.json used to when it held E4.

SAVED_TABLES = ("trajectories", "comparisons", "transplants", "factors", "served")


def saved_table_digests(tables: dict[str, pa.Table | None]) -> dict[str, str | None]:
    """The stored row digest of each saved table the audit compared (absent tables left out)."""
    return {name: stored_rows_digest(table) for name, table in tables.items() if table is not None}


def ledger_table_digests(ledger: str | Path) -> dict[str, str | None]:
    saved = LedgerLayout(ledger)
    return saved_table_digests(
        {name: read_table(saved.table(name)) for name in SAVED_TABLES if Path(saved.table(name)).exists()}
    )


def e4_document(figures: dict, digests: dict[str, str | None]) -> dict:
    return {**figures, "saved_tables": digests}


def e4_summary_of(document: dict) -> dict:
    """The figures of an e4.json document (what the card shows and verify recomputes)."""
    return {key: value for key, value in document.items() if key != "saved_tables"}


def e4_describes(document: dict, digests: dict[str, str | None]) -> bool:
    """Whether an e4.json document was audited against exactly these saved tables."""
    return document.get("saved_tables") == digests


def write_e4(document: dict, path: str | Path) -> Path:
    return atomic_write_text(path, json.dumps(document, indent=2) + "\n")
