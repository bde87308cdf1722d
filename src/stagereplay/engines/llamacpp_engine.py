"""The llama.cpp engine: a GGUF run as shipped through the pinned llama-cpp-python binding.

One model, one context, one sequence (id 0). The context is built so that every
stage-replay construction maps onto llama.cpp's own operations: ``n_batch`` and
``n_ubatch`` equal the context size, so a prefix handed to one ``llama_decode``
is one micro-batch (``prefill``) and a single token is one decode call
(``live``, ``incremental``). Flash attention is off (a fixed kernel choice, and
the V cache is then stored transposed, which the state parser reads), threads
are the config's for both single-token and batch decoding, and the cache type
is the precision (``fp16`` is llama.cpp's default, ``fp32``); the weights stay
as the GGUF holds them.

The cache is read and written only through the sequence state
(``llama_state_seq_get_data`` / ``set_data``), parsed by ``llamacpp_state``.
The engine implements ``base.Engine``, so constructions, decoding, fingerprints and
transplants run the same code on either engine.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stagereplay.engines.base import Engine, Environment, ModelError, Runtime, cpu_model
from stagereplay.engines.llamacpp_state import (
    CACHE_TYPE_IDS,
    FORMAT,
    Geometry,
    SeqState,
    parse_seq_state,
    write_seq_state,
)
from stagereplay.ledger.kvstate import KVState

PINNED_VERSION = "0.3.36"
# Architectures whose every layer is full attention over every position, with one-position cells:
# the sequence state then holds exactly the boundary cache the parser reads.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SEQ = 0


class LlamaCppError(RuntimeError):
    """One-line message naming the problem and the fix."""


@functools.cache
def binding():
    """The binding, imported once, its version checked and its log sent nowhere (it would drown job logs)."""
    try:
        import llama_cpp
    except ImportError as error:
        raise LlamaCppError(
            f"llama_cpp is not importable ({error}) — install the llama.cpp engine: pip install -e .[llamacpp] (envs/llamacpp.txt)"
        ) from None
    if llama_cpp.__version__ != PINNED_VERSION:
        raise LlamaCppError(
            f"llama-cpp-python {llama_cpp.__version__} is installed, stagereplay is pinned to {PINNED_VERSION} (its state format is parsed) — pip install llama-cpp-python=={PINNED_VERSION}"
        )
    llama_cpp.llama_log_set(_SILENT, None)
    llama_cpp.llama_backend_init()
    return llama_cpp


def _silent(level, text, user_data) -> None:
    return None


_SILENT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_silent)


def build_info() -> str:
    """The binding's version and the CPU features its build enables: what llama.cpp's kernels depend on."""
    llama_cpp = binding()
    return llama_cpp.llama_print_system_info().decode().strip()


@dataclass(frozen=True)
class EngineSettings:
    cache_type: str  # "fp16" or "fp32"
    n_threads: int
    n_threads_batch: int
    n_ctx: int


class LlamaCppCache:
    """The engine's one sequence, valid until the engine starts another (a stale cache refuses to run)."""

    def __init__(self, engine: LlamaCppEngine, generation: int):
        self.engine = engine
        self.generation = generation
        self.positions = 0


class LlamaCppTokenizer:
    """llama.cpp's own tokenizer behind the calls the shared code makes on a transformers tokenizer."""

    def __init__(self, engine: LlamaCppEngine):
        self.engine = engine
        self.eos_token_id = engine.llama_cpp.llama_vocab_eos(engine.vocab)
        template = engine.llama_cpp.llama_model_chat_template(engine.model, None)
        self.chat_template = template.decode() if template else None

    def __len__(self) -> int:
        return self.engine.n_vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        llama_cpp = self.engine.llama_cpp
        raw = text.encode("utf-8")
        capacity = len(raw) + 16
        buffer = (llama_cpp.llama_token * capacity)()
        # Special tokens written in the text are parsed as such, as llama.cpp's server does for a templated prompt.
        count = llama_cpp.llama_tokenize(self.engine.vocab, raw, len(raw), buffer, capacity, add_special_tokens, True)
        if count < 0:
            raise LlamaCppError(f"llama.cpp could not tokenize {len(raw)} bytes (needs {-count} tokens)")
        return list(buffer[:count])

    def decode(self, tokens, skip_special_tokens: bool = False) -> str:
        llama_cpp = self.engine.llama_cpp
        tokens = list(tokens)
        array = (llama_cpp.llama_token * max(len(tokens), 1))(*tokens)
        capacity = 64 + 64 * len(tokens)
        buffer = ctypes.create_string_buffer(capacity)
        count = llama_cpp.llama_detokenize(
            self.engine.vocab, array, len(tokens), buffer, capacity, skip_special_tokens, not skip_special_tokens
        )
        if count < 0:
            raise LlamaCppError(f"llama.cpp could not detokenize {len(tokens)} tokens")
        return buffer.raw[:count].decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, token: int) -> str:
        """The vocabulary's own spelling of one token (the per-item view shows it for a partial byte sequence)."""
        return self.engine.llama_cpp.llama_vocab_get_text(self.engine.vocab, token).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True):
        """The GGUF's chat template as llama.cpp applies it (``llama_chat_apply_template``), then tokenized."""
        llama_cpp = self.engine.llama_cpp
        if not self.chat_template:
            raise LlamaCppError("the GGUF has no chat template — set use_chat_template: false in the config")
        chat = (llama_cpp.llama_chat_message * len(messages))(
            *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages]
        )
        template = self.chat_template.encode()
        size = 256 + 2 * sum(len(m["content"].encode()) for m in messages)
        for _ in range(2):
            buffer = ctypes.create_string_buffer(size)
            needed = llama_cpp.llama_chat_apply_template(
                template, chat, len(messages), add_generation_prompt, buffer, size
            )
            if needed < 0:
                raise LlamaCppError(
                    "llama.cpp does not recognise the GGUF's chat template — set use_chat_template: false in the config"
                )
            if needed <= size:
                text = buffer.raw[:needed].decode("utf-8")
                return self.encode(text, add_special_tokens=True) if tokenize else text
            size = needed
        raise LlamaCppError("llama.cpp's chat template kept growing its output")

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens=True)}


class LlamaCppEngine(Engine):
    """A GGUF loaded in llama.cpp with one single-sequence context."""

    @classmethod
    def load(cls, record: dict, runtime: Runtime) -> LlamaCppEngine:
        """The record's GGUF as shipped (``gguf``)."""
        return load_llamacpp(record["gguf"], runtime)

    def __init__(self, gguf_path: str | Path, settings: EngineSettings):
        self.llama_cpp = llama_cpp = binding()
        self.settings = settings
        gguf_path = Path(gguf_path)
        if not gguf_path.is_file():
            raise LlamaCppError(f"GGUF file {gguf_path} not found — fix the checkpoint's gguf path")
        if settings.cache_type not in CACHE_TYPE_IDS:
            raise LlamaCppError(
                f"precision {settings.cache_type!r} is not a llama.cpp cache type stagereplay reads — use fp16 or fp32"
            )
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        # No extra CPU buffer types (weight repacking, AMX): with them, any decode of more than one token
        # of the Q4_1 GGUF crashed llama.cpp 0.3.36 on an AMX-capable CPU here (SIGSEGV), and they make the
        # kernels depend on the CPU model. The plain ggml kernels read the weights as the GGUF holds them.
        model_params.use_extra_bufts = False
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
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_ctx  # a whole prefix in one decode call ...
        params.n_ubatch = settings.n_ctx  # ... and in one micro-batch: prefill is one forward
        params.n_seq_max = 1
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads_batch
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.type_k = params.type_v = CACHE_TYPE_IDS[settings.cache_type]
        params.no_perf = True
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        if not self.context:
            raise LlamaCppError(f"llama.cpp could not create a context of {settings.n_ctx} tokens for {gguf_path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.memory = llama_cpp.llama_get_memory(self.context)
        # llama.cpp's own end of generation: every token its vocabulary marks as one.
        self.eog_ids = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t))
        self.tokenizer = LlamaCppTokenizer(self)
        self.environment: Environment | None = None  # set by load_llamacpp, which knows the runtime
        self.generation = 0
        self.batch = llama_cpp.llama_batch_init(settings.n_ctx, 0, 1)

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
        self.llama_cpp.llama_memory_clear(self.memory, True)
        self.generation += 1
        return LlamaCppCache(self, self.generation)

    def forward(self, tokens: list[int], cache: LlamaCppCache) -> torch.Tensor:
        """One ``llama_decode`` of ``tokens`` after the cache; the float32 logits of the last one."""
        self._check(cache)
        self.fed_positions += len(tokens)
        if cache.positions + len(tokens) > self.settings.n_ctx:
            raise LlamaCppError(
                f"{cache.positions + len(tokens)} positions exceed the llama.cpp context of {self.settings.n_ctx} — raise n_ctx in the llamacpp config"
            )
        batch = self.batch
        for index, token in enumerate(tokens):
            batch.token[index] = token
            batch.pos[index] = cache.positions + index
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = SEQ
            batch.logits[index] = index == len(tokens) - 1
        batch.n_tokens = len(tokens)
        status = self.llama_cpp.llama_decode(self.context, batch)
        if status != 0:
            raise LlamaCppError(
                f"llama_decode returned {status} for {len(tokens)} tokens at position {cache.positions}"
            )
        cache.positions += len(tokens)
        logits = self.llama_cpp.llama_get_logits_ith(self.context, len(tokens) - 1)
        return torch.from_numpy(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy())

    def snapshot(self, cache: LlamaCppCache) -> KVState:
        return self.read_state(cache).kv

    def to_cache(self, state: KVState) -> LlamaCppCache:
        cache = self.empty_cache()
        self.write_state(SeqState(kv=state, seq_id=SEQ, v_trans=True, cache_type=self.settings.cache_type), cache)
        return cache

    # The sequence state, raw and parsed.

    def state_bytes(self, cache: LlamaCppCache) -> bytes:
        self._check(cache)
        size = self.llama_cpp.llama_state_seq_get_size(self.context, SEQ)
        buffer = (ctypes.c_uint8 * size)()
        written = self.llama_cpp.llama_state_seq_get_data(self.context, buffer, size, SEQ)
        if written != size:
            raise LlamaCppError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return bytes(buffer)

    def read_state(self, cache: LlamaCppCache) -> SeqState:
        parsed = parse_seq_state(self.state_bytes(cache), self.geometry)
        if parsed.kv.num_positions != cache.positions or parsed.cache_type != self.settings.cache_type:
            raise LlamaCppError(
                f"the sequence state holds {parsed.kv.num_positions} {parsed.cache_type} cells, the engine decoded {cache.positions} {self.settings.cache_type} — {FORMAT}'s state does not match its context"
            )
        return parsed

    def write_state(self, state: SeqState | bytes, cache: LlamaCppCache) -> None:
        """Replace the sequence with ``state`` (parsed, or raw bytes as llama.cpp wrote them)."""
        self._check(cache)
        data = state if isinstance(state, bytes) else write_seq_state(state)
        positions = (
            parse_seq_state(data, self.geometry).kv.num_positions
            if isinstance(state, bytes)
            else state.kv.num_positions
        )
        if state is not data and state.kv.num_layers != self.geometry.n_layer:
            raise LlamaCppError(
                f"a cache of {state.kv.num_layers} layers cannot feed a model of {self.geometry.n_layer} layers — continue a state only on the model that built it"
            )
        self.llama_cpp.llama_memory_clear(self.memory, True)
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if self.llama_cpp.llama_state_seq_set_data(self.context, buffer, len(data), SEQ) != len(data):
            raise LlamaCppError(f"llama_state_seq_set_data refused a state of {len(data)} bytes ({FORMAT} format)")
        cache.positions = positions

    def _check(self, cache: LlamaCppCache) -> None:
        if cache.engine is not self or cache.generation != self.generation:
            raise LlamaCppError("a llama.cpp cache was used after its engine started another sequence")

    def close(self) -> None:
        if self.context:
            self.llama_cpp.llama_batch_free(self.batch)
            self.llama_cpp.llama_free(self.context)
            self.llama_cpp.llama_model_free(self.model)
            self.context = None


# One context size for every llama.cpp job: a prefix is one micro-batch of at most this many tokens.
LLAMACPP_N_CTX = 2048
LLAMACPP_PRECISIONS = ("fp16", "fp32")  # llama.cpp cache types; the weights stay as the GGUF holds them


def load_llamacpp(gguf: str | Path, runtime: Runtime) -> LlamaCppEngine:
    """A GGUF loaded at ``runtime`` (the precision is the cache type), with its environment record."""
    import transformers

    if runtime.precision not in LLAMACPP_PRECISIONS:
        raise ModelError(
            f"precision {runtime.precision} is not a llama.cpp cache type — use {' or '.join(LLAMACPP_PRECISIONS)} for a llamacpp checkpoint"
        )
    if runtime.device != "cpu":
        raise ModelError(f"the llama.cpp engine runs on cpu only (asked for {runtime.device}) — set device: cpu")
    if runtime.threads < 1:
        raise ModelError(f"threads must be >= 1, got {runtime.threads} — set threads in the config")
    settings = EngineSettings(
        cache_type=runtime.precision, n_threads=runtime.threads, n_threads_batch=runtime.threads, n_ctx=LLAMACPP_N_CTX
    )
    engine = LlamaCppEngine(gguf, settings)
    engine.environment = Environment(
        device="cpu",
        device_name=cpu_model(),
        cpu_capability=build_info(),
        precision=runtime.precision,
        threads=runtime.threads,
        attn_implementation="llamacpp:flash_attn=off",
        tf32=False,
        bf16_reduced_precision_reduction=False,
        fp16_reduced_precision_reduction=False,
        sdpa_backends="none",
        float32_matmul_precision="n/a",
        deterministic=False,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        engine="llamacpp",
        engine_version=f"llama-cpp-python {PINNED_VERSION}",
        engine_build=(
            f"cpu; n_ctx=n_batch=n_ubatch={LLAMACPP_N_CTX}; n_threads=n_threads_batch={runtime.threads};"
            f" cache={runtime.precision}; flash_attn=off; extra_bufts=off; weights as in the GGUF"
        ),
    )
    return engine


def gguf_tokenizer(gguf: str | Path) -> tuple[LlamaCppTokenizer, int]:
    """The GGUF's own tokenizer and the context a prompt must fit, from a small context (no cache work)."""
    engine = LlamaCppEngine(gguf, EngineSettings("fp16", 1, 1, 8))
    return engine.tokenizer, min(engine.context_length or LLAMACPP_N_CTX, LLAMACPP_N_CTX)
