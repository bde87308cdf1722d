"""E5: swap boundary caches between constructions and see whose continuation follows.

A transplant replaces part of the recipient's boundary cache (layers, K and/or
V, all or the last W positions) with the donor's, then continues exactly as
the recipient would have: same model, precision and pending token. The
continuation follows the donor when it reproduces the donor's suffix token for
token, the recipient when it reproduces the recipient's, and neither otherwise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .cache import KV_PARTS, TransplantSpec
from .compare import first_divergence


@dataclass(frozen=True)
class SweepPlan:
    """Which subsets to try beyond all layers (the paper's test)."""

    single_layers: str | list[int] = "all"  # "all", "none" or explicit layer indices
    block_sizes: tuple[int, ...] = ()  # leading and trailing blocks of these sizes
    kv_only: bool = True  # K only and V only, all layers
    windows: tuple[int, ...] = ()  # last-W positions, all layers


def sweep_specs(num_layers: int, plan: SweepPlan) -> list[TransplantSpec]:
    every = tuple(range(num_layers))
    specs = [TransplantSpec(every)]
    singles = every if plan.single_layers == "all" else () if plan.single_layers == "none" else plan.single_layers
    specs += [TransplantSpec((layer,)) for layer in singles]
    for size in plan.block_sizes:
        specs += [TransplantSpec(every[:size]), TransplantSpec(every[num_layers - size:])]
    if plan.kv_only:
        specs += [TransplantSpec(every, part) for part in KV_PARTS if part != "kv"]
    specs += [TransplantSpec(every, "kv", window) for window in plan.windows]
    unique: dict[str, TransplantSpec] = {}
    for spec in specs:
        unique.setdefault(spec.label(), spec)
    return list(unique.values())


def check_plan(plan: SweepPlan, num_layers: int) -> None:
    """Layer choices must fit the model: checked before any transplant runs."""
    from .cache import TransplantError

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


def outcome(suffix: list[int], donor: list[int], recipient: list[int]) -> str:
    if suffix == donor:
        return "follows_donor"
    if suffix == recipient:
        return "follows_recipient"
    return "neither"


def left_both(donor: list[int], recipient: list[int]):
    """A stop test: once a continuation differs from both suffixes, it can follow neither."""

    def stop(tokens: list[int]) -> bool:
        return first_divergence(tokens, donor[: len(tokens)]) is not None and first_divergence(
            tokens, recipient[: len(tokens)]
        ) is not None

    return stop


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


def select_divergent(live_rows: list[dict], prefill_rows: list[dict], first_k: int | None) -> list[str]:
    """Items whose E1 live and prefill suffixes differ, by item id; the first K if given."""
    prefill = {row["item_id"]: row["suffix_object"] for row in prefill_rows}
    divergent = sorted(row["item_id"] for row in live_rows if prefill.get(row["item_id"]) not in (None, row["suffix_object"]))
    return divergent if first_k is None else divergent[:first_k]
