"""E5: swap boundary caches between constructions and see whose continuation follows.

A transplant replaces part of the recipient's boundary cache (layers, K and/or
V, all or the last W positions) with the donor's, then continues exactly as
the recipient would have: same model, precision and pending token. The
continuation follows the donor when it reproduces the donor's suffix token for
token, the recipient when it reproduces the recipient's, and neither otherwise.
"""

from __future__ import annotations

from .cache import KV_PARTS, TransplantSpec
from .compare import first_divergence
from .plan import SweepPlan


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


def select_divergent(live_rows: list[dict], prefill_rows: list[dict], first_k: int | None) -> list[str]:
    """Items whose E1 live and prefill suffixes differ, by item id; the first K if given."""
    prefill = {row["item_id"]: row["suffix_object"] for row in prefill_rows}
    divergent = sorted(row["item_id"] for row in live_rows if prefill.get(row["item_id"]) not in (None, row["suffix_object"]))
    return divergent if first_k is None else divergent[:first_k]
