"""E6 per item: each item's cells for each factor level, which of them differ, their verdict, the first read
of the reference cache under the level, and where each cell's suffix parts from the reference's, with the
top-1 minus top-2 margins there.

Read from the ledger tables (the factor rows, the E2 prefill rows they start from) and the checkpoint's
vocabulary table; the pattern and the verdict are summary.item_outcomes', so the per-item view and the counts
agree.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from stagereplay.design.cells import CELL_LABELS
from stagereplay.report.factor_summary import item_outcomes, level_label
from stagereplay.report.item_view import spell, visible

COLUMNS = [
    "Item",
    "Factor level",
    "Cells that differ",
    "Verdict",
    "Built cache",
    "First read",
    "test-ref (write)",
    "ref-test (read)",
    "test-test",
]
CELL_COLUMNS = 6  # the columns from here on are the cells, in CELL_LABELS' order


def part_text(tokens: list[int], reference: list[int], vocabulary: dict[int, str]) -> str:
    """Where a cell's suffix parts from the reference's: the step and the two tokens, spelled."""
    if tokens == reference:
        return "as the reference"
    step = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))

    def token_at(token_ids: list[int]) -> str:
        return f"'{visible(spell(vocabulary, [token_ids[step]])[0])}'" if step < len(token_ids) else "(ended)"

    return f"parts at step {step}: {token_at(reference)} → {token_at(tokens)}"


def margin_text(row: dict) -> str:
    """The top-1 minus top-2 logit margins at a cell's first divergent step (none recorded: nothing)."""
    if row["reference_margin_at_divergence"] is None or row["margin_at_divergence"] is None:
        return ""
    return f" (margin: reference {row['reference_margin_at_divergence']:.3g}, cell {row['margin_at_divergence']:.3g})"


def first_read_text(read: dict | None) -> str:
    """ref-test's first logits (the reference cache read under the level) against the reference's."""
    if read is None or read["first_logits_identical"] is None:
        return "—"
    if read["first_logits_identical"]:
        return "logits bit-identical"
    argmax = "argmax the same" if read["first_argmax_same"] else "argmax differs"
    converted = "; cache converted for the read" if read["converted_digest"] is not None else ""
    return f"max |Δlogit| {read['first_logits_max_abs']:.3g}, {argmax}{converted}"


def factor_item_rows(
    factors: pa.Table, trajectories: pa.Table, vocabularies: dict[str, dict[int, str]]
) -> list[list[str]]:
    """One row per item and factor level that ran (per run, under load): which cells differ, its verdict, its built
    cache against the reference, and each cell's suffix against the reference suffix (a cell the factor does not
    have is marked —)."""
    reference_tokens = {row["suffix_object"]: list(row["suffix_tokens"]) for row in trajectories.to_pylist()}
    levels: dict[tuple, list[dict]] = {}
    for row in factors.to_pylist():
        if row["applicable"]:
            levels.setdefault((row["factor"], row["level"], row["run"]), []).append(row)
    runs = Counter((factor, level) for factor, level, _ in levels)
    rows = []
    for (factor, level, run), level_rows in levels.items():
        outcomes = item_outcomes(level_rows)
        by_item: dict[str, dict[str, dict]] = {}
        for row in level_rows:
            by_item.setdefault(row["item_id"], {})[row["cell"]] = row
        for item_id, cells in sorted(by_item.items()):
            built = cells.get("test-ref") or cells["test-test"]  # test-test alone: a server-only factor
            vocabulary = vocabularies.get(built["checkpoint"], {})
            reference = reference_tokens.get(built["reference_suffix"], [])
            cache = (
                f"differs from layer {built['first_differing_layer']} (max |Δ| {max(built['layer_max_abs']):.3g})"
                if built["cache_differs"]
                else "same bytes as the reference"
            )
            if built["reused_tokens"] is not None:
                cache += f"; {built['reused_tokens']} positions reused"
            parts = [
                part_text(list(cells[cell]["suffix_tokens"]), reference, vocabulary) + margin_text(cells[cell])
                if cell in cells
                else "—"
                for cell in CELL_LABELS
            ]
            outcome = outcomes[item_id]
            first = first_read_text(cells.get("ref-test"))
            name = level_label({"factor": factor, "level": level, "run": run}, runs[factor, level])
            rows.append([item_id, name, outcome.pattern, outcome.verdict, cache, first, *parts])
    return rows


def factor_item_blocks(rows: list[list[str]]) -> list[tuple]:
    if not rows:
        return []
    return [
        ("heading", 2, "Per item: E6 cells against the reference"),
        (
            "details",
            f"E6: {len(rows)} item × level rows",
            [("table", COLUMNS, rows)],
        ),
    ]


def ledger_factor_text(root: str | Path, item_id: str) -> str | None:
    """``stagereplay show``: the item's E6 rows as text, or None when the ledger has no E6."""
    from stagereplay.ledger.layout import LedgerLayout
    from stagereplay.ledger.tables import FACTOR_SCHEMA, TRAJECTORY_SCHEMA, read_table
    from stagereplay.report.item_view import read_vocabularies

    ledger = LedgerLayout(root)
    if not Path(ledger.table("factors")).is_file():
        return None
    factors = read_table(ledger.table("factors"), FACTOR_SCHEMA)
    factors = factors.filter(pa.compute.equal(factors.column("item_id"), item_id))
    checkpoints = sorted(set(factors.column("checkpoint").to_pylist()))
    vocabularies = read_vocabularies({name: ledger.vocab(name) for name in checkpoints})
    rows = factor_item_rows(factors, read_table(ledger.table("trajectories"), TRAJECTORY_SCHEMA), vocabularies)
    lines = [
        f"E6 factors (item {item_id}): verdict; the cells whose suffix differs; built cache; first read; each"
        " cell's suffix against the reference, with the margins where it parts"
    ]
    for _, level, pattern, verdict, cache, first, *cells in rows:
        lines.append(f"  {level}: {verdict}; cells that differ: {pattern}; built cache: {cache}; first read: {first}")
        lines += [f"    {cell}: {text}" for cell, text in zip(COLUMNS[CELL_COLUMNS:], cells) if text != "—"]
    return "\n".join(lines)
