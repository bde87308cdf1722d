"""The transformers engine: a Hugging Face model folder loaded at a precision, on a device, with a fixed runtime.

Bit-exact replicas depend on everything that changes the order of floating
point operations: dtype, device, intra-op thread count, attention kernel and,
on CUDA, TF32 and cuBLAS determinism. All of it is set here from explicit
arguments and returned as a record that goes into every ledger row.

This is the one module that touches the transformers cache API. Caches are built
from the model's config, so each layer gets the cache class the model expects.
Only models whose every layer is full attention are accepted
(``unsupported_attention``): a sliding-window or recurrent layer keeps less than
every position, so a boundary cache, a last-W transplant or a cache difference
would mean something else there.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from stagereplay.engines.base import Engine, Environment, ModelError, Runtime
from stagereplay.engines.cpuinfo import cpu_model
from stagereplay.engines.transformers.spec import ATTENTION_LEVELS, RUN_ATTENTION
from stagereplay.ledger.kvstate import KVState

PRECISIONS: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


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


class TransformersEngine(Engine):
    """A Hugging Face causal LM with its tokenizer: caches are ``DynamicCache``s built from its config.

    transformers changes its cache classes and keyword names between releases (verified in
    5.24.0: Qwen2's forward takes ``cache``, and ``past_key_values`` is a deprecated alias to be
    removed in 5.40), so every call that builds, reads or feeds a cache is a method here.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, environment: Environment):
        self.model = model
        self.tokenizer = tokenizer
        self.environment = environment
        self.device = next(model.parameters()).device

    @classmethod
    def checkpoint_tokenizer(cls, record: dict, trust_remote_code: bool = False) -> tuple[object, int]:
        from transformers import AutoConfig, AutoTokenizer

        folder = record["folder"]
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        return tokenizer, int(getattr(config.get_text_config(), "max_position_embeddings", 0) or 0)

    @classmethod
    def load(cls, record: dict, runtime: Runtime) -> TransformersEngine:
        """The record's safetensors folder (``folder``)."""
        return load_model(record["folder"], runtime)

    @property
    def eos_ids(self) -> frozenset[int]:
        ids = {self.tokenizer.eos_token_id}
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(configured if isinstance(configured, list) else [configured])
        return frozenset(i for i in ids if i is not None)

    @property
    def num_layers(self) -> int:
        return self.model.config.get_text_config().num_hidden_layers

    def empty_cache(self) -> DynamicCache:
        """An empty cache with the layer classes the model's config asks for."""
        cache = DynamicCache(config=self.model.config)
        # load_model refuses such models first; this guards a model built any other way (a test, a notebook).
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            config = self.model.config
            raise ValueError(
                unsupported_attention(config, getattr(config, "name_or_path", "") or type(self.model).__name__)
            )
        return cache

    def forward(self, tokens: list[int], cache: DynamicCache) -> torch.Tensor:
        """Feed ``tokens`` [1, n] through the model, appending to ``cache``.

        Returns the float32 logits of the last position. ``logits_to_keep=1`` is
        used on every call, so the lm_head always sees the same shape.
        """
        input_ids = torch.tensor([list(tokens)], device=self.device)
        self.fed_positions += input_ids.numel()
        keyword = _cache_keyword(type(self.model))
        with torch.inference_mode():
            output = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{keyword: cache})
        return output.logits[0, -1].float()

    def snapshot(self, cache: DynamicCache) -> KVState:
        layers = cache.layers
        return KVState(
            keys=tuple(layer.keys.detach().clone() for layer in layers),
            values=tuple(layer.values.detach().clone() for layer in layers),
        )

    def to_cache(self, state: KVState) -> DynamicCache:
        state = self.placed(state)
        cache = self.empty_cache()
        if state.num_layers != len(cache.layers):
            raise ModelError(
                f"a cache of {state.num_layers} layers cannot feed a model of {len(cache.layers)} layers — continue a state only on the model that built it"
            )
        for index, (key, value) in enumerate(zip(state.keys, state.values)):
            # DynamicLayer.update concatenates onto an empty tensor, so the cache holds a copy, never ``state`` itself.
            cache.update(key, value, index)
        return cache

    def use_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def use_attention(self, implementation: str) -> None:
        if implementation not in ATTENTION_LEVELS:
            raise ModelError(
                f"unknown attention implementation {implementation!r} — use one of {', '.join(ATTENTION_LEVELS)}"
            )
        try:
            self.model.set_attn_implementation(implementation)
        except (ImportError, ValueError) as error:
            raise ModelError(f"attention {implementation} is not available here ({error})") from None

    def batch_forward(self, batch: _Batch | None, rows: list[list[int]]) -> tuple[_Batch, torch.Tensor]:
        """Left padding, an attention mask and per-row position ids, as a batched server feeds them."""
        if batch is None:
            batch = _Batch(self.empty_cache(), torch.zeros(len(rows), 0, dtype=torch.long, device=self.device))
        width = max(len(row) for row in rows)
        if batch.mask.shape[1] and any(len(row) != width for row in rows):
            raise ValueError("rows fed after a batch's first call must be of one length (no padding between tokens)")
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=self.device)
        new = torch.zeros(len(rows), width, dtype=torch.long, device=self.device)
        for index, row in enumerate(rows):
            ids[index, width - len(row) :] = torch.tensor(row, device=self.device)
            new[index, width - len(row) :] = 1
        mask = torch.cat([batch.mask, new], dim=1)
        # A padded slot's position is never attended; a real token's position counts only real tokens.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        self.fed_positions += ids.numel()
        keyword = _cache_keyword(type(self.model))
        with torch.inference_mode():
            output = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{keyword: batch.cache},
            )
        return _Batch(batch.cache, mask), output.logits[:, -1].float()

    def batch_of(self, states: list[KVState]) -> _Batch:
        # Each state moved before stacking: E6 batches the item's state read from the store (CPU) with
        # companions this engine built (its device); stacking them as they come fails on CUDA.
        states = [self.placed(state) for state in states]
        width = max(state.num_positions for state in states)
        cache = self.empty_cache()
        mask = torch.zeros(len(states), width, dtype=torch.long, device=self.device)
        for index, state in enumerate(states):
            mask[index, width - state.num_positions :] = 1
        for layer in range(states[0].num_layers):
            keys, values = (
                torch.stack([_left_pad(getattr(state, part)[layer][0], width) for state in states])
                for part in ("keys", "values")
            )
            cache.update(keys, values, layer)
        return _Batch(cache, mask)

    def batch_row(self, batch: _Batch, row: int) -> KVState:
        # Left padding only: a row's real positions are the last ones.
        start = batch.mask.shape[1] - int(batch.mask[row].sum())
        layers = batch.cache.layers
        return KVState(
            keys=tuple(layer.keys[row : row + 1, :, start:, :].detach().clone() for layer in layers),
            values=tuple(layer.values[row : row + 1, :, start:, :].detach().clone() for layer in layers),
        )


@dataclass
class _Batch:
    """A batched cache and its attention mask [rows, positions] (1 where a position holds a token)."""

    cache: DynamicCache
    mask: torch.Tensor


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """[heads, positions, dim] padded with zeros on the left to ``width`` positions (masked, never read)."""
    pad = width - tensor.shape[-2]
    return torch.nn.functional.pad(tensor, (0, 0, pad, 0)) if pad else tensor


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError(
            "device 'cuda' requested but torch sees no CUDA device — set device: cpu (or auto) in the config"
        )
    if device not in ("cpu", "cuda"):
        raise ModelError(f"unknown device {device!r} — use cpu, cuda or auto")
    return device


def configure_runtime(runtime: Runtime) -> Environment:
    """Fix threads and kernels before the model is built; return the record of it."""
    if runtime.precision not in PRECISIONS:
        raise ModelError(f"unknown precision {runtime.precision!r} — use one of {', '.join(PRECISIONS)}")
    if runtime.attn_implementation not in RUN_ATTENTION:
        raise ModelError(
            f"unknown attention implementation {runtime.attn_implementation!r} — use one of {', '.join(RUN_ATTENTION)}"
        )
    if runtime.threads < 1:
        raise ModelError(f"threads must be >= 1, got {runtime.threads} — set threads in the config")
    device = resolve_device(runtime.device)
    torch.set_num_threads(runtime.threads)
    if device == "cuda":
        # cuBLAS needs a fixed workspace to give run-to-run identical GEMMs.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if runtime.precision == "fp16" and torch.cuda.get_device_capability()[0] < 6:
            raise ModelError("fp16 needs a CUDA device of compute capability 6.0 or newer — drop fp16 from precisions")
        _disable_tf32()
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=False)
        device_name = torch.cuda.get_device_name()
    else:
        device_name = cpu_model()
    _check_precision_runs(device, runtime.precision)
    matmul = torch.backends.cuda.matmul
    return Environment(
        device=device,
        device_name=device_name,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        precision=runtime.precision,
        threads=runtime.threads,
        attn_implementation=runtime.attn_implementation,
        tf32=device == "cuda" and tf32_enabled(),
        bf16_reduced_precision_reduction=bool(matmul.allow_bf16_reduced_precision_reduction),
        fp16_reduced_precision_reduction=bool(matmul.allow_fp16_reduced_precision_reduction),
        sdpa_backends=sdpa_backends(),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        engine="transformers",
        engine_version=transformers.__version__,
    )


def sdpa_backends() -> str:
    """The scaled-dot-product-attention kernels torch may choose from, read back now."""
    cuda = torch.backends.cuda
    enabled = {
        "flash": cuda.flash_sdp_enabled(),
        "mem_efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
        "cudnn": cuda.cudnn_sdp_enabled(),
    }
    return ",".join(name for name, on in enabled.items() if on) or "none"


def _disable_tf32() -> None:
    """TF32 silently rounds fp32 matmuls to 10-bit mantissas: the fp32 arm would not be fp32."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        # torch >= 2.9: once the new per-backend settings are used anywhere, the legacy
        # allow_tf32 flags raise on reading, so set (and later read) only the new ones.
        matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
    else:
        matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def tf32_enabled() -> bool:
    """Read back, not assumed: whether fp32 CUDA matmuls or convolutions may use TF32 now."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        # "none" inherits a default that may be TF32: only an explicit "ieee" counts as off.
        settings = (
            matmul.fp32_precision,
            torch.backends.cudnn.conv.fp32_precision,
            torch.backends.cudnn.rnn.fp32_precision,
        )
        return any(setting != "ieee" for setting in settings)
    return bool(matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


def _check_precision_runs(device: str, precision: str) -> None:
    """A tiny matmul in the requested dtype: fails fast, before the model is loaded."""
    dtype = PRECISIONS[precision]
    try:
        probe = torch.ones(4, 4, dtype=dtype, device=device)
        (probe @ probe).sum().item()
        if device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise RuntimeError("bf16 unsupported")
    except (RuntimeError, TypeError) as error:
        raise ModelError(
            f"precision {precision} cannot run on device {device} ({error}) — drop {precision} from the precisions in the config"
        ) from None


def check_fits(config: dict, runtime: Runtime, device: str) -> None:
    """Stop before the weights are read when the job cannot fit the device: one line now, not an
    out-of-memory error an hour in. Needed: weights at the precision plus caches and activations
    (engines.shapes.job_memory_bytes, the figure the workflow declares as gpu_mem_mb); available: the
    device's free memory (CUDA) or the host's available RAM, capped by runtime.device_memory_gb."""
    from stagereplay.engines.shapes import ModelShapes, PlanError, available_host_memory_bytes, job_memory_bytes

    try:
        shapes = ModelShapes.from_config(config)
    except PlanError:
        return  # an architecture whose shapes we cannot read: nothing to check against
    needed = job_memory_bytes(shapes, runtime.precision, runtime.max_positions)
    available = int(torch.cuda.mem_get_info()[0]) if device == "cuda" else available_host_memory_bytes()
    limit = "free"
    if runtime.device_memory_gb is not None and runtime.device_memory_gb * 1e9 < available:
        available, limit = int(runtime.device_memory_gb * 1e9), "runtime.device_memory_gb"
    if needed > available:
        raise ModelError(
            f"the model needs {needed / 1e9:.2f} GB on {device} at {runtime.precision} ({runtime.max_positions} positions)"
            f" but {available / 1e9:.2f} GB are available ({limit}) — use a larger device, a lower precision or"
            " shorter token budgets, or raise runtime.device_memory_gb"
        )


def load_model(folder: str | Path, runtime: Runtime) -> TransformersEngine:
    """Load a Hugging Face model folder (weights, config, tokenizer) at ``runtime``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"model folder {folder} has no config.json — point the checkpoint at a Hugging Face model folder"
        )
    if not any(folder.glob("*.safetensors")):
        raise ModelError(
            f"model folder {folder} holds no .safetensors weights — convert it to safetensors (pickle weights are never loaded)"
        )
    environment = configure_runtime(runtime)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=runtime.trust_remote_code)
    refusal = unsupported_attention(config, str(folder))
    if refusal:  # before the weights are read: the job stops before any work
        raise ModelError(refusal)
    check_fits(config.to_dict(), runtime, environment.device)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=runtime.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        config=config,
        dtype=PRECISIONS[runtime.precision],
        attn_implementation=runtime.attn_implementation,
        trust_remote_code=runtime.trust_remote_code,
        use_safetensors=True,  # never unpickle weights: a .bin file can run arbitrary code
        # On CUDA the weights go straight to the device: a 14B model in fp32 would
        # otherwise pass through ~56 GB of host memory first.
        device_map=environment.device if environment.device == "cuda" else None,
    )
    model.to(environment.device).eval()
    model.requires_grad_(False)
    return TransformersEngine(model, tokenizer, environment)
