"""Which engine runs a checkpoint: transformers (a safetensors folder) or llama.cpp (a GGUF as shipped).

A model record names its engine (``engine``; absent means transformers). Every model job loads
through ``load_checkpoint`` and gets a ``base.Engine`` (``engine_class`` says which); the prompts job asks ``checkpoint_tokenizer``
for the tokenizer alone. This is the one place that maps an engine's name to its module.
"""

from __future__ import annotations

from stagereplay.engines.base import Engine, ModelError, Runtime

ENGINES = ("transformers", "llamacpp")


def engine_of(record: dict) -> str:
    engine = record.get("engine", "transformers")
    if engine not in ENGINES:
        raise ModelError(f"model record names engine {engine!r} — use one of {', '.join(ENGINES)}")
    return engine


def engine_class(record: dict) -> type[Engine]:
    """The engine that runs the record's checkpoint (its module is imported only when asked for)."""
    if engine_of(record) == "transformers":
        from stagereplay.engines.transformers_engine import TransformersEngine

        return TransformersEngine
    from stagereplay.engines.llamacpp_engine import LlamaCppEngine

    return LlamaCppEngine


def load_checkpoint(record: dict, runtime: Runtime) -> Engine:
    return engine_class(record).load(record, runtime)


def checkpoint_tokenizer(record: dict, trust_remote_code: bool = False) -> tuple[object, int]:
    """The checkpoint's own tokenizer and the context a prompt must fit (0: unknown)."""
    if engine_of(record) == "transformers":
        from transformers import AutoConfig, AutoTokenizer

        folder = record["folder"]
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        return tokenizer, int(getattr(config.get_text_config(), "max_position_embeddings", 0) or 0)
    from stagereplay.engines.llamacpp_engine import gguf_tokenizer

    return gguf_tokenizer(record["gguf"])
