"""The kernels factor pins every library that picks its own CPU kernels: ATen's capability alone leaves
torch's bf16 matmuls to oneDNN at the CPU's widest ISA. Each level's worker environment is started here and
oneDNN is asked which ISA it runs (a level this CPU lacks is skipped, as the config check refuses it)."""

import os
import subprocess
import sys

import pytest
import torch

from stagereplay.design.factors import KERNEL_LEVELS, OWN_KERNELS, factor_named
from stagereplay.engines.cpuinfo import cpu_flags
from stagereplay.experiments.kernel_worker import onednn_isa

PROBE = "import torch; from stagereplay.experiments.kernel_worker import onednn_isa as i; print(i(), '|', torch.backends.cpu.get_cpu_capability())"
# What oneDNN and ATen report at each level (oneDNN's name for its ISA ceiling; ATen's capability).
REPORTED = {"default": ("SSE4.1", "DEFAULT"), "avx2": ("AVX2", "AVX2"), "avx512": ("AVX-512", "AVX512")}


def _report(environment: dict[str, str]) -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, **environment}, capture_output=True, text=True, check=True
    )
    onednn, aten = done.stdout.strip().rsplit("|", 1)
    return onednn.strip(), aten.strip()


@pytest.mark.parametrize("level", sorted(KERNEL_LEVELS))
def test_each_level_pins_aten_and_onednn_at_its_width(level):
    flags = cpu_flags()
    if flags is not None and not all(flag in flags for flag in KERNEL_LEVELS[level]):
        pytest.skip(f"this CPU cannot run {level} kernels")
    onednn, aten = _report(factor_named("kernels").environment(level, "unused"))
    assert aten == REPORTED[level][1]
    assert REPORTED[level][0] in onednn, onednn
    if level != "avx512":
        assert "AVX-512" not in onednn


def test_the_control_leaves_onednn_as_this_process_has_it():
    own = torch.backends.cpu.get_cpu_capability()
    environment = factor_named("kernels").environment(OWN_KERNELS, own)
    assert environment == {"ATEN_CPU_CAPABILITY": own.lower()}
    assert _report(environment) == (onednn_isa(), own)
