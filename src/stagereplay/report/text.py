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
