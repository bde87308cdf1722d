"""The transformers engine as the rest of stagereplay sees it before loading it (no torch)."""

from __future__ import annotations

from stagereplay.engines.spec import SHARED_ENVIRONMENT, ControlScope, EngineSpec, Knob, SpecError

# A precision's width in bytes: the weights' and the cache's.
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
SAFETENSORS_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
# The attention implementations a run may name (runtime.attn_implementation), and those an E6 level may switch to.
RUN_ATTENTION = ("sdpa", "eager")
ATTENTION_LEVELS = ("sdpa", "eager", "flash_attention_2")


def _attention_refusal(level: str, precision: str, flash_attn: bool) -> str | None:
    return None if level in ATTENTION_LEVELS else f"unknown level {level!r} — use {', '.join(ATTENTION_LEVELS)}"


class TransformersSpec(EngineSpec):
    def check_run(self, checkpoint, precisions, runtime):
        other = sorted(precisions - set(self.precisions))
        if other:
            raise SpecError(
                f"checkpoint {checkpoint!r} runs on transformers: {', '.join(other)} is a llama.cpp cache type — use"
                f" {self.precision_choices()} for its precisions"
            )

    def head_bytes(self, precision, part, head_dim):
        return head_dim * BYTES[precision]

    def weight_bytes(self, precision):
        return BYTES[precision]

    def stored_part(self, precision, part, head_dim, rotation):
        return "", SAFETENSORS_DTYPES[precision], head_dim


TRANSFORMERS = TransformersSpec(
    name="transformers",
    summary="a safetensors folder",
    precisions={
        "bf16": "weights and cache in bfloat16",
        "fp16": "weights and cache in float16",
        "fp32": "weights and cache in float32",
    },
    precision_pattern="bf16|fp16|fp32",
    precision_kind="weight dtype",
    checkpoint_sources=("embedded", "folder", "gguf", "random_qwen2"),
    record_kind="folder",
    factors={
        "prefix_reuse": Knob("request", "a kept cache extended by the rest of the prompt"),
        "batch": Knob("request", "a left-padded batch (attention mask, per-row positions)"),
        "attention": Knob("switch", "attn_implementation", _attention_refusal),
        "threads": Knob("switch", "torch.set_num_threads"),
        "chunk": Knob("request", "the prompt fed in chunks"),
        "kernels": Knob("worker", "ATEN_CPU_CAPABILITY"),
    },
    libraries=("torch", "transformers"),
    refused_switches={
        "flash_attn": "runtime.flash_attn is llama.cpp's flash attention — remove it, or set"
        " runtime.attn_implementation for a transformers checkpoint",
    },
    environment_fields=(
        *SHARED_ENVIRONMENT,
        "attn_implementation",
        "tf32",
        "bf16_reduced_precision_reduction",
        "fp16_reduced_precision_reduction",
        "sdpa_backends",
        "float32_matmul_precision",
        "deterministic",
        "torch_version",
        "transformers_version",
    ),
    engine_class_path="stagereplay.engines.transformers.engine:TransformersEngine",
    pads_batches=True,
    control_scopes={
        "attention": ControlScope(
            "the implementation switch (set_attn_implementation) set to the run's own around each build and read",
            "another attention kernel: the reference's kernel runs",
        ),
        "threads": ControlScope(
            "the thread switch (torch.set_num_threads) set to the run's own count around each build and read",
            "another thread count's split of the reductions",
        ),
        "chunk": ControlScope(
            "the chunker with one chunk of the whole context: the reference computation itself",
            "a chunk boundary (a later chunk attending to an earlier call's cache): it cannot fail on the chunked path",
        ),
        "prefix_reuse": ControlScope(
            "the one-shot prefill through the object store's round trip (safetensors saved, loaded back,"
            " fingerprint-checked), then continued",
            "a partial hit: nothing is prefilled on top of the loaded positions",
        ),
        "batch": ControlScope(
            "the batched path at batch 1: its attention mask, all ones, which SDPA drops, and position ids: the"
            " reference computation itself",
            "padding, a mask with zeros or other rows: it cannot fail on the padding path",
        ),
        "kernels": ControlScope(
            "a worker process started at torch's own kernel level, the caches crossing the scratch store both ways",
            "another ISA: ATen, oneDNN and MKL run at the widths the job has",
        ),
    },
)
