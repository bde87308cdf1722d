"""The llama.cpp engine: a GGUF run as shipped through the pinned llama-cpp-python binding.

One model, one context. The reference context is built so that every stage-replay construction
maps onto llama.cpp's own operations: ``n_batch`` and ``n_ubatch`` equal the context size, so a
prefix handed to one ``llama_decode`` is one micro-batch (``prefill``) and a single token is one
decode call (``live``, ``incremental``); one sequence (id 0); threads are the config's for both
single-token and batch decoding; flash attention is ``runtime.flash_attn`` (off by default: the V
cache is then stored transposed, which the state parser reads); the cache type is the precision
(``fp16``, ``fp32``, ``q8_0``, ``q4_0``, or K's and V's: ``q8_0-fp16``); the weights stay as the GGUF
holds them. E6 changes one of these settings at a time (``reconfigure``: a new context on the same
model), runs several sequences in one decode call (``batch_forward``), keeps a sequence's first
positions for a later request (``truncate``) or saves and restores it through llama.cpp's own files
(``save_sequence`` / ``load_sequence``).

The cache is read and written only through the sequence state
(``llama_state_seq_get_data`` / ``set_data``), parsed by ``llamacpp.state``.
The engine implements ``base.Engine``, so constructions, decoding, fingerprints and
transplants run the same code on either engine. The binding, its errors and its log are
``llamacpp.binding``'s; the GGUF's tokenizer is ``llamacpp.tokenizer``'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from pathlib import Path

import numpy as np
import torch

from stagereplay.engines.base import Engine, Environment, Runtime
from stagereplay.engines.cpuinfo import cpu_model
from stagereplay.engines.llamacpp.binding import (
    PINNED_VERSION,
    LlamaCppError,
    binding,
    build_info,
    captured_log,
    last_error,
)
from stagereplay.engines.llamacpp.cache_types import (
    CacheTypeError,
    cache_types,
    check_cache_precision,
)
from stagereplay.engines.llamacpp.sequences import FILLER_SEQ, SEQ, ContextSequences, LlamaCppBatch, LlamaCppCache
from stagereplay.engines.llamacpp.settings import LLAMACPP_N_CTX, EngineSettings, check_runtime, chosen_rotation
from stagereplay.engines.llamacpp.state import (
    CACHE_TYPE_IDS,
    FORMAT,
    Geometry,
    SeqState,
    converted_state,
    parse_seq_state,
    part_format,
    write_seq_state,
)
from stagereplay.engines.llamacpp.tokenizer import LlamaCppTokenizer
from stagereplay.ledger.kvstate import KVState

# Architectures whose every layer is full attention over every position, with one-position cells:
# the sequence state then holds exactly the boundary cache the parser reads.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class GgufCheckpoint:
    """What both llama.cpp engines do with a model record: its GGUF's own tokenizer, and the engine loaded at a
    runtime by the engine's ``load_gguf`` (the binding's context, or a server)."""

    @classmethod
    def checkpoint_tokenizer(cls, record: dict, trust_remote_code: bool = False) -> tuple[object, int]:
        return gguf_tokenizer(record["gguf"])

    @classmethod
    def load(cls, record: dict, runtime: Runtime):
        """The record's GGUF as shipped (``gguf``)."""
        return cls.load_gguf(record["gguf"], runtime)


class LlamaCppEngine(GgufCheckpoint, ContextSequences, Engine):
    """A GGUF loaded in llama.cpp with one single-sequence context."""

    @staticmethod
    def load_gguf(gguf: str | Path, runtime: Runtime) -> LlamaCppEngine:
        return load_llamacpp(gguf, runtime)

    def __init__(self, gguf_path: str | Path, settings: EngineSettings):
        self.llama_cpp = llama_cpp = binding()
        gguf_path = Path(gguf_path)
        if not gguf_path.is_file():
            raise LlamaCppError(f"GGUF file {gguf_path} not found — fix the checkpoint's gguf path")
        try:
            cache_types(settings.cache_type)
        except CacheTypeError as error:
            raise LlamaCppError(str(error)) from None
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        # No extra CPU buffer types (weight repacking, AMX): with them, any decode of more than one token
        # of the Q4_1 GGUF crashed llama.cpp 0.3.36 on an AMX-capable CPU here (SIGSEGV), and they make the
        # kernels depend on the CPU model. The plain ggml kernels read the weights as the GGUF holds them.
        model_params.use_extra_bufts = False
        self.gguf_path = gguf_path
        self.model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), model_params)
        if not self.model:
            raise LlamaCppError(
                f"llama.cpp {PINNED_VERSION} could not load {gguf_path} — check it is a GGUF of an architecture this version supports"
            )
        architecture = self.metadata("general.architecture")
        if architecture not in SUPPORTED_ARCHITECTURES or llama_cpp.llama_model_n_swa(self.model) > 0:
            raise LlamaCppError(
                f"GGUF architecture {architecture!r} is not read by stagereplay's llama.cpp engine — use a full-attention {' or '.join(SUPPORTED_ARCHITECTURES)} GGUF"
            )
        n_head = llama_cpp.llama_model_n_head(self.model)
        n_embd = llama_cpp.llama_model_n_embd(self.model)
        head_dim_k = int(self.metadata(f"{architecture}.attention.key_length") or n_embd // n_head)
        head_dim_v = int(self.metadata(f"{architecture}.attention.value_length") or n_embd // n_head)
        self.geometry = Geometry(
            n_layer=llama_cpp.llama_model_n_layer(self.model),
            n_head_kv=llama_cpp.llama_model_n_head_kv(self.model),
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
        )
        self.context_length = llama_cpp.llama_model_n_ctx_train(self.model)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        # llama.cpp's own end of generation: every token its vocabulary marks as one.
        self.eog_ids = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t))
        self.tokenizer = LlamaCppTokenizer(self.model)
        self.environment: Environment | None = None  # set by load_llamacpp, which knows the runtime
        self.generation = 0
        self.context = None
        self.filler = False  # a filler sequence held beside the engine's (``behind_filler``)
        self._open(settings)

    def _open(self, settings: EngineSettings) -> None:
        """A new context at ``settings`` on the loaded model (every cache of the old one goes stale)."""
        llama_cpp = self.llama_cpp
        try:
            for head_dim in {self.geometry.head_dim_k, self.geometry.head_dim_v}:
                check_cache_precision(settings.cache_type, settings.flash_attn, head_dim)
        except CacheTypeError as error:
            raise LlamaCppError(str(error)) from None
        types = cache_types(settings.cache_type)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = settings.n_ctx * settings.n_seq_max  # every sequence of a batch gets a whole context
        params.n_batch = params.n_ctx  # a whole prefix (or a batch's prefixes) in one decode call ...
        params.n_ubatch = settings.ubatch or params.n_ctx  # ... and, unless told, in one micro-batch
        params.n_seq_max = settings.n_seq_max
        params.kv_unified = settings.n_seq_max > 1 and settings.kv_unified
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads_batch
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.type_k = CACHE_TYPE_IDS[types.k]
        params.type_v = CACHE_TYPE_IDS[types.v]
        params.no_perf = True
        # llama.cpp reads LLAMA_ATTN_ROT_DISABLE when it makes the cache; only this engine's setting decides.
        previous = os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
        if not settings.rotation:
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
        try:
            with captured_log() as log:
                context = llama_cpp.llama_init_from_model(self.model, params)
        finally:
            os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
            if previous is not None:
                os.environ["LLAMA_ATTN_ROT_DISABLE"] = previous
        if not context:
            raise LlamaCppError(
                f"llama.cpp could not create a context ({settings.describe()}) for {self.gguf_path}: {last_error(log)}"
            )
        self.close_context()
        self.context = context
        self.settings = settings
        self.memory = llama_cpp.llama_get_memory(context)
        self.batch = llama_cpp.llama_batch_init(params.n_ctx, 0, 1)
        self.rotation = chosen_rotation(log, types, self.geometry)
        self.generation += 1

    def reconfigure(self, **changes) -> None:
        """Run the next calls with these settings changed: a new context, the model stays loaded. A new one
        even when nothing changes: E6's controls reconfigure to the run's own settings and must go through
        the same path (a fresh context, its cache allocated anew) as a test level does."""
        self._open(dataclasses.replace(self.settings, **changes))

    @contextlib.contextmanager
    def batch_context(self, size: int, unified: bool = True):
        """A context of ``size`` sequences while the batch runs (one unified cache, or one KV stream each), then
        the single-sequence context again."""
        self.reconfigure(n_seq_max=size, kv_unified=unified)
        try:
            yield
        finally:
            self.reconfigure(n_seq_max=1, kv_unified=True)

    @contextlib.contextmanager
    def behind_filler(self, tokens: list[int], removed: bool = False):
        """A unified cache of two sequences whose sequence 1 holds ``tokens``, decoded first in one call: llama.cpp
        puts the cells of what the engine then decodes after them (the first free cells), so its cache starts at
        cell ``len(tokens)``. The filler stays idle: the engine's caches clear their own sequence only. ``removed``:
        the filler is removed again at once, which frees cells 0.. and puts the engine's cache back at cell 0."""
        self.reconfigure(n_seq_max=2)
        try:
            self._decode([(FILLER_SEQ, 0, list(tokens))])
            if removed and not self.llama_cpp.llama_memory_seq_rm(self.memory, FILLER_SEQ, -1, -1):
                raise LlamaCppError("llama.cpp refused to remove the filler sequence")
            self.filler = not removed
            yield
        finally:
            self.filler = False
            self.reconfigure(n_seq_max=1)

    def _clear(self) -> None:
        """Empty the engine's own sequence (the whole cache, unless a filler sequence is held beside it)."""
        if self.filler:
            if not self.llama_cpp.llama_memory_seq_rm(self.memory, SEQ, -1, -1):
                raise LlamaCppError("llama.cpp refused to clear the engine's sequence")
        else:
            self.llama_cpp.llama_memory_clear(self.memory, True)

    def converted(self, state: KVState) -> KVState:
        """``state`` in this context's cache type (``llamacpp.state.converted_state``)."""
        return converted_state(self.placed(state), self.settings.cache_type, self.formats)

    def build_description(self) -> str:
        """The context as it runs now, in words: every setting the numbers depend on, and how the cache is stored."""
        k_format, v_format = self.formats
        return (
            f"cpu; {self.settings.describe()}; K stored as {k_format or 'values'}, V as {v_format or 'values'};"
            " extra_bufts=off; weights as in the GGUF"
        )

    @property
    def formats(self) -> tuple[str, str]:
        """How this context's K and V parts are stored: plain values (""), or a block format with its rotation."""
        types = cache_types(self.settings.cache_type)
        return part_format(types.k, self.rotation[0]), part_format(types.v, self.rotation[1])

    def metadata(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(256)
        length = self.llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buffer, 256)
        return buffer.value.decode() if length >= 0 else None

    @property
    def eos_ids(self) -> frozenset[int]:
        # The vocabulary's EOS and every token it marks as end of generation.
        return frozenset({self.tokenizer.eos_token_id} | self.eog_ids) - {None}

    @property
    def num_layers(self) -> int:
        return self.geometry.n_layer

    # The engine protocol (base.Engine).

    def empty_cache(self) -> LlamaCppCache:
        self._clear()
        self.generation += 1
        return LlamaCppCache(self, self.generation)

    def forward(self, tokens: list[int], cache: LlamaCppCache) -> torch.Tensor:
        """One ``llama_decode`` of ``tokens`` after the cache; the float32 logits of the last one."""
        self._check(cache)
        if cache.positions + len(tokens) > self.settings.n_ctx:
            raise LlamaCppError(
                f"{cache.positions + len(tokens)} positions exceed the llama.cpp context of {self.settings.n_ctx} — raise n_ctx in the llamacpp config"
            )
        self._decode([(SEQ, cache.positions, tokens)])
        cache.positions += len(tokens)
        return self._logits(len(tokens) - 1)

    def _decode(self, rows: list[tuple[int, int, list[int]]]) -> None:
        """One ``llama_decode`` of each (sequence, first position, tokens), logits for each row's last token."""
        batch, index = self.batch, 0
        for seq, start, tokens in rows:
            for offset, token in enumerate(tokens):
                batch.token[index] = token
                batch.pos[index] = start + offset
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = seq
                batch.logits[index] = offset == len(tokens) - 1
                index += 1
        batch.n_tokens = index
        self.fed_positions += index
        status = self.llama_cpp.llama_decode(self.context, batch)
        if status != 0:
            raise LlamaCppError(f"llama_decode returned {status} for {index} tokens in {len(rows)} sequences")

    def _logits(self, index: int) -> torch.Tensor:
        logits = self.llama_cpp.llama_get_logits_ith(self.context, index)
        return torch.from_numpy(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy())

    def snapshot(self, cache: LlamaCppCache) -> KVState:
        return self.read_state(cache).kv

    def to_cache(self, state: KVState) -> LlamaCppCache:
        cache = self.empty_cache()
        self.write_state(self._seq_state(state), cache)
        return cache

    def _seq_state(self, state: KVState, seq: int = SEQ) -> SeqState:
        # to_cache and batch_of both pass here: llama.cpp reads a sequence's bytes from CPU memory.
        state = self.placed(state)
        if state.formats != self.formats:
            raise LlamaCppError(
                f"a cache stored as {state.formats} cannot go into this {self.settings.cache_type} context (stores"
                f" {self.formats}) unconverted — convert it first (the engine's converted)"
            )
        # Without a unified cache each sequence has a KV stream of its own (sequence i in stream i).
        separate = self.settings.n_seq_max > 1 and not self.settings.kv_unified
        return SeqState(
            kv=state,
            seq_id=seq,
            v_trans=not self.settings.flash_attn,
            cache_type=self.settings.cache_type,
            streams=self.settings.n_seq_max if separate else 1,
            stream=seq if separate else 0,
        )

    # --- E6: settings a server changes ---

    def use_threads(self, threads: int) -> None:
        self.llama_cpp.llama_set_n_threads(self.context, threads, threads)
        self.settings = dataclasses.replace(self.settings, n_threads=threads, n_threads_batch=threads)

    # The sequence state, raw and parsed.

    def _sequence_bytes(self, seq: int) -> bytes:
        size = self.llama_cpp.llama_state_seq_get_size(self.context, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = self.llama_cpp.llama_state_seq_get_data(self.context, buffer, size, seq)
        if written != size:
            raise LlamaCppError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return bytes(buffer)

    def _set_sequence(self, data: bytes, seq: int) -> None:
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if self.llama_cpp.llama_state_seq_set_data(self.context, buffer, len(data), seq) != len(data):
            raise LlamaCppError(f"llama_state_seq_set_data refused a state of {len(data)} bytes ({FORMAT} format)")

    def _parse(self, data: bytes, positions: int) -> SeqState:
        parsed = parse_seq_state(data, self.geometry, self.rotation)
        if parsed.kv.num_positions != positions or parsed.cache_type != self.settings.cache_type:
            raise LlamaCppError(
                f"the sequence state holds {parsed.kv.num_positions} {parsed.cache_type} cells, the engine decoded {positions} {self.settings.cache_type} — {FORMAT}'s state does not match its context"
            )
        return parsed

    def state_bytes(self, cache: LlamaCppCache) -> bytes:
        self._check(cache)
        return self._sequence_bytes(SEQ)

    def read_state(self, cache: LlamaCppCache) -> SeqState:
        return self._parse(self.state_bytes(cache), cache.positions)

    def write_state(self, state: SeqState | bytes, cache: LlamaCppCache) -> None:
        """Replace the sequence with ``state`` (parsed, or raw bytes as llama.cpp wrote them)."""
        self._check(cache)
        data = state if isinstance(state, bytes) else write_seq_state(state)
        positions = (
            parse_seq_state(data, self.geometry, self.rotation).kv.num_positions
            if isinstance(state, bytes)
            else state.kv.num_positions
        )
        if state is not data and state.kv.num_layers != self.geometry.n_layer:
            raise LlamaCppError(
                f"a cache of {state.kv.num_layers} layers cannot feed a model of {self.geometry.n_layer} layers — continue a state only on the model that built it"
            )
        self._clear()
        self._set_sequence(data, SEQ)
        cache.positions = positions

    def _check(self, cache: LlamaCppCache | LlamaCppBatch) -> None:
        if cache.engine is not self or cache.generation != self.generation:
            raise LlamaCppError("a llama.cpp cache was used after its engine started another sequence")

    def close_context(self) -> None:
        if self.context:
            self.llama_cpp.llama_batch_free(self.batch)
            self.llama_cpp.llama_free(self.context)
            self.context = None

    def close(self) -> None:
        if self.model:
            self.close_context()
            self.llama_cpp.llama_model_free(self.model)
            self.model = None


def load_llamacpp(gguf: str | Path, runtime: Runtime) -> LlamaCppEngine:
    """A GGUF loaded at ``runtime`` (the precision is the cache type), with its environment record."""
    check_runtime(runtime, "llamacpp", "the llama.cpp engine")
    settings = EngineSettings(
        cache_type=runtime.precision,
        n_threads=runtime.threads,
        n_threads_batch=runtime.threads,
        n_ctx=LLAMACPP_N_CTX,
        flash_attn=runtime.flash_attn,
    )
    engine = LlamaCppEngine(gguf, settings)
    engine.environment = environment_of(engine, runtime)
    return engine


def environment_of(engine: LlamaCppEngine, runtime: Runtime) -> Environment:
    """What the engine's numbers depend on: its build, its context settings, and the cache's rotation."""
    settings = engine.settings
    return ggml_environment(
        "llamacpp",
        runtime.precision,
        settings.n_threads,
        settings.flash_attn,
        build_info(),
        f"llama-cpp-python {PINNED_VERSION}",
        engine.build_description(),
    )


def ggml_environment(
    name: str, precision: str, threads: int, flash_attn: bool, cpu_capability: str, version: str, build: str
) -> Environment:
    """The environment record of a llama.cpp engine (the binding or its server): on the CPU, what its build and
    settings say; torch's own switches, which a ggml engine never reads, as their off values."""
    import transformers

    return Environment(
        device="cpu",
        device_name=cpu_model(),
        cpu_capability=cpu_capability,
        precision=precision,
        threads=threads,
        attn_implementation=f"{name}:flash_attn={'on' if flash_attn else 'off'}",
        tf32=False,
        bf16_reduced_precision_reduction=False,
        fp16_reduced_precision_reduction=False,
        sdpa_backends="none",
        float32_matmul_precision="n/a",
        deterministic=False,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        engine=name,
        engine_version=version,
        engine_build=build,
    )


def gguf_tokenizer(gguf: str | Path) -> tuple[LlamaCppTokenizer, int]:
    """The GGUF's own tokenizer and the context a prompt must fit, from a small context (no cache work)."""
    engine = LlamaCppEngine(gguf, EngineSettings("fp16", 1, 1, 8))
    return engine.tokenizer, min(engine.context_length or LLAMACPP_N_CTX, LLAMACPP_N_CTX)
