"""How a stored K or V part is read as values and written back: one codec per storage format behind one interface
(``PartCodec``), as a cache library has one class per cache kind. Plain values (fp16, fp32) are kept as they are;
each ggml block format (q8_0, q4_0; ``BlockFormat`` names it) is read and written by the gguf package's reference
codec of that type, with llama.cpp's Hadamard rotation undone or applied. ``KVState`` holds the raw parts."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import numpy as np
import scipy.linalg
import torch
from gguf import quants as gguf_quants

from stagereplay.ledger.block_format import BlockFormat, ggml_type
from stagereplay.ledger.kvstate import KVState


class PartCodec(ABC):
    """One storage format of a cache part: its values from the stored tensor, and the stored tensor of values."""

    @abstractmethod
    def values_of(self, stored: torch.Tensor) -> torch.Tensor:
        """The part's values [.., head_dim] (float32 for blocks; plain values as stored)."""

    @abstractmethod
    def stored_of(self, values: torch.Tensor) -> torch.Tensor:
        """The tensor this format stores for ``values`` [.., head_dim]."""


class PlainValues(PartCodec):
    """Values kept as values, in ``dtype`` (a cache of fp16 or fp32)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def values_of(self, stored):
        return stored

    def stored_of(self, values):
        return values.to(self.dtype)


class GgmlBlocks(PartCodec):
    """Raw ggml blocks [.., blocks x block bytes] of one block type, rotated first where the format says so:
    read by gguf's dequantizer and written by its reference quantizer (offline quantization)."""

    def __init__(self, block_format: BlockFormat):
        self.block_format = block_format
        self.type = ggml_type(block_format.cache_type)

    def values_of(self, stored):
        values = gguf_quants.dequantize(stored.contiguous().numpy(), self.type)
        if self.block_format.rotation:
            values = _rotate(values, self.block_format.rotation)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def stored_of(self, values):
        array = values.detach().cpu().float().numpy()
        if self.block_format.rotation:
            array = _rotate(array, self.block_format.rotation).astype(np.float32)
        return torch.from_numpy(gguf_quants.quantize(np.ascontiguousarray(array), self.type)).contiguous()


def part_codec(part_format: str, dtype: torch.dtype = torch.float32) -> PartCodec:
    """The codec of a part stored as ``part_format`` (a ``BlockFormat`` name, or "" for plain values in ``dtype``)."""
    return GgmlBlocks(BlockFormat.parse(part_format)) if part_format else PlainValues(dtype)


def numeric(state: KVState) -> KVState:
    """The cache as values: parts in blocks dequantized (and un-rotated) to float32; plain parts as they are."""
    if not any(state.formats):
        return state

    def part(tensors, part_format):
        codec = part_codec(part_format)
        return tuple(codec.values_of(tensor) for tensor in tensors)

    return KVState(part(state.keys, state.key_format), part(state.values, state.value_format))


@functools.cache
def hadamard(n: int) -> np.ndarray:
    """The orthonormal n-point Walsh-Hadamard matrix in Sylvester's order, as llama.cpp builds it."""
    return scipy.linalg.hadamard(n).astype(np.float64) / np.sqrt(n)


def _rotate(values: np.ndarray, n: int) -> np.ndarray:
    """Each run of n values along the last axis multiplied by the Hadamard matrix (symmetric: its own inverse)."""
    runs = values.astype(np.float64).reshape(*values.shape[:-1], -1, n)
    return (runs @ hadamard(n)).reshape(values.shape)


def values_of(raw: torch.Tensor, block_format: BlockFormat) -> torch.Tensor:
    """The float32 values [.., head_dim] of raw blocks [.., blocks x block bytes], un-rotated."""
    return GgmlBlocks(block_format).values_of(raw)


def blocks_of(values: torch.Tensor, block_format: BlockFormat) -> torch.Tensor:
    """Offline quantization: values [.., head_dim] rotated as llama.cpp would, then quantized by gguf's
    reference quantizer into raw blocks [.., blocks x block bytes]."""
    return GgmlBlocks(block_format).stored_of(values)
