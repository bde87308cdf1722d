"""Boundary K/V caches: the one module that touches the transformers cache API.

transformers changes its cache classes and keyword names between releases
(verified in 5.24.0: Qwen2's forward takes ``cache``, and ``past_key_values`` is
a deprecated alias to be removed in 5.40), so every call that builds, reads or
feeds a cache goes through here. Everything else sees a ``KVState``: plain
per-layer key and value tensors.

Caches are built from the model's config, so each layer gets the cache class
the model expects. Only models whose every layer is full attention are
accepted (``check_full_attention``): a sliding-window or recurrent layer keeps
less than every position, so a boundary cache, a last-W transplant or a cache
difference would mean something else there.

A second engine (llama.cpp, ``llamacpp_engine``) plugs in here: a model that is an
``ExternalEngine`` answers the same four calls itself (``empty_cache``,
``forward``, ``snapshot``, ``to_cache``), so everything above this module runs
unchanged on either engine.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from stagereplay.design.names import TransplantError


@dataclass(frozen=True)
class KVState:
    """Per-layer keys and values, each shaped [batch, kv_heads, positions, head_dim]."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_positions(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Names sort into layer order (zero-padded), K before V."""
        named: dict[str, torch.Tensor] = {}
        for index, (key, value) in enumerate(zip(self.keys, self.values)):
            named[f"layer.{index:03d}.k"] = key
            named[f"layer.{index:03d}.v"] = value
        return named

    @classmethod
    def from_named_tensors(cls, named: dict[str, torch.Tensor]) -> KVState:
        layers = sorted({name.split(".")[1] for name in named})
        return cls(
            keys=tuple(named[f"layer.{layer}.k"] for layer in layers),
            values=tuple(named[f"layer.{layer}.v"] for layer in layers),
        )


class ExternalEngine:
    """A non-transformers engine: it builds, feeds, reads and writes its own caches as ``KVState``s."""

    def empty_cache(self) -> ExternalCache:
        raise NotImplementedError

    def forward(self, tokens: list[int], cache: ExternalCache) -> torch.Tensor:
        raise NotImplementedError

    def snapshot(self, cache: ExternalCache) -> KVState:
        raise NotImplementedError

    def to_cache(self, state: KVState) -> ExternalCache:
        raise NotImplementedError


class ExternalCache:
    """A cache an ``ExternalEngine`` holds; ``engine`` reads it back."""

    engine: ExternalEngine


@functools.cache
def _cache_keyword(model_class: type) -> str:
    # Built-in models take ``cache``; a trust_remote_code model may still name only ``past_key_values``.
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def unsupported_attention(config, name: str) -> str | None:
    """One line refusing a model whose layers are not all full attention, or None when they all are.

    Asks DynamicCache itself which cache class each layer gets, so the check follows transformers'
    own reading of the config (``layer_types``, ``sliding_window``, ``attention_chunk_size``, ...).
    """
    layers = DynamicCache(config=config).layers
    other = [index for index, layer in enumerate(layers) if type(layer) is not DynamicLayer]
    if layers and not other:
        return None
    if not layers:
        found = "no attention layers in its config"
    else:
        layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None) or []
        first = other[0]
        kind = layer_types[first] if first < len(layer_types) else type(layers[first]).__name__
        found = f"{len(other)} of {len(layers)} layers are not full attention (layer {first}: {kind})"
    return (
        f"model {name}: {found} — stage replay needs every position cached in every layer; use a model whose"
        " layers are all full attention (Qwen2/Mistral-style configs: use_sliding_window false, sliding_window null)"
    )


def empty_cache(model) -> DynamicCache | ExternalCache:
    """An empty cache with the layer classes ``model``'s config asks for."""
    if isinstance(model, ExternalEngine):
        return model.empty_cache()
    cache = DynamicCache(config=model.config)
    # load_model refuses such models first; this guards a model built any other way (a test, a notebook).
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(
            unsupported_attention(model.config, getattr(model.config, "name_or_path", "") or type(model).__name__)
        )
    return cache


def forward(model, input_ids: torch.Tensor, cache: DynamicCache | ExternalCache) -> torch.Tensor:
    """Feed ``input_ids`` [1, n] through the model, appending to ``cache``.

    Returns the float32 logits of the last position. ``logits_to_keep=1`` is
    used on every call, so the lm_head always sees the same shape.
    """
    if isinstance(model, ExternalEngine):
        return model.forward(input_ids[0].tolist(), cache)
    keyword = _cache_keyword(type(model))
    output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{keyword: cache})
    return output.logits[0, -1].float()


def snapshot(cache: DynamicCache | ExternalCache) -> KVState:
    """A detached copy of the cache as it stands now (later decoding never changes it)."""
    if isinstance(cache, ExternalCache):
        return cache.engine.snapshot(cache)
    layers = cache.layers
    return KVState(
        keys=tuple(layer.keys.detach().clone() for layer in layers),
        values=tuple(layer.values.detach().clone() for layer in layers),
    )


def to_cache(state: KVState, model) -> DynamicCache | ExternalCache:
    """A fresh cache for ``model`` holding copies of ``state`` (decoding from it leaves ``state`` intact)."""
    if isinstance(model, ExternalEngine):
        return model.to_cache(state)
    cache = empty_cache(model)
    if state.num_layers != len(cache.layers):
        raise TransplantError(
            f"a cache of {state.num_layers} layers cannot feed a model of {len(cache.layers)} layers — continue a state only on the model that built it"
        )
    device = next(model.parameters()).device
    for index, (key, value) in enumerate(zip(state.keys, state.values)):
        # DynamicLayer.update concatenates onto an empty tensor, so the cache holds a copy, never ``state`` itself.
        cache.update(key.to(device), value.to(device), index)
    return cache


def to_host(state: KVState) -> KVState:
    """Copy to CPU for saving; a no-op for CPU tensors."""
    return KVState(
        keys=tuple(key.cpu() for key in state.keys),
        values=tuple(value.cpu() for value in state.values),
    )
