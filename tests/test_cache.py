"""Caches are built from the model's config, and models whose layers are not all full attention are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.cache_utils import DynamicLayer

from stagereplay.engines.transformers.engine import ModelError, Runtime, TransformersEngine, load_model
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState

PROMPT = [257, 10, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 258, 10]
RUNTIME = Runtime(precision="fp32", device="cpu", threads=1)


def edited_copy(source, destination, **changes):
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    config.update(changes)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


@pytest.mark.parametrize(
    "changes,layer",
    [
        # Qwen2's own switch (layer_types derived from it): layers from max_window_layers on use the window.
        (
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
            "layer 1: sliding_attention",
        ),
        (
            {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
            "layer 0: sliding_attention",
        ),
    ],
)
def test_a_sliding_window_model_is_refused_at_load_before_its_weights_are_read(
    tiny_qwen2_folder, tmp_path, changes, layer
):
    folder = edited_copy(tiny_qwen2_folder, tmp_path / "sliding", **changes)
    # Unreadable weights: a refusal that came after reading them would be a safetensors error instead.
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError) as refused:
        load_model(folder, RUNTIME)
    message = str(refused.value)
    assert "\n" not in message and str(folder) in message and layer in message
    assert "1 of 2 layers are not full attention" in message and "use_sliding_window false" in message


def test_a_window_that_covers_no_layer_is_full_attention(tiny_qwen2_folder, tmp_path):
    """Qwen2 applies the window only from max_window_layers on: with both layers below it, nothing slides."""
    folder = edited_copy(
        tiny_qwen2_folder,
        tmp_path / "unused",
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=2,
        layer_types=None,
    )
    loaded = load_model(folder, RUNTIME)
    assert loaded.model.config.layer_types == ["full_attention", "full_attention"]


def test_a_cache_for_a_sliding_model_built_outside_load_model_is_refused(tiny_fp32):
    config = Qwen2Config(
        **{
            **tiny_fp32.model.config.to_dict(),
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 0,
            "layer_types": None,
        }
    )
    engine = TransformersEngine(Qwen2ForCausalLM(config), tiny_fp32.tokenizer, tiny_fp32.environment)
    with pytest.raises(ValueError, match="2 of 2 layers are not full attention"):
        engine.empty_cache()


def test_caches_are_built_from_the_model_config(tiny_fp32):
    engine = tiny_fp32
    layers = engine.model.config.num_hidden_layers
    empty = engine.empty_cache()
    # Built from the config, not grown lazily by the first forward.
    assert len(empty.layers) == layers and all(type(layer) is DynamicLayer for layer in empty.layers)
    with torch.inference_mode():
        engine.forward(PROMPT, empty)
    state = engine.snapshot(empty)
    rebuilt = engine.to_cache(state)
    assert len(rebuilt.layers) == layers and all(type(layer) is DynamicLayer for layer in rebuilt.layers)
    assert rebuilt.get_seq_length() == len(PROMPT)
    assert fingerprint_cache(engine.snapshot(rebuilt)) == fingerprint_cache(state)
    # A copy: feeding the rebuilt cache leaves the state it came from as it was.
    with torch.inference_mode():
        engine.forward([PROMPT[-1]], rebuilt)
    assert rebuilt.get_seq_length() == len(PROMPT) + 1 and state.num_positions == len(PROMPT)


def test_a_state_of_another_depth_is_refused(tiny_fp32):
    with torch.inference_mode():
        cache = tiny_fp32.empty_cache()
        tiny_fp32.forward(PROMPT, cache)
    state = tiny_fp32.snapshot(cache)
    one_layer = KVState(state.keys[:1], state.values[:1])
    with pytest.raises(ModelError, match="cache of 1 layers cannot feed a model of 2 layers"):
        tiny_fp32.to_cache(one_layer)
