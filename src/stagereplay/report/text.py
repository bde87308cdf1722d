"""Numbers and experiment names as the card, the reading and the plots write them."""

from __future__ import annotations


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def points(fraction: float) -> str:
    return f"{100 * fraction:+.1f}"


def experiment_name(experiment: str, precision: str | None, checkpoint: str, summary: dict) -> str:
    """'E1 matched (bf16)'; with several checkpoints, 'E1 matched (bf16, tiny-b)'."""
    where = ", ".join(part for part in (precision, checkpoint if len(summary["checkpoints"]) > 1 else None) if part)
    return f"{experiment} ({where})" if where else experiment


def under_load_text(spread: dict) -> str:
    """The runs under load against their saved spread, named as an expected spread, per level and cell (an e4.json
    written before the levels were kept gives its pooled figure)."""
    if "levels" not in spread:
        within = spread["within"]
        return (
            f"cells under load: {within['count']}/{within['n']} recomputed run artifacts within the spread of their"
            " saved runs (an expected spread, not a reproduction)"
        )
    levels = "; ".join(f"{name} {entry['count']}/{entry['n']}" for name, entry in spread["levels"].items())
    return (
        "cells under load, recomputed run artifacts within the spread of their saved runs (an expected spread, not a"
        f" reproduction), per level and cell: {levels}"
    )


def level_name(level: dict) -> str:
    """A factor level (or one run of a level under load) as summary.json names it; a summary written before
    runs were named has the factor and the level only."""
    return level.get("label") or f"{level['factor']} {level['level']}"


def wilson_text(counted: dict) -> str:
    """The Wilson interval of an x/N from summary.json, read for a count of 0 as an upper bound."""
    count, n = counted["count"], counted["n"]
    low, high = counted["wilson95"]
    if count == 0:
        return f"Wilson 95% upper bound {percent(high)}: consistent with none, and rates up to {percent(high)} are not ruled out by {n} items"
    return f"Wilson 95% [{percent(low)}, {percent(high)}]"
