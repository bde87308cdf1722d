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
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .fingerprint import combine, fingerprint_tensor
from .plan import TransplantError


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


@dataclass(frozen=True)
class CacheFingerprint:
    keys: tuple[str, ...]  # one xxh3-128 per layer
    values: tuple[str, ...]
    digest: str  # over all layer fingerprints: the cache's object id


def fingerprint_cache(state: KVState) -> CacheFingerprint:
    keys = tuple(fingerprint_tensor(key) for key in state.keys)
    values = tuple(fingerprint_tensor(value) for value in state.values)
    # The digest is fingerprint_tensors(state.named_tensors()), combined from the layer
    # digests just computed rather than hashing every tensor a second time.
    named = dict(zip(state.named_tensors(), (digest for pair in zip(keys, values) for digest in pair)))
    return CacheFingerprint(keys=keys, values=values, digest=combine((name, named[name]) for name in sorted(named)))


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
    return (f"model {name}: {found} — stage replay needs every position cached in every layer; use a model whose"
            " layers are all full attention (Qwen2/Mistral-style configs: use_sliding_window false, sliding_window null)")


def empty_cache(model) -> DynamicCache:
    """An empty cache with the layer classes ``model``'s config asks for."""
    cache = DynamicCache(config=model.config)
    # load_model refuses such models first; this guards a model built any other way (a test, a notebook).
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(unsupported_attention(model.config, getattr(model.config, "name_or_path", "") or type(model).__name__))
    return cache


def forward(model, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Feed ``input_ids`` [1, n] through the model, appending to ``cache``.

    Returns the float32 logits of the last position. ``logits_to_keep=1`` is
    used on every call, so the lm_head always sees the same shape.
    """
    keyword = _cache_keyword(type(model))
    output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{keyword: cache})
    return output.logits[0, -1].float()


def snapshot(cache: DynamicCache) -> KVState:
    """A detached copy of the cache as it stands now (later decoding never changes it)."""
    layers = cache.layers
    return KVState(
        keys=tuple(layer.keys.detach().clone() for layer in layers),
        values=tuple(layer.values.detach().clone() for layer in layers),
    )


def to_cache(state: KVState, model) -> DynamicCache:
    """A fresh cache for ``model`` holding copies of ``state`` (decoding from it leaves ``state`` intact)."""
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


@dataclass(frozen=True)
class LayerDifference:
    """How two caches differ in one layer's keys or values."""

    max_abs: float
    mean_abs: float
    fraction_differ: float  # of elements not bit-identical


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits as integers: -0.0 differs from 0.0 and NaN equals itself, as bytes do."""
    return tensor.contiguous().view(_SAME_WIDTH_INT[tensor.element_size()])


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> LayerDifference:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare cache tensors {a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}")
    # float64 holds every bf16/fp16/fp32 value and their differences exactly.
    delta = (a.double() - b.double()).abs()
    differ = _bits(a) != _bits(b)
    return LayerDifference(
        max_abs=float(delta.max()) if delta.numel() else 0.0,
        mean_abs=float(delta.mean()) if delta.numel() else 0.0,
        fraction_differ=float(differ.double().mean()) if differ.numel() else 0.0,
    )


def cache_difference(a: KVState, b: KVState) -> tuple[tuple[LayerDifference, ...], tuple[LayerDifference, ...]]:
    """Per-layer differences of keys and of values between two boundary caches."""
    if a.num_layers != b.num_layers:
        raise ValueError(f"cannot compare caches of {a.num_layers} and {b.num_layers} layers")
    return (
        tuple(tensor_difference(x, y) for x, y in zip(a.keys, b.keys)),
        tuple(tensor_difference(x, y) for x, y in zip(a.values, b.values)),
    )


KV_PARTS = ("kv", "k", "v")


@dataclass(frozen=True)
class TransplantSpec:
    """Which part of the donor cache replaces the recipient's."""

    layers: tuple[int, ...]
    kv: str = "kv"  # "kv", "k" or "v"
    last_positions: int | None = None  # None: every position; W: the last W positions

    def label(self) -> str:
        layers = list(self.layers)
        contiguous = layers == list(range(layers[0], layers[-1] + 1)) if layers else False
        span = f"{layers[0]}-{layers[-1]}" if contiguous and len(layers) > 1 else ",".join(map(str, layers))
        positions = "all" if self.last_positions is None else f"last{self.last_positions}"
        return f"layers={span} kv={self.kv} positions={positions}"


def check_transplant(donor: KVState, recipient: KVState, spec: TransplantSpec) -> None:
    if donor.num_layers != recipient.num_layers or any(
        d.shape != r.shape for d, r in zip(donor.keys + donor.values, recipient.keys + recipient.values)
    ):
        raise TransplantError(
            "donor and recipient caches differ in layers or shapes (different models or prefixes) — transplant only between states of one checkpoint over one prefix"
        )
    if not spec.layers:
        raise TransplantError("empty layer set — name at least one layer to transplant")
    bad = [layer for layer in spec.layers if not 0 <= layer < recipient.num_layers]
    if bad:
        raise TransplantError(
            f"layer {bad[0]} out of range for a {recipient.num_layers}-layer cache — use layers 0..{recipient.num_layers - 1}"
        )
    if spec.kv not in KV_PARTS:
        raise TransplantError(f"unknown cache part {spec.kv!r} — use kv, k or v")
    if spec.last_positions is not None and not 1 <= spec.last_positions <= recipient.num_positions:
        raise TransplantError(
            f"window of {spec.last_positions} positions does not fit a prefix of {recipient.num_positions} cached positions — use 1..{recipient.num_positions}"
        )


def transplant(donor: KVState, recipient: KVState, spec: TransplantSpec) -> KVState:
    """The recipient's cache with the chosen part replaced by the donor's (cast to the recipient's dtype)."""
    check_transplant(donor, recipient, spec)
    start = 0 if spec.last_positions is None else recipient.num_positions - spec.last_positions
    keys = [tensor.clone() for tensor in recipient.keys]
    values = [tensor.clone() for tensor in recipient.values]
    for layer in spec.layers:
        if "k" in spec.kv:
            keys[layer][..., start:, :] = donor.keys[layer][..., start:, :].to(keys[layer].dtype)
        if "v" in spec.kv:
            values[layer][..., start:, :] = donor.values[layer][..., start:, :].to(values[layer].dtype)
    return KVState(tuple(keys), tuple(values))


def cast_state(state: KVState, dtype: torch.dtype) -> KVState:
    return KVState(tuple(key.to(dtype) for key in state.keys), tuple(value.to(dtype) for value in state.values))
