"""What verify checks of the documents computed from a ledger's tables: that every table something present was
computed from is there, that summary.json and audit/e4.json equal the figures recomputed from their tables,
and that each results card carries the stamp of the summary.json it was drawn from (the rules are in
``audit.verify``'s docstring)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from stagereplay.audit.faults import RERUN, Fault, Report
from stagereplay.ledger.jsondiff import first_difference, path_text, value_at
from stagereplay.ledger.layout import RELATIVE
from stagereplay.report.stamp import stamp_problem

TRAJECTORIES, COMPARISONS, TRANSPLANTS, FACTORS, SERVED, AUDIT = (
    RELATIVE.table(name) for name in ("trajectories", "comparisons", "transplants", "factors", "served", "audit")
)
CARDS = (RELATIVE.card, RELATIVE.card_html)
SUMMARY = RELATIVE.summary
E4 = RELATIVE.e4
REWRITE_SUMMARY = "rerun snakemake --forcerun summary to rewrite it from the tables"
MIGRATE_SUMMARY = (
    "migrate it: rerun snakemake --forcerun summary report (it rewrites summary.json and the card from the tables)"
)
# What an E6 level that ran has had since its verdicts are served first (design.cells.item_verdict) and its
# sides are compared by an exact test (write_vs_read), unless its cells read converted caches (converted_cells).
SERVED_FIRST_KEYS = ("served_cell", "differing_cells", "write_vs_read", "converted_cells")
# What each E6 control has had since the engine specs declare what it exercises (EngineSpec.control_scopes).
CONTROL_SCOPE_KEYS = ("engine", "exercises", "does_not")


def read_summary(root: Path, report: Report) -> dict | None:
    path = root / SUMMARY
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        report.faults.append(Fault(SUMMARY, f"not valid JSON ({error})", REWRITE_SUMMARY))
        return None


def verify_produced(root: Path, summary: dict | None, documents: bool, report: Report) -> None:
    """Every file that something present was computed from is there (the rule is in the module docstring)."""

    def present(*names: str) -> list[str]:
        return [name for name in names if (root / name).is_file()]

    evidence = {
        TRAJECTORIES: present(COMPARISONS, SUMMARY),
        COMPARISONS: present(SUMMARY),
        TRANSPLANTS: ["summary.json (its E5 figures)"] if summary and "E5" in summary else [],
        FACTORS: ["summary.json (its E6 figures)"] if summary and "E6" in summary else [],
        SERVED: ["summary.json (its served figures)"] if summary and "served" in summary else [],
    }
    if documents:
        evidence[AUDIT] = present(E4)
        evidence[SUMMARY] = present(*CARDS)
    for relative, found in evidence.items():
        if found and not (root / relative).is_file():
            fix = (
                "rerun snakemake --cores N --config mode=audit"
                if relative == AUDIT
                else "rerun snakemake (it rebuilds what is missing)"
            )
            report.faults.append(Fault(relative, f"missing, though {found[0]} was computed from it", fix))


def _path_text(path: tuple) -> str:
    return path_text(path) or "(the whole file)"


def _value_text(data, path: tuple) -> str:
    missing = object()
    data = value_at(data, path, missing)
    if data is missing:
        return "absent"
    text = json.dumps(data)
    return text if len(text) <= 60 else text[:57] + "..."


def verify_summary(summary: dict | None, tables: dict[str, pa.Table], report: Report) -> None:
    """summary.json equals the figures recomputed from the gathered tables."""
    from stagereplay.report.summary import summary as compute_summary

    needed = (COMPARISONS, TRAJECTORIES)
    if summary is None or not all(name in tables for name in needed):
        return  # missing or unreadable: already a fault
    transplants = tables.get(TRANSPLANTS) if "E5" in summary else None
    if "E5" in summary and transplants is None:
        return  # the transplant table is missing or unreadable: already a fault
    factors = tables.get(FACTORS) if "E6" in summary else None
    if "E6" in summary and factors is None:
        return  # the factor table is missing or unreadable: already a fault
    served = tables.get(SERVED) if "served" in summary else None
    if "served" in summary and served is None:
        return  # the served table is missing or unreadable: already a fault
    if counts_e6_one_sided(summary):
        # Every E6 level would differ from the recomputed one: one line with the cause, not the first key.
        report.faults.append(
            Fault(
                SUMMARY,
                "its E6 levels are in the shape written before the verdicts were served first (no cell patterns,"
                " no verdict latent): they count an item write, read or both whenever a one-sided cell differs,"
                " even where the served suffix does not",
                MIGRATE_SUMMARY,
            )
        )
        return
    if controls_without_scope(summary):
        report.faults.append(
            Fault(
                SUMMARY,
                "its E6 controls do not say what each exercises and what it does not (written before the engine"
                " specs declared their controls' scope)",
                MIGRATE_SUMMARY,
            )
        )
        return
    recomputed = compute_summary(
        comparisons=tables[COMPARISONS],
        trajectories=tables[TRAJECTORIES],
        version=summary.get("stagereplay_version"),
        transplants=transplants,
        factors=factors,
        served=served,
    )
    _compare_figures(SUMMARY, summary, json.loads(json.dumps(recomputed)), "the tables", REWRITE_SUMMARY, report)


def counts_e6_one_sided(summary: dict) -> bool:
    """Whether summary.json's E6 is in the old shape: a level that ran lacks the served cell, the patterns of
    differing cells, the exact test of the sides, or the verdict latent."""
    e6 = summary.get("E6")
    levels = e6.get("levels") if isinstance(e6, dict) else None
    return any(
        isinstance(level, dict)
        and level.get("applicable")
        and (any(key not in level for key in SERVED_FIRST_KEYS) or "latent" not in (level.get("verdicts") or {}))
        for level in (levels if isinstance(levels, list) else [])
    )


def controls_without_scope(summary: dict) -> bool:
    """Whether a control of summary.json's E6 lacks what it exercises and does not (its engine's control scope)."""
    e6 = summary.get("E6")
    controls = e6.get("controls") if isinstance(e6, dict) else None
    levels = controls.get("levels") if isinstance(controls, dict) else None
    return any(
        isinstance(control, dict) and any(key not in control for key in CONTROL_SCOPE_KEYS)
        for control in (levels if isinstance(levels, list) else [])
    )


def _compare_figures(where: str, saved: dict, recomputed: dict, source: str, fix: str, report: Report) -> None:
    path = first_difference(saved, recomputed)
    if path is not None:
        report.faults.append(
            Fault(
                where,
                f"{_path_text(path)} is {_value_text(saved, path)}, but {source} give"
                f" {_value_text(recomputed, path)} (edited, or not rewritten when {source} changed)",
                fix,
            )
        )


REWRITE_E4 = "rerun snakemake --cores N --config mode=audit --forcerun audit_ledger to rewrite it from the audit table"


def verify_e4(root: Path, tables: dict[str, pa.Table], report: Report) -> None:
    """audit/e4.json equals the E4 figures recomputed from tables/audit.parquet."""
    from stagereplay.audit.reproduction import e4_summary, e4_summary_of

    path = root / E4
    if not path.is_file() or AUDIT not in tables:
        return  # no audit yet, or its table is missing or unreadable: already a fault
    try:
        saved = e4_summary_of(json.loads(path.read_bytes()))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        report.faults.append(Fault(E4, f"not valid JSON ({error})", REWRITE_E4))
        return
    recomputed = e4_summary(tables[AUDIT].to_pylist(), saved.get("audit_runtime"))
    _compare_figures(E4, saved, json.loads(json.dumps(recomputed)), "the audit table's rows", REWRITE_E4, report)


def verify_cards(root: Path, report: Report) -> None:
    """Each results card carries the stamp of the summary.json it was drawn from, and is unedited."""
    if not (root / SUMMARY).is_file():
        return
    source = (root / SUMMARY).read_bytes()
    for relative in CARDS:
        path = root / relative
        if not path.is_file():
            continue
        try:
            problem = stamp_problem(path.read_text(encoding="utf-8"), source)
        except UnicodeDecodeError:
            problem = "not UTF-8 text (overwritten) — rerun snakemake --forcerun report to redraw it"
        if problem:
            what, _, fix = problem.partition(" — ")
            report.faults.append(Fault(relative, what, fix or RERUN))


def peek_summary(root: Path) -> dict | None:
    """summary.json for what it says was computed (E5), when its own checks are left out."""
    try:
        return json.loads((root / SUMMARY).read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
