"""The llama.cpp engine as the rest of stagereplay sees it before loading it (no torch).

A llama.cpp checkpoint is a GGUF run as shipped; its precision is its KV-cache type (``cache_types``).
"""

from __future__ import annotations

from stagereplay.engines.cache_types import (
    LLAMACPP_PRECISION_PATTERN,
    QUANTIZED,
    CacheTypeError,
    cache_types,
    check_cache_precision,
    rotation_size,
)
from stagereplay.engines.llamaserver_spec import DECLARED as LLAMASERVER_DECLARED
from stagereplay.engines.spec import SHARED_ENVIRONMENT, EngineSpec, SpecError
from stagereplay.ledger.block_format import BlockFormat

# A quantized cache type says nothing of the weights (the GGUF's own, as shipped): they are counted at fp16
# width, as under llama.cpp's default fp16 cache, so a cache type changes a job's figure by its caches only.
WEIGHT_BYTES = 2


class LlamaCppSpec(EngineSpec):
    def check_precision(self, precision, flash_attn=False):
        try:
            check_cache_precision(precision, flash_attn)
        except CacheTypeError as error:
            raise SpecError(str(error)) from None

    def check_run(self, checkpoint, precisions, runtime):
        if "bf16" in precisions:
            raise SpecError(
                f"checkpoint {checkpoint!r} runs on llama.cpp, whose precision is the KV cache type: bf16 is not one"
                f" — use {self.precision_choices()} for its precisions"
            )
        super().check_run(checkpoint, precisions, runtime)

    def check_cast(self, precision, cast_to):
        """E5's cross-precision transplant casts values: a quantized cache holds blocks, so it is refused."""
        if cast_to and (cache_types(precision).quantized or cache_types(cast_to).quantized):
            raise SpecError(
                f"transplant.cross_precision: a {precision} cache cannot be cast to {cast_to} (a quantized cache"
                " holds blocks, not values) — set transplant.cross_precision: null"
            )

    def head_bytes(self, precision, part, head_dim):
        return self.cache_types(precision, head_dim).row_bytes(part, head_dim)

    def weight_bytes(self, precision):
        self.cache_types(precision)  # refuses a name that is no precision at all
        return WEIGHT_BYTES

    def stored_part(self, precision, part, head_dim, rotation):
        kind = getattr(self.cache_types(precision), part)
        if kind not in QUANTIZED:
            return "", "F16" if kind == "fp16" else "F32", head_dim
        size = rotation_size(part, head_dim) if rotation else 0
        return "." + BlockFormat(kind, size).name, "U8", self.head_bytes(precision, part, head_dim)

    @staticmethod
    def cache_types(precision: str, head_dim: int | None = None):
        """The K and V cache types, refused in one line where the name is none or the head not whole blocks. A
        quantized V also needs flash attention: that is the run's check, not the byte count's."""
        try:
            return check_cache_precision(precision, flash_attn=True, head_dim=head_dim)
        except CacheTypeError as error:
            raise SpecError(str(error)) from None


LLAMACPP = LlamaCppSpec(
    name="llamacpp",
    summary="a GGUF",
    precisions={
        "fp16": "K and V cached as float16",
        "fp32": "K and V cached as float32",
        "q8_0": "K and V cached as ggml q8_0 blocks",
        "q4_0": "K and V cached as ggml q4_0 blocks",
    },  # and K's type and V's type apart, joined by a dash (q8_0-fp16): precision_pattern
    precision_pattern=LLAMACPP_PRECISION_PATTERN,
    precision_kind="KV-cache type",
    checkpoint_sources=("embedded", "gguf", "random_qwen2"),
    record_kind="gguf",
    factors=frozenset(
        {
            "prefix_reuse",
            "batch",
            "threads",
            "chunk",
            "flash_attn",
            "ubatch",
            "cache_type",
            "rotation",
            "kv_offset",
            "kv_unified",
        }
    ),
    libraries=("llama_cpp_python",),
    environment_fields=(*SHARED_ENVIRONMENT, "attn_implementation"),
    engine_class_path="stagereplay.engines.llamacpp_engine:LlamaCppEngine",
    keeps_sequences=True,
    precision_note="its precision is llama.cpp's KV cache type; the weights are the GGUF's as shipped (not"
    " converted), so its fp16/fp32 rows are not a transformers fp16/fp32 run",
)

# llama.cpp's own server on the same GGUFs and cache types (its declarations: llamaserver_spec).
LLAMASERVER = LlamaCppSpec(
    precisions=LLAMACPP.precisions,
    precision_pattern=LLAMACPP.precision_pattern,
    precision_kind=LLAMACPP.precision_kind,
    checkpoint_sources=LLAMACPP.checkpoint_sources,
    environment_fields=LLAMACPP.environment_fields,
    **LLAMASERVER_DECLARED,
)
