"""A boundary cache as the ledger stores, fingerprints and compares it: per-layer K and V tensors.

Every engine exports its cache as a ``KVState`` and imports one back; nothing above the engines
sees an engine's own cache class. A part is either plain values (float tensors) or, for a quantized
llama.cpp cache, the raw blocks llama.cpp stored (``key_format`` / ``value_format`` name them; see
below): fingerprints and stored objects are then of those bytes, and ``numeric`` gives values.

A quantized K or V part is kept as its raw ggml blocks, uint8 [batch, kv_heads, positions, blocks x
block bytes], so that a fingerprint is of the bytes llama.cpp stored and a state written back is
byte-identical. Its values come from the ``gguf`` package's dequantizer (the reference Python port of
ggml's block formats). The pinned llama.cpp rotates a quantized part before it stores it: each run of
``n`` head values is multiplied by the orthonormal n-point Walsh-Hadamard matrix (and the queries with
it, so attention scores are unchanged); that matrix is its own inverse, so the stored values are
un-rotated by applying it once more, here in float64, then rounded to float32. ``numeric`` therefore
gives the cached K and V in the model's own basis, as a float16 cache would hold them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


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

    def to(self, device: torch.device | str) -> KVState:
        """The same state on ``device``, dtypes and bytes unchanged; a tensor already there is kept, not copied."""
        return self.replace((key.to(device) for key in self.keys), (value.to(device) for value in self.values))

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


def to_host(state: KVState) -> KVState:
    """Copy to CPU for saving; a no-op for CPU tensors."""
    return state.to("cpu")
