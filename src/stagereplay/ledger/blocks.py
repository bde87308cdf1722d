"""A cache part stored as quantized blocks, read as values and written back: ggml's block formats through the
gguf package's reference codec, with llama.cpp's Hadamard rotation undone or applied (``BlockFormat`` names the
format; ``KVState`` holds the raw blocks)."""

from __future__ import annotations

import functools

import numpy as np
import scipy.linalg
import torch
from gguf import quants as gguf_quants

from stagereplay.ledger.block_format import BlockFormat, ggml_type
from stagereplay.ledger.kvstate import KVState


def numeric(state: KVState) -> KVState:
    """The cache as values: parts in blocks dequantized (and un-rotated) to float32; plain parts as they are."""
    if not any(state.formats):
        return state

    def part(tensors, block_format):
        if not block_format:
            return tensors
        parsed = BlockFormat.parse(block_format)
        return tuple(values_of(tensor, parsed) for tensor in tensors)

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
    values = gguf_quants.dequantize(raw.contiguous().numpy(), ggml_type(block_format.cache_type))
    if block_format.rotation:
        values = _rotate(values, block_format.rotation)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def blocks_of(values: torch.Tensor, block_format: BlockFormat) -> torch.Tensor:
    """Offline quantization: values [.., head_dim] rotated as llama.cpp would, then quantized by gguf's
    reference quantizer into raw blocks [.., blocks x block bytes]."""
    array = values.detach().cpu().float().numpy()
    if block_format.rotation:
        array = _rotate(array, block_format.rotation).astype(np.float32)
    return torch.from_numpy(gguf_quants.quantize(np.ascontiguousarray(array), ggml_type(block_format.cache_type)))
