"""How two boundary caches differ, layer by layer: max and mean |difference| and the fraction of bits that differ."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagereplay.ledger.blocks import numeric
from stagereplay.ledger.kvstate import KVState


@dataclass(frozen=True)
class LayerDifference:
    """How two caches differ in one layer's keys or values."""

    max_abs: float
    mean_abs: float
    fraction_differ: float  # of elements not bit-identical


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits as integers: -0.0 differs from 0.0 and NaN equals itself, as bytes do."""
    return tensor.contiguous().view(_SAME_WIDTH_INT[tensor.element_size()])


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> LayerDifference:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare cache tensors {a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}")
    # float64 holds every bf16/fp16/fp32 value and their differences exactly.
    delta = (a.double() - b.double()).abs()
    differ = _bits(a) != _bits(b)
    return LayerDifference(
        max_abs=float(delta.max()) if delta.numel() else 0.0,
        mean_abs=float(delta.mean()) if delta.numel() else 0.0,
        fraction_differ=float(differ.double().mean()) if differ.numel() else 0.0,
    )


def cache_difference(a: KVState, b: KVState) -> tuple[tuple[LayerDifference, ...], tuple[LayerDifference, ...]]:
    """Per-layer differences of keys and of values between two boundary caches."""
    if a.num_layers != b.num_layers:
        raise ValueError(f"cannot compare caches of {a.num_layers} and {b.num_layers} layers")
    plain_types = {(s.keys[0].dtype, s.values[0].dtype) for s in (a, b) if s.num_layers}
    if any(a.formats) or any(b.formats) or len(plain_types) > 1:
        # Raw blocks differ by what they encode, an fp16 and an fp32 cache by their width: compare the values
        # (float32 holds fp16 and dequantized values exactly).
        a, b = _float32(numeric(a)), _float32(numeric(b))
    return (
        tuple(tensor_difference(x, y) for x, y in zip(a.keys, b.keys)),
        tuple(tensor_difference(x, y) for x, y in zip(a.values, b.values)),
    )


def _float32(state: KVState) -> KVState:
    return state.replace((key.float() for key in state.keys), (value.float() for value in state.values))
