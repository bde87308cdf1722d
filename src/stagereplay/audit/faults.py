"""One problem verify found (where, what, and the fix), and what a verify run checked and found (``Report``)."""

from __future__ import annotations

from dataclasses import dataclass, field

RERUN = "delete it and rerun snakemake (the workflow rebuilds what is missing)"


@dataclass(frozen=True)
class Fault:
    where: str
    problem: str
    fix: str = RERUN

    def __str__(self) -> str:
        return f"{self.where}: {self.problem} — {self.fix}"


@dataclass
class Report:
    faults: list[Fault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was not checked in full, and why: one line each
    objects: int = 0
    tables: int = 0
    rows: int = 0
    leftover_temporaries: int = 0

    def summary_line(self) -> str:
        checked = f"{self.objects} objects, {self.tables} tables, {self.rows} rows checked"
        leftovers = (
            f"; {self.leftover_temporaries} leftover temporary files of interrupted writes (harmless)"
            if self.leftover_temporaries
            else ""
        )
        if self.faults:
            return f"verify: {len(self.faults)} fault(s) — {checked}{leftovers}"
        return f"verify: ledger OK — {checked}{leftovers}"
