"""The llama.cpp engine as the rest of stagereplay sees it before loading it (no torch).

A llama.cpp checkpoint is a GGUF run as shipped; its precision is its KV-cache type (``llamacpp.cache_types``).
"""

from __future__ import annotations

from stagereplay.engines.llamacpp.cache_types import (
    LLAMACPP_PRECISION_PATTERN,
    QUANTIZED,
    CacheTypeError,
    cache_types,
    check_cache_precision,
    rotation_size,
)
from stagereplay.engines.llamaserver.spec import DECLARED as LLAMASERVER_DECLARED
from stagereplay.engines.spec import SHARED_ENVIRONMENT, ControlScope, EngineSpec, Knob, SpecError
from stagereplay.ledger.block_format import BlockFormat

# A quantized cache type says nothing of the weights (the GGUF's own, as shipped): they are counted at fp16
# width, as under llama.cpp's default fp16 cache, so a cache type changes a job's figure by its caches only.
WEIGHT_BYTES = 2


def _flash_attn_refusal(level: str, precision: str, flash_attn: bool) -> str | None:
    if level == "off" and precision and cache_types(precision).v in QUANTIZED:
        return f"the run's {precision} V cache needs flash attention, so off cannot run — remove it"
    return None


def _cache_type_refusal(level: str, precision: str, flash_attn: bool) -> str | None:
    try:
        check_cache_precision(level, flash_attn)
    except CacheTypeError as error:
        return str(error)
    return None


def _rotation_refusal(level: str, precision: str, flash_attn: bool) -> str | None:
    if precision and cache_types(precision).quantized:
        return None
    return (
        f"llama.cpp rotates only a quantized cache and the run's is {precision or 'not one'} — set"
        " matched.precision to a quantized type (q8_0), or remove rotation"
    )


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
    factors={
        "prefix_reuse": Knob("kept", "llama_memory_seq_rm: the sequence's first positions kept"),
        "batch": Knob("request", "one llama_decode of B sequences"),
        "threads": Knob("switch", "llama_set_n_threads"),
        "chunk": Knob("request", "llama_decode calls of N tokens"),
        "flash_attn": Knob("context", "flash_attn_type", _flash_attn_refusal),
        "ubatch": Knob("context", "n_ubatch"),
        "cache_type": Knob("context", "type_k, type_v", _cache_type_refusal),
        "rotation": Knob("context", "LLAMA_ATTN_ROT_DISABLE", _rotation_refusal),
        "kv_offset": Knob("request", "a filler sequence decoded first in a unified cache"),
        "kv_unified": Knob("context", "kv_unified"),
    },
    libraries=("llama_cpp_python",),
    environment_fields=(*SHARED_ENVIRONMENT, "attn_implementation"),
    engine_class_path="stagereplay.engines.llamacpp.engine:LlamaCppEngine",
    precision_note="its precision is llama.cpp's KV cache type; the weights are the GGUF's as shipped (not"
    " converted), so its fp16/fp32 rows are not a transformers fp16/fp32 run",
    control_scopes={
        "threads": ControlScope(
            "the thread switch (llama_set_n_threads) set to the run's own count around each build and read",
            "another thread count's split of the work",
        ),
        "flash_attn": ControlScope(
            "a new context with the run's own flash attention: the context re-created",
            "the other attention path",
        ),
        "ubatch": ControlScope(
            "a new context with n_ubatch = n_ctx, the run's own: the context re-created",
            "another split of the prompt into micro-batches",
        ),
        "cache_type": ControlScope(
            "a new context of the run's own cache type (the context re-created), and the conversion path,"
            " which must hand the cache back as it is",
            "a conversion between two cache types: no value is converted",
        ),
        "rotation": ControlScope(
            "a new context that rotates, as the run's does: the context re-created",
            "an unrotated cache",
        ),
        "chunk": ControlScope(
            "the chunker with one chunk of the whole context, one decode call: the reference computation itself",
            "a chunk boundary (a later call attending to an earlier call's cells): it cannot fail on the chunked path",
        ),
        "prefix_reuse": ControlScope(
            "the earlier request over the whole context kept in the sequence (llama_memory_seq_rm drops the token"
            " it generated)",
            "a partial hit: nothing is decoded on top of the kept cells",
        ),
        "batch": ControlScope(
            "one sequence through the batch decode calls, in a context reopened for it",
            "other sequences in the calls, or a unified cache shared with them",
        ),
        "kv_offset": ControlScope(
            "a 100-cell filler sequence decoded in a unified cache of 2 sequences, then removed before the item:"
            " the filler path and its removal",
            "the item's cells behind another sequence's: they start at cell 0",
        ),
        "kv_unified": ControlScope(
            "the context of one KV stream per sequence (kv_unified off), with the item alone",
            "other sequences, in their own streams or in the item's decode calls",
        ),
    },
)

# llama.cpp's own server on the same GGUFs and cache types (its declarations: llamaserver.spec).
LLAMASERVER = LlamaCppSpec(
    precisions=LLAMACPP.precisions,
    precision_pattern=LLAMACPP.precision_pattern,
    precision_kind=LLAMACPP.precision_kind,
    checkpoint_sources=LLAMACPP.checkpoint_sources,
    environment_fields=LLAMACPP.environment_fields,
    **{
        **LLAMASERVER_DECLARED,
        # Each factor as the server runs it (its declared mechanism and option), refused as the binding refuses.
        "factors": {
            factor: Knob(mechanism, setting, LLAMACPP.factors[factor].refuse)
            for factor, (mechanism, setting) in LLAMASERVER_DECLARED["factors"].items()
        },
        "control_scopes": {
            factor: ControlScope(*scope) for factor, scope in LLAMASERVER_DECLARED["control_scopes"].items()
        },
    },
)
