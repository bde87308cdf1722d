"""One problem verify found: where, what, and the fix."""

from __future__ import annotations

from dataclasses import dataclass

RERUN = "delete it and rerun snakemake (the workflow rebuilds what is missing)"


@dataclass(frozen=True)
class Fault:
    where: str
    problem: str
    fix: str = RERUN

    def __str__(self) -> str:
        return f"{self.where}: {self.problem} — {self.fix}"
