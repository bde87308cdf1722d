"""Both engines implement the one protocol (engines.base.Engine), loaded from a model record as the jobs load them.

The transformers engine runs the tiny random Qwen2 built by conftest; the llama.cpp engine runs
the same weights written as a GGUF (inputs.tiny_gguf). Each is driven only through the protocol:
load at a precision, chat template, empty cache, forward, export and import of the K/V, generation
settings and the environment record. Without the llama_cpp binding the llama.cpp case skips with
the reason (STAGEREPLAY_REQUIRE_LLAMACPP=1 fails it instead, as in test_llamacpp).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from workflow_helpers import skip_unless_required

from stagereplay.engines.base import Engine, Environment, ModelError, Runtime
from stagereplay.engines.registry import engine_class, load_checkpoint
from stagereplay.experiments.prompts import encode_prompt
from stagereplay.inputs.items import Item
from stagereplay.inputs.tiny_gguf import write_qwen2_gguf
from stagereplay.ledger.kvstate import KVState

ITEM = Item("engines-1", "Which letter follows B?", ("A", "C", "D", "E"), "B", "test")


def _llamacpp_problem() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama_cpp not importable ({error}); install it with pip install -e .[llamacpp]"
    return None


@pytest.fixture(scope="module", params=["transformers", "llamacpp"])
def engine(request, tiny_qwen2_folder, tmp_path_factory):
    if request.param == "transformers":
        record = {"folder": str(tiny_qwen2_folder)}
    else:
        skip_unless_required(_llamacpp_problem(), "STAGEREPLAY_REQUIRE_LLAMACPP")
        gguf = write_qwen2_gguf(tiny_qwen2_folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
        record = {"engine": "llamacpp", "gguf": str(gguf)}
    engine = load_checkpoint(record, Runtime(precision="fp32", device="cpu", threads=1))
    yield request.param, engine
    engine.close()


def test_the_protocol_has_no_unimplemented_member():
    # An engine class that left out a protocol method could not be instantiated; this names the gap instead.
    for record in ({"folder": "unused"}, {"engine": "llamacpp", "gguf": "unused"}):
        try:
            cls = engine_class(record)
        except ImportError as error:  # the llama.cpp module needs its binding
            skip_unless_required(f"{error}", "STAGEREPLAY_REQUIRE_LLAMACPP")
            continue
        assert issubclass(cls, Engine)
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unimplemented"


def test_an_unknown_engine_is_one_line_naming_the_engines():
    with pytest.raises(ModelError, match=r"engine 'vllm' — use one of transformers, llamacpp"):
        engine_class({"engine": "vllm"})


def test_an_engine_loads_at_a_precision_and_records_its_environment(engine):
    name, engine = engine
    assert isinstance(engine, Engine)
    assert isinstance(engine.environment, Environment)
    assert engine.environment.engine == name
    assert (engine.environment.precision, engine.environment.device, engine.environment.threads) == ("fp32", "cpu", 1)
    assert engine.environment.engine_version


def test_an_engine_states_its_generation_settings(engine):
    _, engine = engine
    assert engine.num_layers == 2  # conftest's tiny Qwen2
    assert isinstance(engine.eos_ids, frozenset) and engine.eos_ids
    assert engine.tokenizer.eos_token_id in engine.eos_ids


def test_an_engine_feeds_tokens_and_exports_and_imports_its_cache(engine):
    _, engine = engine
    # The prompt as the prompts job encodes it, through the engine's tokenizer and chat template.
    prompt = encode_prompt(engine.tokenizer, ITEM, use_chat_template=True)
    assert len(prompt) > 2 and all(isinstance(token, int) for token in prompt)

    cache = engine.empty_cache()
    logits = engine.forward(prompt[:-1], cache)
    assert logits.dtype == torch.float32 and logits.dim() == 1

    state = engine.snapshot(cache)
    assert isinstance(state, KVState)
    assert state.num_layers == engine.num_layers
    assert state.num_positions == len(prompt) - 1
    kept = [key.clone() for key in state.keys]

    # Later decoding leaves the exported state as it was.
    continued = engine.forward(prompt[-1:], cache)
    assert engine.snapshot(cache).num_positions == len(prompt)
    assert all(torch.equal(key, before) for key, before in zip(state.keys, kept))
    # The imported copy continues exactly as the cache it was exported from (a llama.cpp engine holds one
    # sequence, so the original cache is done with before the import starts another).
    assert torch.equal(engine.forward(prompt[-1:], engine.to_cache(state)), continued)
