"""The environment record tells machines apart, and the audit reports every field of it that changed."""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from stagereplay.audit.rerun import environment_difference
from stagereplay.engines.transformers.engine import Environment, Runtime, configure_runtime
from stagereplay.ledger.environment import ENVIRONMENT_COLUMNS
from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, TRANSPLANT_SCHEMA
from stagereplay.report import card
from stagereplay.report.summary import environment

RUNTIME = Runtime(precision="fp32", device="cpu", threads=1)
NEW_FIELDS = {
    "cpu_capability": ("AVX2", "AVX512"),
    "bf16_reduced_precision_reduction": (True, False),
    "fp16_reduced_precision_reduction": (True, False),
    "sdpa_backends": ("flash,mem_efficient,math,cudnn", "math"),
    "float32_matmul_precision": ("highest", "high"),
}


def test_the_cpu_is_named_by_its_model_and_kernel_level():
    recorded = configure_runtime(RUNTIME)
    assert recorded.device == "cpu"
    assert recorded.device_name.strip() and recorded.device_name not in (platform.machine(), platform.processor())
    cpuinfo = Path("/proc/cpuinfo").read_text() if platform.system() == "Linux" else ""
    if "model name" in cpuinfo:
        assert f"model name\t: {recorded.device_name}" in cpuinfo
    assert recorded.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert recorded.cpu_capability in ("DEFAULT", "VSX", "ZVECTOR", "NO AVX", "AVX2", "AVX512", "SVE256", "SVE128")


@pytest.fixture
def restore_kernel_settings():
    backends = torch.backends
    matmul, cuda = backends.cuda.matmul, backends.cuda
    # set_float32_matmul_precision also rewrites the per-backend fp32_precision settings: restore those
    # themselves, since setting "highest" back would leave "ieee" where "none" was.
    saved = (
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
        cuda.flash_sdp_enabled(),
        matmul.fp32_precision,
        backends.mkldnn.matmul.fp32_precision,
    )
    yield
    matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved[:2]
    cuda.enable_flash_sdp(saved[2])
    matmul.fp32_precision, backends.mkldnn.matmul.fp32_precision = saved[3:]


def test_kernel_settings_are_read_back_not_assumed(restore_kernel_settings):
    matmul, cuda = torch.backends.cuda.matmul, torch.backends.cuda
    matmul.allow_bf16_reduced_precision_reduction = False
    matmul.allow_fp16_reduced_precision_reduction = True
    cuda.enable_flash_sdp(False)
    torch.set_float32_matmul_precision("high")
    first = configure_runtime(RUNTIME)
    matmul.allow_bf16_reduced_precision_reduction = True
    matmul.allow_fp16_reduced_precision_reduction = False
    cuda.enable_flash_sdp(True)
    torch.set_float32_matmul_precision("highest")
    second = configure_runtime(RUNTIME)
    assert (first.bf16_reduced_precision_reduction, first.fp16_reduced_precision_reduction) == (False, True)
    assert (second.bf16_reduced_precision_reduction, second.fp16_reduced_precision_reduction) == (True, False)
    assert "flash" not in first.sdpa_backends.split(",") and second.sdpa_backends.split(",")[0] == "flash"
    assert set(second.sdpa_backends.split(",")) <= {"flash", "mem_efficient", "math", "cudnn"}
    assert (first.float32_matmul_precision, second.float32_matmul_precision) == ("high", "highest")


def test_environment_columns_are_one_list_everywhere():
    fields = {field.name for field in dataclasses.fields(Environment)}
    assert set(ENVIRONMENT_COLUMNS) <= fields
    for schema in (TRAJECTORY_SCHEMA, TRANSPLANT_SCHEMA):
        assert set(ENVIRONMENT_COLUMNS) <= set(schema.names)
    assert [key for key, _ in card.ENVIRONMENT_COLUMNS] == [
        "checkpoint",
        "precision",
        *ENVIRONMENT_COLUMNS,
        "model_fingerprint",
    ]
    row = {name: None for name in TRAJECTORY_SCHEMA.names}
    row.update(
        checkpoint="c",
        precision="bf16",
        model_fingerprint="m",
        **{name: value for name, (value, _) in NEW_FIELDS.items()},
    )
    (entry,) = environment(pa.Table.from_pylist([row], schema=TRAJECTORY_SCHEMA))
    assert {name: entry[name] for name in NEW_FIELDS} == {name: value for name, (value, _) in NEW_FIELDS.items()}


@pytest.mark.parametrize("field", sorted(NEW_FIELDS))
def test_the_audit_reports_each_new_field_as_an_environment_difference(field):
    saved = {name: "same" for name in ENVIRONMENT_COLUMNS}
    audited = dict(saved)
    saved[field], audited[field] = NEW_FIELDS[field]
    assert environment_difference(saved, audited) == f"{field} {NEW_FIELDS[field][0]} -> {NEW_FIELDS[field][1]}"
    assert environment_difference(saved, dict(saved)) is None
