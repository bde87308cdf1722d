"""Which engine runs a checkpoint: transformers (a safetensors folder) or llama.cpp (a GGUF as shipped).

A model record names its engine (``engine``; absent means transformers). Every
model job loads through ``load_checkpoint`` and gets the same ``LoadedModel``:
a model the four calls of ``cache.py`` accept, a tokenizer answering the calls
the shared code makes, and the environment recorded in every ledger row.
"""

from __future__ import annotations

import types

from stagereplay.engines.transformers_model import Environment, LoadedModel, ModelError, Runtime, cpu_model, load_model

ENGINES = ("transformers", "llamacpp")
LLAMACPP_PRECISIONS = ("fp16", "fp32")  # llama.cpp cache types; the weights stay as the GGUF holds them
# One context size for every llama.cpp job: a prefix is one micro-batch of at most this many tokens.
LLAMACPP_N_CTX = 2048


def engine_of(record: dict) -> str:
    engine = record.get("engine", "transformers")
    if engine not in ENGINES:
        raise ModelError(f"model record names engine {engine!r} — use one of {', '.join(ENGINES)}")
    return engine


def load_checkpoint(record: dict, runtime: Runtime) -> LoadedModel:
    if engine_of(record) == "transformers":
        return load_model(record["folder"], runtime)
    return _load_llamacpp(record, runtime)


def _load_llamacpp(record: dict, runtime: Runtime) -> LoadedModel:
    import torch
    import transformers

    from stagereplay.engines.llamacpp_engine import PINNED_VERSION, EngineSettings, LlamaCppEngine, build_info

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
    engine = LlamaCppEngine(record["gguf"], settings)
    # shards.eos_ids reads a generation config: llama.cpp's end-of-generation tokens are its EOS.
    engine.generation_config = types.SimpleNamespace(eos_token_id=sorted(engine.eos_ids))
    environment = Environment(
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
    return LoadedModel(model=engine, tokenizer=engine.tokenizer, environment=environment)


def checkpoint_tokenizer(record: dict, trust_remote_code: bool = False) -> tuple[object, int]:
    """The checkpoint's own tokenizer and the context a prompt must fit (0: unknown)."""
    if engine_of(record) == "transformers":
        from transformers import AutoConfig, AutoTokenizer

        folder = record["folder"]
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        return tokenizer, int(getattr(config.get_text_config(), "max_position_embeddings", 0) or 0)
    from stagereplay.engines.llamacpp_engine import EngineSettings, LlamaCppEngine

    engine = LlamaCppEngine(record["gguf"], EngineSettings("fp16", 1, 1, 8))
    return engine.tokenizer, min(engine.context_length or LLAMACPP_N_CTX, LLAMACPP_N_CTX)


def model_layers(model) -> int:
    geometry = getattr(model, "geometry", None)
    if geometry is not None:
        return geometry.n_layer
    return model.config.get_text_config().num_hidden_layers
