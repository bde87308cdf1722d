"""The one reader of /proc/cpuinfo (stagereplay.engines.cpuinfo): the model and flags of the first processor,
the Arm ids where no model is named, and nothing where there is no such file."""

from __future__ import annotations

import platform

import pytest

from stagereplay.engines import cpuinfo

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse avx512f avx512_bf16

processor\t: 1
model name\t: another
flags\t\t: fpu
"""
ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd
CPU implementer\t: 0x41
CPU part\t: 0xd0c

"""


@pytest.fixture()
def linux(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Linux")


def test_the_first_processor_names_model_and_flags(tmp_path, monkeypatch, linux):
    (tmp_path / "cpuinfo").write_text(X86)
    monkeypatch.setattr(cpuinfo, "CPUINFO", str(tmp_path / "cpuinfo"))
    assert cpuinfo.cpu_model() == "AMD EPYC 9B14"
    assert cpuinfo.cpu_flags() == frozenset({"fpu", "sse", "avx512f", "avx512_bf16"})


def test_arm_linux_is_named_by_its_ids_and_has_no_flags_line(tmp_path, monkeypatch, linux):
    (tmp_path / "cpuinfo").write_text(ARM)
    monkeypatch.setattr(cpuinfo, "CPUINFO", str(tmp_path / "cpuinfo"))
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert cpuinfo.cpu_model() == "aarch64 (implementer 0x41, part 0xd0c)"
    assert cpuinfo.cpu_flags() == frozenset()


def test_without_cpuinfo_the_flags_are_unknown_and_the_model_is_the_platforms(tmp_path, monkeypatch, linux):
    monkeypatch.setattr(cpuinfo, "CPUINFO", str(tmp_path / "absent"))
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert cpuinfo.cpu_flags() is None
    assert cpuinfo.cpu_model() == "riscv64"
