"""A boundary cache as the ledger stores, fingerprints and compares it: per-layer K and V tensors.

Every engine exports its cache as a ``KVState`` and imports one back; nothing above the engines
sees an engine's own cache class. A part is either plain values (float tensors) or, for a quantized
llama.cpp cache, the raw blocks llama.cpp stored (``key_format`` / ``value_format`` name them; see
``quantized``): fingerprints and stored objects are then of those bytes, and ``numeric`` gives values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from stagereplay.ledger.quantized import BlockFormat, values_of


@dataclass(frozen=True)
class KVState:
    """Per-layer keys and values, each shaped [batch, kv_heads, positions, head_dim] (or, for a part with a
    block format, [batch, kv_heads, positions, that many values' block bytes])."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    key_format: str = ""  # "": the tensors are values; else a BlockFormat name (q8_0-h64): raw blocks
    value_format: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_positions(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0

    @property
    def formats(self) -> tuple[str, str]:
        return self.key_format, self.value_format

    def replace(self, keys, values) -> KVState:
        """The same kind of cache (formats kept) holding other tensors."""
        return dataclasses.replace(self, keys=tuple(keys), values=tuple(values))

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Names sort into layer order (zero-padded), K before V; a part in blocks names its format."""
        key_suffix = f".{self.key_format}" if self.key_format else ""
        value_suffix = f".{self.value_format}" if self.value_format else ""
        named: dict[str, torch.Tensor] = {}
        for index, (key, value) in enumerate(zip(self.keys, self.values)):
            named[f"layer.{index:03d}.k{key_suffix}"] = key
            named[f"layer.{index:03d}.v{value_suffix}"] = value
        return named

    @classmethod
    def from_named_tensors(cls, named: dict[str, torch.Tensor]) -> KVState:
        parts: dict[tuple[str, str], torch.Tensor] = {}
        formats = {"k": set(), "v": set()}
        for name, tensor in named.items():
            _, layer, part, *block_format = name.split(".", 3)
            parts[layer, part] = tensor
            formats[part].add(block_format[0] if block_format else "")
        if len(formats["k"]) > 1 or len(formats["v"]) > 1:
            raise ValueError(f"a stored cache mixes block formats across layers ({formats}) — it was not written whole")
        layers = sorted({layer for layer, _ in parts})
        return cls(
            keys=tuple(parts[layer, "k"] for layer in layers),
            values=tuple(parts[layer, "v"] for layer in layers),
            key_format=formats["k"].pop() if formats["k"] else "",
            value_format=formats["v"].pop() if formats["v"] else "",
        )

    def numeric(self) -> KVState:
        """The cache as values: parts in blocks dequantized (and un-rotated) to float32; plain parts as they are."""
        if not any(self.formats):
            return self

        def part(tensors, block_format):
            if not block_format:
                return tensors
            parsed = BlockFormat.parse(block_format)
            return tuple(values_of(tensor, parsed) for tensor in tensors)

        return KVState(part(self.keys, self.key_format), part(self.values, self.value_format))


def to_host(state: KVState) -> KVState:
    """Copy to CPU for saving; a no-op for CPU tensors."""
    return state.replace((key.cpu() for key in state.keys), (value.cpu() for value in state.values))
