"""A model's shapes from its config.json, without loading it, and the device memory one model job needs.

No torch: the workflow declares each model job's memory from these figures when it parses the
config, and the transformers engine checks the same figure before it reads any weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from stagereplay.engines.registry import precision_spec
from stagereplay.engines.spec import SpecError

# Where the published config.json shapes of known models lie (the embedded default among them): package data.
MODEL_CONFIGS = Path(str(files("stagereplay.resources") / "model_configs"))
EMBEDDED_CONFIG = "smollm2-135m-instruct"


class PlanError(ValueError):
    """One-line message naming the problem and the fix."""


@dataclass(frozen=True)
class ModelShapes:
    """What the byte counts need from a model's config.json."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    context: int = 0

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> ModelShapes:
        text = config.get("text_config") or config  # multimodal configs nest the language model's
        try:
            heads = int(text["num_attention_heads"])
            hidden = int(text["hidden_size"])
            return cls(
                layers=int(text["num_hidden_layers"]),
                kv_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                hidden=hidden,
                heads=heads,
                intermediate=int(text.get("intermediate_size") or 4 * hidden),
                vocab=int(text.get("vocab_size") or 0),
                tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
                # Qwen2 always has q/k/v biases; Llama-style configs say so in attention_bias.
                qkv_bias=text.get("model_type") == "qwen2" or bool(text.get("attention_bias", False)),
                context=int(text.get("max_position_embeddings") or 0),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise PlanError(
                f"{source} lacks the model shape ({error}) — give a Hugging Face config.json with num_hidden_layers, num_attention_heads and hidden_size"
            ) from None

    def kv_bytes_per_position(self, precision: str) -> int:
        """K and V of every layer for one position: what a boundary cache stores per position."""
        return self.layers * self.kv_heads * sum(head_bytes(precision, part, self.head_dim) for part in "kv")

    def parameters(self) -> int:
        kv = self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        if self.qkv_bias:
            attention += q + 2 * kv
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * layer + embeddings + self.hidden


def head_bytes(precision: str, part: str, head_dim: int) -> int:
    """Bytes of one head's K (``part`` "k") or V ("v") at one position, as a cache at ``precision`` holds
    them (the engine that takes the precision counts them: plain values, or ggml blocks for q8_0 and q4_0)."""
    try:
        return precision_spec(precision).head_bytes(precision, part, head_dim)
    except SpecError as error:
        raise PlanError(str(error)) from None


def weight_bytes(precision: str) -> int:
    """Bytes per weight of a job at ``precision`` (a cache type counts the GGUF's weights at fp16 width)."""
    try:
        return precision_spec(precision).weight_bytes(precision)
    except SpecError as error:
        raise PlanError(str(error)) from None


def stored_part(precision: str, part: str, head_dim: int, rotation: bool) -> tuple[str, str, int]:
    """One layer's K or V as the store holds it (the name's suffix, the dtype, the last dimension)."""
    try:
        return precision_spec(precision).stored_part(precision, part, head_dim, rotation)
    except SpecError as error:
        raise PlanError(str(error)) from None


def random_qwen2_shapes(layers: int, hidden: int, near_ties: bool) -> ModelShapes:
    """The shapes checkpoints.build_random_qwen2 builds: a byte-level vocabulary (256 bytes and 3
    ChatML specials), 4 query and 2 KV heads, an MLP twice the hidden size, the head untied with
    near ties. tests/test_storage_plan.py holds this against a real ledger."""
    return ModelShapes(
        layers=layers,
        kv_heads=2,
        head_dim=hidden // 4,
        hidden=hidden,
        heads=4,
        intermediate=2 * hidden,
        vocab=259,
        tied=not near_ties,
        qkv_bias=True,
        context=4096,
    )


def read_model_config(path_or_name: str | Path) -> tuple[ModelShapes, str]:
    """A config.json path, a model folder, or the name of a file under MODEL_CONFIGS (stagereplay/resources/model_configs)."""
    path = Path(path_or_name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        known = MODEL_CONFIGS / f"{path_or_name}.json"
        if not known.is_file():
            names = ", ".join(sorted(p.stem for p in MODEL_CONFIGS.glob("*.json")))
            raise PlanError(
                f"model config {path_or_name} not found — give a config.json path, a model folder or one of: {names}"
            )
        path = known
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PlanError(
            f"model config {path} is not readable JSON ({error}) — give a Hugging Face config.json"
        ) from None
    return ModelShapes.from_config(config, str(path)), str(path)


def checkpoint_shapes(spec: dict, model_folder: str | Path | None = None) -> ModelShapes | None:
    """A checkpoint's shapes without loading it: a random Qwen2 from its seed spec, the embedded
    model from its published config, any folder (a user's or one converted earlier) from its
    config.json. None when only the converted model would tell (a GGUF not converted yet)."""
    if "random_qwen2" in spec:
        random_spec = spec["random_qwen2"]
        return random_qwen2_shapes(
            random_spec.get("layers", 2), random_spec.get("hidden", 64), random_spec.get("near_ties", False)
        )
    if model_folder is not None and Path(model_folder, "config.json").is_file():
        return read_model_config(model_folder)[0]
    if spec.get("embedded"):
        return read_model_config(EMBEDDED_CONFIG)[0]
    return None


# --- device memory of one model job ------------------------------------------------------------------

# CUDA context, allocator slack and the framework's own buffers, besides weights and caches.
_DEVICE_OVERHEAD_BYTES = 1 << 30


def job_memory_bytes(shapes: ModelShapes, precision: str, max_positions: int) -> int:
    """Device memory one model job needs: the weights at its precision, four caches at the longest
    boundary plus suffix (a transplant job holds donor, recipient, the transplanted cache and the
    one it continues), the activations of a one-shot prefill of that length (MLP and attention
    scores in fp32, the score matrix of the math kernel being the largest) and a fixed overhead."""
    weights = shapes.parameters() * weight_bytes(precision)
    caches = 4 * shapes.kv_bytes_per_position(precision) * max_positions
    activations = max_positions * (4 * shapes.hidden + 2 * shapes.intermediate) * 4
    activations += shapes.heads * max_positions * max_positions * 4
    activations += max_positions * shapes.vocab * 4 if max_positions else 0  # logits of the prefill
    return weights + caches + activations + _DEVICE_OVERHEAD_BYTES


def available_host_memory_bytes() -> int:
    """The host's available RAM (a CPU job's device memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
