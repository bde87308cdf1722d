"""Cache tensors kept as the blocks llama.cpp stored: their format, their values, and offline quantization.

A quantized K or V part is kept as its raw ggml blocks, uint8 [batch, kv_heads, positions, blocks x
block bytes], so that a fingerprint is of the bytes llama.cpp stored and a state written back is
byte-identical. Its values come from the ``gguf`` package's dequantizer (the reference Python port of
ggml's block formats). The pinned llama.cpp rotates a quantized part before it stores it: each run of
``n`` head values is multiplied by the orthonormal n-point Walsh-Hadamard matrix (and the queries with
it, so attention scores are unchanged); that matrix is its own inverse, so the stored values are
un-rotated by applying it once more, here in float64, then rounded to float32. ``values`` therefore
gives the cached K and V in the model's own basis, as a float16 cache would hold them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants


def _ggml_type(cache_type: str) -> GGMLQuantizationType:
    """The ggml block type of a cache type's name (q8_0 -> Q8_0), as the gguf package knows it."""
    return GGMLQuantizationType[cache_type.upper()]


@dataclass(frozen=True)
class BlockFormat:
    """How one quantized part is stored: its ggml block type and the rotation llama.cpp applied first."""

    cache_type: str  # "q8_0", "q4_0"
    rotation: int = 0  # 0: none; n: each run of n head values was multiplied by the n-point Hadamard matrix

    @property
    def name(self) -> str:
        """The format as the tensor name's suffix in a stored cache: q8_0, q8_0-h64."""
        return self.cache_type + (f"-h{self.rotation}" if self.rotation else "")

    @classmethod
    def parse(cls, name: str) -> BlockFormat:
        match = re.fullmatch(r"(q[0-9]_[0-9])(?:-h([1-9][0-9]*))?", name)
        if not match or match.group(1).upper() not in GGMLQuantizationType.__members__:
            raise ValueError(f"unknown cache block format {name!r} — a stored quantized part is q8_0 or q4_0[-hN]")
        return cls(match.group(1), int(match.group(2) or 0))

    def block_bytes(self, values: int) -> int:
        """Bytes of ``values`` values in this format."""
        block, size = GGML_QUANT_SIZES[_ggml_type(self.cache_type)]
        return values // block * size


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
    values = gguf_quants.dequantize(raw.contiguous().numpy(), _ggml_type(block_format.cache_type))
    if block_format.rotation:
        values = _rotate(values, block_format.rotation)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def blocks_of(values: torch.Tensor, block_format: BlockFormat) -> torch.Tensor:
    """Offline quantization: values [.., head_dim] rotated as llama.cpp would, then quantized by gguf's
    reference quantizer into raw blocks [.., blocks x block bytes]."""
    array = values.detach().cpu().float().numpy()
    if block_format.rotation:
        array = _rotate(array, block_format.rotation).astype(np.float32)
    return torch.from_numpy(gguf_quants.quantize(np.ascontiguousarray(array), _ggml_type(block_format.cache_type)))
