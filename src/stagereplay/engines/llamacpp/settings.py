"""A llama.cpp context's settings (``EngineSettings``: cache type, threads, context and micro-batch sizes,
flash attention, rotation, sequences), the one context size of every job, and the rotation a new context
chose for a quantized cache, read from llama.cpp's log. No binding: the engine opens contexts from these."""

from __future__ import annotations

import re
from dataclasses import dataclass

from stagereplay.engines.base import ModelError, Runtime
from stagereplay.engines.llamacpp.binding import PINNED_VERSION, LlamaCppError
from stagereplay.engines.llamacpp.cache_types import CacheTypeError, check_cache_precision, rotation_size
from stagereplay.engines.llamacpp.state import Geometry


@dataclass(frozen=True)
class EngineSettings:
    cache_type: str  # the precision: "fp16", "fp32", "q8_0", "q4_0", or K's and V's ("q8_0-fp16")
    n_threads: int
    n_threads_batch: int
    n_ctx: int
    ubatch: int = 0  # llama.cpp's n_ubatch; 0: n_ctx, so a prefix is one micro-batch
    flash_attn: bool = False
    rotation: bool = True  # llama.cpp's Hadamard rotation of a quantized cache (off: LLAMA_ATTN_ROT_DISABLE=1)
    n_seq_max: int = 1  # more than 1: a unified cache of that many sequences, as llama.cpp's server runs
    kv_unified: bool = True  # with more than one sequence: one cache (False: one KV stream per sequence)

    @property
    def micro_batch(self) -> int:
        return self.ubatch or self.n_ctx

    def describe(self) -> str:
        return (
            f"n_ctx=n_batch={self.n_ctx}; n_ubatch={self.micro_batch}; n_threads={self.n_threads};"
            f" n_threads_batch={self.n_threads_batch}; cache={self.cache_type}; flash_attn={'on' if self.flash_attn else 'off'};"
            f" rotation={'default' if self.rotation else 'disabled'}; n_seq_max={self.n_seq_max}"
            + ("" if self.n_seq_max == 1 or self.kv_unified else "; kv_unified=off")
        )


def chosen_rotation(log: list[str], types, geometry: Geometry) -> tuple[int, int]:
    """The Hadamard sizes the new context rotates a quantized K and V by: whether it does, as llama.cpp logged
    its choice (``attn_rot_k`` / ``attn_rot_v``), and by how much, its rule (``llamacpp.cache_types.rotation_size``)."""
    if not types.quantized:
        return 0, 0
    text = "".join(log)
    found = {part: re.search(rf"attn_rot_{part} = (\d)", text) for part in ("k", "v")}
    if not all(found.values()):
        raise LlamaCppError(
            f"llama.cpp {PINNED_VERSION} did not log whether it rotates the quantized cache — the state cannot be read"
        )
    k_size = rotation_size("k", geometry.head_dim_k) if found["k"].group(1) == "1" else 0
    v_size = rotation_size("v", geometry.head_dim_v) if found["v"].group(1) == "1" else 0
    return k_size, v_size


# One context size for every llama.cpp job: a prefix is one micro-batch of at most this many tokens.
LLAMACPP_N_CTX = 2048


def check_runtime(runtime: Runtime, checkpoint_engine: str, engine_words: str) -> None:
    """Refuse, in one line, a runtime no llama.cpp context can run (the binding's and the server's alike):
    a cache type the build cannot store, a device other than the CPU, no thread. ``checkpoint_engine`` and
    ``engine_words`` name the engine in the message."""
    try:
        check_cache_precision(runtime.precision, runtime.flash_attn)
    except CacheTypeError as error:
        raise ModelError(f"{error} (a {checkpoint_engine} checkpoint's precision is its KV cache type)") from None
    if runtime.device != "cpu":
        raise ModelError(f"{engine_words} runs on cpu only (asked for {runtime.device}) — set device: cpu")
    if runtime.threads < 1:
        raise ModelError(f"threads must be >= 1, got {runtime.threads} — set threads in the config")
