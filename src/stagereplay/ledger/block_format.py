"""How a quantized K or V part is stored: its ggml block type and the rotation applied first (no torch).

The one spelling of a block format: a stored cache's tensor name ends in it (``layer.000.k.q8_0-h64``),
the plan projects names with it, and the parser and the store read it back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


def ggml_type(cache_type: str) -> GGMLQuantizationType:
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
        block, size = GGML_QUANT_SIZES[ggml_type(self.cache_type)]
        return values // block * size
