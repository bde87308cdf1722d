"""What the numbers depend on besides the inputs: the one declaration of a row's environment (no torch).

An engine fills an ``Environment`` when it loads (``engines``); every ledger row carries its fields as columns
(``ledger.tables``: each field's Arrow type from its annotation); the card's environment table heads them with
each field's title. A field is added here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pyarrow as pa


def _field(title: str, column: bool = True, **default):
    """A field with the card's title for it; ``column`` False: not an environment column of the tables (the row
    has a column of its own for it)."""
    return field(metadata={"title": title, "column": column}, **default)


@dataclass(frozen=True)
class Environment:
    """What the numbers depend on besides the inputs; recorded per ledger row."""

    device: str = _field("device")
    device_name: str = _field("device name")  # the GPU's name, or the CPU model
    cpu_capability: str = _field("CPU kernels")  # the SIMD level torch picked CPU kernels for (e.g. AVX2, AVX512)
    precision: str = _field("precision", column=False)  # every row's own precision column
    threads: int = _field("threads")
    attn_implementation: str = _field("attention")
    tf32: bool = _field("TF32")
    # May bf16/fp16 matmuls reduce in reduced precision (cuBLAS split-K): changes sums on CUDA.
    bf16_reduced_precision_reduction: bool = _field("bf16 reduced-precision reduction")
    fp16_reduced_precision_reduction: bool = _field("fp16 reduced-precision reduction")
    # enabled scaled-dot-product-attention kernels, e.g. "flash,mem_efficient,math,cudnn"
    sdpa_backends: str = _field("SDPA backends")
    # torch.get_float32_matmul_precision(): highest, high or medium
    float32_matmul_precision: str = _field("fp32 matmul precision")
    deterministic: bool = _field("deterministic")
    torch_version: str = _field("torch version")
    transformers_version: str = _field("transformers version")
    # Which engine ran the model (a name of the engine registry), its version and its build options.
    engine: str = _field("engine")
    engine_version: str = _field("engine version", default="")  # the engine library's version
    engine_build: str = _field("engine build", default="")  # its build options where it has its own (llama.cpp's)


_ARROW = {"str": pa.string(), "int": pa.int32(), "bool": pa.bool_()}

# The environment columns of every table, in declaration order, with their Arrow types.
ENVIRONMENT_FIELDS = tuple((each.name, _ARROW[each.type]) for each in fields(Environment) if each.metadata["column"])
ENVIRONMENT_COLUMNS = tuple(name for name, _ in ENVIRONMENT_FIELDS)
# Every field as the card heads it.
ENVIRONMENT_TITLES = tuple((each.name, each.metadata["title"]) for each in fields(Environment))
