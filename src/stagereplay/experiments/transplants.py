"""E5: swap boundary caches between constructions and see whose continuation follows.

A transplant replaces part of the recipient's boundary cache (layers, K and/or
V, all or the last W positions) with the donor's, then continues exactly as
the recipient would have: same model, precision and pending token. The
continuation follows the donor when it reproduces the donor's suffix token for
token, the recipient when it reproduces the recipient's, and neither otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagereplay.design.divergence import first_divergence
from stagereplay.design.names import SweepPlan, TransplantError

if TYPE_CHECKING:  # only annotations: the selection job (select_divergent) runs without torch
    from stagereplay.ledger.kvstate import KVState

KV_PARTS = ("kv", "k", "v")


@dataclass(frozen=True)
class TransplantSpec:
    """Which part of the donor cache replaces the recipient's."""

    layers: tuple[int, ...]
    kv: str = "kv"  # "kv", "k" or "v"
    last_positions: int | None = None  # None: every position; W: the last W positions

    def label(self) -> str:
        layers = list(self.layers)
        contiguous = layers == list(range(layers[0], layers[-1] + 1)) if layers else False
        span = f"{layers[0]}-{layers[-1]}" if contiguous and len(layers) > 1 else ",".join(map(str, layers))
        positions = "all" if self.last_positions is None else f"last{self.last_positions}"
        return f"layers={span} kv={self.kv} positions={positions}"


def check_transplant(donor: KVState, recipient: KVState, spec: TransplantSpec) -> None:
    if donor.num_layers != recipient.num_layers or any(
        d.shape != r.shape for d, r in zip(donor.keys + donor.values, recipient.keys + recipient.values)
    ):
        raise TransplantError(
            "donor and recipient caches differ in layers or shapes (different models or prefixes) — transplant only between states of one checkpoint over one prefix"
        )
    if not spec.layers:
        raise TransplantError("empty layer set — name at least one layer to transplant")
    bad = [layer for layer in spec.layers if not 0 <= layer < recipient.num_layers]
    if bad:
        raise TransplantError(
            f"layer {bad[0]} out of range for a {recipient.num_layers}-layer cache — use layers 0..{recipient.num_layers - 1}"
        )
    if donor.formats != recipient.formats:
        raise TransplantError(
            f"donor and recipient caches are stored in different block formats ({donor.formats} and {recipient.formats}) — transplant only between caches of one cache type"
        )
    if spec.kv not in KV_PARTS:
        raise TransplantError(f"unknown cache part {spec.kv!r} — use kv, k or v")
    if spec.last_positions is not None and not 1 <= spec.last_positions <= recipient.num_positions:
        raise TransplantError(
            f"window of {spec.last_positions} positions does not fit a prefix of {recipient.num_positions} cached positions — use 1..{recipient.num_positions}"
        )


def transplant(donor: KVState, recipient: KVState, spec: TransplantSpec) -> KVState:
    """The recipient's cache with the chosen part replaced by the donor's (cast to the recipient's dtype)."""
    check_transplant(donor, recipient, spec)
    start = 0 if spec.last_positions is None else recipient.num_positions - spec.last_positions
    keys = [tensor.clone() for tensor in recipient.keys]
    values = [tensor.clone() for tensor in recipient.values]
    for layer in spec.layers:
        if "k" in spec.kv:
            keys[layer][..., start:, :] = donor.keys[layer][..., start:, :].to(keys[layer].dtype)
        if "v" in spec.kv:
            values[layer][..., start:, :] = donor.values[layer][..., start:, :].to(values[layer].dtype)
    return recipient.replace(keys, values)


def sweep_specs(num_layers: int, plan: SweepPlan) -> list[TransplantSpec]:
    every = tuple(range(num_layers))
    specs = [TransplantSpec(every)]
    singles = every if plan.single_layers == "all" else () if plan.single_layers == "none" else plan.single_layers
    specs += [TransplantSpec((layer,)) for layer in singles]
    for size in plan.block_sizes:
        specs += [TransplantSpec(every[:size]), TransplantSpec(every[num_layers - size :])]
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
        return (
            first_divergence(tokens, donor[: len(tokens)]) is not None
            and first_divergence(tokens, recipient[: len(tokens)]) is not None
        )

    return stop


def select_divergent(live_rows: list[dict], prefill_rows: list[dict], first_k: int | None) -> list[str]:
    """Items whose E1 live and prefill suffixes differ, by item id; the first K if given."""
    prefill = {row["item_id"]: row["suffix_object"] for row in prefill_rows}
    divergent = sorted(
        row["item_id"] for row in live_rows if prefill.get(row["item_id"]) not in (None, row["suffix_object"])
    )
    return divergent if first_k is None else divergent[:first_k]
