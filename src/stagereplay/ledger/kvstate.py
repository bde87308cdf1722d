"""A boundary cache as the ledger stores, fingerprints and compares it: plain per-layer K and V tensors.

Every engine exports its cache as a ``KVState`` and imports one back; nothing above the engines
sees an engine's own cache class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVState:
    """Per-layer keys and values, each shaped [batch, kv_heads, positions, head_dim]."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_positions(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Names sort into layer order (zero-padded), K before V."""
        named: dict[str, torch.Tensor] = {}
        for index, (key, value) in enumerate(zip(self.keys, self.values)):
            named[f"layer.{index:03d}.k"] = key
            named[f"layer.{index:03d}.v"] = value
        return named

    @classmethod
    def from_named_tensors(cls, named: dict[str, torch.Tensor]) -> KVState:
        layers = sorted({name.split(".")[1] for name in named})
        return cls(
            keys=tuple(named[f"layer.{layer}.k"] for layer in layers),
            values=tuple(named[f"layer.{layer}.v"] for layer in layers),
        )


def to_host(state: KVState) -> KVState:
    """Copy to CPU for saving; a no-op for CPU tensors."""
    return KVState(
        keys=tuple(key.cpu() for key in state.keys),
        values=tuple(value.cpu() for value in state.values),
    )
