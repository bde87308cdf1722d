"""Boundary K/V caches: the one module that touches the transformers cache API.

transformers changes its cache classes and keyword names between releases
(5.x renamed the forward keyword ``past_key_values`` to ``cache``), so every
call that builds, reads or feeds a cache goes through here. Everything else
sees a ``KVState``: plain per-layer key and value tensors.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import DynamicCache

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
    def from_named_tensors(cls, named: dict[str, torch.Tensor]) -> "KVState":
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


@lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def empty_cache() -> DynamicCache:
    return DynamicCache()


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


def to_cache(state: KVState, device: torch.device | str | None = None) -> DynamicCache:
    """A fresh DynamicCache holding copies of ``state`` (decoding from it leaves ``state`` intact)."""
    pairs = [
        (key.to(device).clone() if device is not None else key.clone(),
         value.to(device).clone() if device is not None else value.clone())
        for key, value in zip(state.keys, state.values)
    ]
    return DynamicCache(pairs)


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
