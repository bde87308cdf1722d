"""The experiment's names and choices, checked when snakemake parses the workflow.

Nothing here imports torch or transformers: a typo in a construction name, a
layer out of range or a sample too large fails in the first second of a dry
run, and `snakemake -n` stays fast.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_CONSTRUCTION = re.compile(r"^(live|prefill|incremental|chunked:(\d+))$")


class ConstructionError(ValueError):
    """One-line message naming the problem and the fix."""


def parse_construction(name: str) -> tuple[str, int | None]:
    """('chunked', 16) for 'chunked:16'; ('prefill', None) for 'prefill'."""
    match = _CONSTRUCTION.match(name)
    if match is None:
        raise ConstructionError(
            f"unknown construction {name!r} — use live, prefill, incremental or chunked:N with N a positive integer"
        )
    if match.group(2) is not None:
        size = int(match.group(2))
        if size < 1:
            raise ConstructionError(f"construction {name!r} has chunk size 0 — use chunked:N with N >= 1")
        return "chunked", size
    return name, None


class TransplantError(ValueError):
    """One-line message naming the problem and the fix."""


@dataclass(frozen=True)
class SweepPlan:
    """Which subsets to try beyond all layers (the paper's test)."""

    single_layers: str | list[int] = "all"  # "all", "none" or explicit layer indices
    block_sizes: tuple[int, ...] = ()  # leading and trailing blocks of these sizes
    kv_only: bool = True  # K only and V only, all layers
    windows: tuple[int, ...] = ()  # last-W positions, all layers


def check_plan(plan: SweepPlan, num_layers: int) -> None:
    """Layer choices must fit the model: checked before any transplant runs."""
    singles = plan.single_layers if isinstance(plan.single_layers, list) else []
    bad = [layer for layer in singles if not 0 <= layer < num_layers]
    if bad:
        raise TransplantError(
            f"transplant.sweep.single_layers: layer {bad[0]} out of range for a {num_layers}-layer model — use layers 0..{num_layers - 1}"
        )
    too_big = [size for size in plan.block_sizes if size > num_layers]
    if too_big:
        raise TransplantError(
            f"transplant.sweep.block_sizes: block of {too_big[0]} layers exceeds the model's {num_layers} — use sizes up to {num_layers}"
        )


def outcome_blind_sample(item_ids: list[str], size: int, seed: int) -> list[str]:
    """A seeded sample of item ids, fixed before any outcome exists (sorted for stable output)."""
    if size > len(item_ids):
        raise ValueError(
            f"outcome-blind sample of {size} items is larger than the {len(item_ids)} items of the run — lower transplant.outcome_blind.sample"
        )
    return sorted(random.Random(f"outcome-blind:{seed}").sample(sorted(item_ids), size))


def parse_layers(text: str) -> str | list[int]:
    """'all', 'none' or a comma-separated list of layer indices."""
    if text in ("all", "none"):
        return text
    return [int(part) for part in text.split(",") if part.strip()]
