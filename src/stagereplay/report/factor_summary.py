"""From the factor table to E6's figures in summary.json: per level, its caches and served suffixes, each item's
verdict and the sides that differ, runs under load, the sides compared across levels (corrected for the family),
and the A/A controls. Every x/N with its Wilson interval, as ``report.summary`` computes E1-E3's."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import pyarrow as pa

from stagereplay.design.cells import (
    CELL_LABELS,
    FULL,
    READ,
    SERVED_VERDICTS,
    VERDICTS,
    WRITE,
    cell_label,
    differing_cells,
    item_verdict,
    pattern_name,
)
from stagereplay.design.factors import factor_named, is_control
from stagereplay.engines.registry import DEFAULT_ENGINE, SPECS
from stagereplay.report.margins import bf16_logits, e6_flip_margins, first_read_figures
from stagereplay.report.stats import (
    MCNEMAR,
    grouped,
    mcnemar_exact,
    share,
)
from stagereplay.report.text import level_name

WRITE_LABEL, READ_LABEL = cell_label(WRITE), cell_label(READ)


@dataclass(frozen=True)
class ItemOutcome:
    """One item of one factor level: which cells' suffixes differ from the reference's, its verdict, and which
    one-sided cells continue exactly as the served cell does."""

    pattern: str  # design.factors.pattern_name: "none", "test-ref+test-test", ...
    verdict: str  # design.cells.item_verdict
    # The one-sided cells (test-ref, ref-test) whose suffix is the served cell's (test-test): a write verdict
    # says the write cell differs from the reference, not that the served continuation is the write cell's.
    served_equals: tuple[str, ...]


def item_outcomes(rows: list[dict]) -> dict[str, ItemOutcome]:
    """Each item's E6 pattern and verdict (design.factors) from the rows of one factor level. Suffixes are
    compared by their object ids: a token list's id is its content's hash, so equal ids mean equal tokens."""
    by_item: dict[str, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        if row["applicable"]:
            by_item[row["item_id"]][row["cell"]] = row
    outcomes = {}
    for item_id, cells in sorted(by_item.items()):
        first = next(iter(cells.values()))
        reference = first["reference_suffix"]
        suffixes = [cells[label]["suffix_object"] if label in cells else None for label in CELL_LABELS]
        try:
            verdict = item_verdict(reference, *suffixes)
        except ValueError as error:
            raise ValueError(f"E6 {first['factor']} {first['level']}, item {item_id}: {error}") from None
        served = suffixes[-1]
        equals = tuple(
            label
            for label, one_sided in zip(CELL_LABELS[:2], suffixes[:2])
            if served is not None and one_sided == served
        )
        outcomes[item_id] = ItemOutcome(pattern_name(differing_cells(reference, *suffixes)), verdict, equals)
    return outcomes


def write_vs_read(outcomes: list[ItemOutcome]) -> dict:
    """Write side against read side, over the items whose served suffix differs: each such item's write cell
    (test-ref) and read cell (ref-test) differ or not, so the two are paired, and the exact McNemar test asks
    whether write-only items (verdict write) and read-only ones (read) are equally likely. Items where both or
    neither one-sided cell differs say nothing on that question: with no write-only or read-only item there is
    nothing to compare, and no p-value (a p of 1 would enter a correction as a test that was run)."""
    served = [outcome.pattern.split("+") for outcome in outcomes if outcome.verdict in SERVED_VERDICTS]
    write_only, read_only, p_value = (
        mcnemar_exact([WRITE_LABEL in cells for cells in served], [READ_LABEL in cells for cells in served])
        if served
        else (0, 0, None)
    )
    return {
        "items": len(served),
        "write_only": write_only,
        "read_only": read_only,
        "p_value": p_value if write_only + read_only else None,
        "test": MCNEMAR,
    }


def sides_comparable(caches_differ: dict, converted_cells: bool) -> bool:
    """Whether a full-2x2 level's write and read sides can be compared at all. Not where every built cache has
    the reference's bytes (batch same:B): test-ref is then the reference computation, so the write side is empty
    by construction and a test of it against the read side would only restate that. Not where the one-sided
    cells read converted caches (cache_type): each then measures a conversion, not a side."""
    return caches_differ["count"] > 0 and not converted_cells


def served_equals_side(outcomes: list[ItemOutcome]) -> dict:
    """Among the write items, those whose served suffix is the write cell's (S_tr = S_tt), x/N; among the read
    items, those whose served suffix is the read cell's (S_rt = S_tt). A verdict says which one-sided cell
    differs from the reference; only this says whether the served continuation is that cell's."""
    return {
        verdict: share(
            sum(label in outcome.served_equals for outcome in outcomes if outcome.verdict == verdict),
            sum(outcome.verdict == verdict for outcome in outcomes),
        )
        for verdict, label in (("write", WRITE_LABEL), ("read", READ_LABEL))
    }


def level_label(row: dict, runs: int = 1) -> str:
    """How the card names a factor level, or one run of a level under load: 'batch 2', 'batch 2 run 1/3'."""
    run = row.get("run")
    return f"{row['factor']} {row['level']}" + (f" run {run + 1}/{runs}" if run is not None else "")


def by_run(rows: list[dict]) -> dict[int | None, list[dict]]:
    """A level's rows by run: one group (None) where its input is pinned, one per run under load."""
    runs: dict[int | None, list[dict]] = defaultdict(list)
    for row in rows:
        runs[row.get("run")].append(row)
    return dict(sorted(runs.items(), key=lambda entry: -1 if entry[0] is None else entry[0]))


def e6_level(rows: list[dict], runs: int = 1) -> dict:
    """One factor level, or one run of a level under load (``runs`` of them): caches differ x/N (from which
    layer), suffixes differ x/N as a server runs it (the served cell: (t, t); (t, r) for a build-only factor),
    each pattern of differing cells x/N, and every verdict x/N, each with its Wilson bounds."""
    first = rows[0]
    factor = first["factor"]
    applicable = [row for row in rows if row["applicable"]]
    figures = {
        "factor": factor,
        "level": first["level"],
        "run": first.get("run"),
        "label": level_label(first, runs),
        "reference_level": first["reference_level"],
        # The cells computed (a cell that cannot be built honestly has its rows, not applicable, and is not listed).
        "cells": sorted({row["cell"] for row in (applicable or rows)}),
        "applicable": bool(applicable),
        "reason": None if applicable else first["reason"],
    }
    if not applicable:
        return figures
    # Every factor has one test-built cell per item: (t, r), or (t, t) alone for a server-only factor.
    of = factor_named(factor)
    built = [row for row in applicable if row["cell"] == cell_label(of.cells[0])]
    served = [row for row in applicable if row["cell"] == cell_label(of.served_cell)]
    differing_layers = [row["first_differing_layer"] for row in built if row["cache_differs"]]
    outcomes = item_outcomes(applicable).values()
    patterns = Counter(outcome.pattern for outcome in outcomes)
    verdicts = Counter(outcome.verdict for outcome in outcomes)
    n = len(built)
    caches_differ = share(len(differing_layers), n)
    # cache_type: each one-sided cell reads a cache converted to the other type, so its verdicts name the cells
    # that differ, not a side.
    converted = any(row["converted_digest"] is not None for row in applicable)
    full = of.cells == FULL
    figures.update(
        {
            "items": n,
            "caches_differ": caches_differ,
            "first_differing_layer": min(differing_layers) if differing_layers else None,
            "max_abs_difference": max((max(row["layer_max_abs"], default=0.0) for row in built), default=0.0),
            "served_cell": cell_label(of.served_cell),
            "suffixes_differ": share(sum(row["suffix_object"] != row["reference_suffix"] for row in served), n),
            # Exactly these cells' suffixes differ from the reference's, the level's other cells' do not.
            "differing_cells": {pattern: share(patterns[pattern], n) for pattern in of.patterns},
            "verdicts": {name: share(verdicts[name], n) for name in VERDICTS},
            "converted_cells": converted,
            "served_equals_side": served_equals_side(list(outcomes)) if full else None,
            "write_vs_read": write_vs_read(list(outcomes))
            if full and sides_comparable(caches_differ, converted)
            else None,
            "flip_margins": e6_flip_margins(served, bf16_logits(SPECS.get(first["engine"]), first["precision"])),
            "first_read": first_read_figures(applicable, of.cells),
        }
    )
    reused = [row["reused_tokens"] for row in built if row["reused_tokens"] is not None]
    if reused:
        figures["reused_tokens"] = {"min": min(reused), "max": max(reused)}
    return figures


def e6_summary(factors: pa.Table) -> dict:
    rows = factors.to_pylist()
    levels = grouped(rows, lambda r: f"{r['checkpoint']}/{r['precision']}/{r['factor']}/{r['level']}")
    first = rows[0] if rows else {}
    figures = [
        e6_level(group, len(runs))
        for level_rows in levels.values()
        for runs in [by_run(level_rows)]
        for group in runs.values()
    ]
    return {
        "name": "factors",
        "checkpoint": first.get("checkpoint"),
        "precision": first.get("precision"),
        "reference": "E2's prefill row at this precision (the (ref, ref) cell)",
        "levels": figures,
        "under_load": [
            load_runs_figures(level_rows) for level_rows in levels.values() if None not in by_run(level_rows)
        ],
        "sides_compared": sides_correction(figures),
    }


def load_runs_figures(rows: list[dict]) -> dict:
    """A level under load over its runs: per item, in how many runs its served suffix (and its built cache)
    differs from the reference's; the items that differ in every run, those that differ in some runs and not
    in others (unstable under load), and those that differ in none, x/N."""
    first = rows[0]
    of = factor_named(first["factor"])
    runs = by_run([row for row in rows if row["applicable"]])
    served: dict[str, int] = Counter()
    caches: dict[str, int] = Counter()
    items: set[str] = set()
    for run_rows in runs.values():
        for row in run_rows:
            items.add(row["item_id"])
            if row["cell"] == cell_label(of.served_cell):
                served[row["item_id"]] += row["suffix_object"] != row["reference_suffix"]
            if row["cell"] == cell_label(of.cells[0]):
                caches[row["item_id"]] += row["cache_differs"]
    n, r = len(items), len(runs)
    return {
        "factor": first["factor"],
        "level": first["level"],
        "label": level_label({**first, "run": None}),
        "runs": r,
        "items": n,
        "served_differs_in": {str(k): sum(served[item] == k for item in items) for k in range(r + 1)},
        "every_run": share(sum(served[item] == r for item in items), n),
        "unstable": share(sum(0 < served[item] < r for item in items), n),
        "unstable_items": sorted(item for item in items if 0 < served[item] < r),
        "no_run": share(sum(served[item] == 0 for item in items), n),
        "cache_unstable": share(sum(0 < caches[item] < r for item in items), n),
    }


FAMILY_ALPHA = 0.05


def sides_correction(levels: list[dict]) -> dict:
    """The write-against-read tests of the test levels as one family, Bonferroni-corrected: each level's p-value
    is uncorrected, and with several levels one of them falls below 0.05 by chance more often than 5% of the
    time. Only the levels that have a test count (write_vs_read with a p-value: not a control, not a level
    whose sides cannot be compared, not one without a write-only or read-only item); ``survive`` names those
    whose p-value is below alpha / tests."""
    tested = [
        level
        for level in levels
        if level["applicable"]
        and not is_control(level["factor"], level["level"], level["reference_level"])
        and (level.get("write_vs_read") or {}).get("p_value") is not None
    ]
    threshold = FAMILY_ALPHA / len(tested) if tested else None
    return {
        "method": "Bonferroni",
        "alpha": FAMILY_ALPHA,
        "tests": len(tested),
        "levels": [f"{level_name(level)}" for level in tested],
        "threshold": threshold,
        "survive": [f"{level_name(level)}" for level in tested if level["write_vs_read"]["p_value"] < threshold],
    }


# --- E6's A/A controls (report.controls checks them and draws their line) -----------------------------------


def e6_controls(rows: list[dict]) -> dict:
    """Per control level of the factor rows, whether every item reproduced the reference; and the factors
    that ran without a control (a ledger written before controls existed)."""
    levels: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        levels[(row["checkpoint"], row["precision"], row["factor"], row["level"])].append(row)
    controls = [
        control_figures(group)
        for _, group in sorted(levels.items())
        if is_control(group[0]["factor"], group[0]["level"], group[0]["reference_level"])
    ]
    return {
        "paths": len(controls),
        "identical": sum(control["identical"] for control in controls),
        "without_control": sorted({row["factor"] for row in rows} - {control["factor"] for control in controls}),
        "levels": controls,
    }


def control_figures(rows: list[dict]) -> dict:
    """One control level: the items whose built cache or any cell's suffix differs from the reference, whose
    verdict is not none, or that did not run at all; and, from the spec of the engine its rows name (a row
    that names none is the default engine's), what the control exercises and what it does not."""
    first = rows[0]
    engine = first.get("engine") or DEFAULT_ENGINE
    scope = SPECS[engine].control_scope(first["factor"]) if engine in SPECS else None
    applicable = [row for row in rows if row["applicable"]]
    items = sorted({row["item_id"] for row in rows})
    # Under load, every run of the control must reproduce the reference: an item counts if any run does not.
    outcomes = [item_outcomes(run_rows) for run_rows in by_run(applicable).values()]
    verdicts = {item: outcome.verdict for run in outcomes for item, outcome in run.items() if outcome.verdict != "none"}
    verdicts |= {item: "none" for run in outcomes for item in run if item not in verdicts}
    not_none = sorted(item for item, verdict in verdicts.items() if verdict != "none")
    caches = sorted(
        {
            row["item_id"]
            for row in applicable
            if row["build"] == "test" and row["cache_digest"] != row["reference_cache"]
        }
    )
    suffixes = sorted({row["item_id"] for row in applicable if row["suffix_object"] != row["reference_suffix"]})
    not_run = sorted(set(items) - set(verdicts))
    return {
        "factor": first["factor"],
        "level": first["level"],
        "runs": len(outcomes),
        "reference_level": first["reference_level"],
        "engine": engine,
        "exercises": scope.exercises if scope else None,
        "does_not": scope.does_not if scope else None,
        "items": len(items),
        "identical": bool(items) and not (caches or suffixes or not_none or not_run),
        "caches_differ": caches,
        "suffixes_differ": suffixes,
        "verdict_not_none": not_none,
        "not_run": not_run,
        "reason": next((row["reason"] for row in rows if not row["applicable"] and row["item_id"] in not_run), None),
    }
