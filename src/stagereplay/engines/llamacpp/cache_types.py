"""llama.cpp's KV cache types as stagereplay names them: a llama.cpp checkpoint's precision is its cache type.

No torch: the workflow's parse-time checks, the storage plan and the engine read this.

A precision names one type for K and V (``q8_0``), or K's type and V's type joined by a dash
(``q8_0-fp16``: K in q8_0 blocks, V in fp16). ``fp16`` and ``fp32`` hold plain values; ``q8_0`` and
``q4_0`` hold ggml blocks of 32 values, each block a float16 scale and 32 8-bit (or 4-bit) integers.
In the pinned llama.cpp a quantized V cache needs flash attention (the transposed V layout it uses
without flash attention holds plain values only), and a quantized cache is stored rotated by a
Walsh-Hadamard transform unless that is disabled (``LLAMA_ATTN_ROT_DISABLE``, read when a context is made).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# name: (ggml type id in ggml.h, ggml's own name, values per block, bytes per block)
CACHE_TYPES: dict[str, tuple[int, str, int, int]] = {
    "fp32": (0, "f32", 1, 4),
    "fp16": (1, "f16", 1, 2),
    "q4_0": (2, "q4_0", 32, 18),
    "q8_0": (8, "q8_0", 32, 34),
}
QUANTIZED = frozenset(name for name, (_, _, block, _) in CACHE_TYPES.items() if block > 1)
_NAME = "|".join(CACHE_TYPES)
# Every precision a llama.cpp checkpoint takes, as a regular expression (the workflow's wildcard too).
LLAMACPP_PRECISION_PATTERN = rf"(?:{_NAME})(?:-(?:{_NAME}))?"


class CacheTypeError(ValueError):
    """One-line message naming the problem and the fix."""


@dataclass(frozen=True)
class CacheTypes:
    """The K and V cache types of one llama.cpp precision."""

    k: str
    v: str

    @property
    def quantized(self) -> bool:
        return self.k in QUANTIZED or self.v in QUANTIZED

    def row_bytes(self, part: str, values: int) -> int:
        """Bytes of ``values`` cached values of K (``part`` "k") or V ("v") in one cell."""
        _, _, block, size = CACHE_TYPES[self.k if part == "k" else self.v]
        return values // block * size


def cache_types(precision: str) -> CacheTypes:
    """The K and V cache types a llama.cpp precision names (``q8_0`` or ``q8_0-fp16``)."""
    if not re.fullmatch(LLAMACPP_PRECISION_PATTERN, precision):
        raise CacheTypeError(
            f"precision {precision!r} is not a llama.cpp cache type — use one of {', '.join(CACHE_TYPES)}, or K's"
            " and V's joined by a dash (q8_0-fp16)"
        )
    k, _, v = precision.partition("-")
    return CacheTypes(k, v or k)


def rotation_size(part: str, head_dim: int) -> int:
    """The Hadamard size the pinned llama.cpp rotates a quantized K ("k") or V ("v") part by before it stores
    it, 0 for none: only heads of whole 64-value runs are rotated, K by the largest power of two dividing
    the head, V by 64 (llama_kv_cache::build_input_k_rot and build_input_v_rot)."""
    if head_dim % 64:
        return 0
    size = 64
    while part == "k" and head_dim % (2 * size) == 0:
        size *= 2
    return size


def check_cache_precision(precision: str, flash_attn: bool, head_dim: int | None = None) -> CacheTypes:
    """The precision's cache types, refused in one line where the pinned llama.cpp cannot run them."""
    types = cache_types(precision)
    if types.v in QUANTIZED and not flash_attn:
        raise CacheTypeError(
            f"precision {precision}: llama.cpp stores a {types.v} V cache only with flash attention — set"
            f" runtime.flash_attn: true, or keep V in fp16 (precision {types.k}-fp16)"
        )
    if head_dim is not None and types.quantized and head_dim % 32:
        raise CacheTypeError(
            f"precision {precision}: a head of {head_dim} values is not whole 32-value blocks — use fp16 or fp32"
        )
    return types
