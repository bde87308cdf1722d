"""The CPU a job runs on, read once from ``/proc/cpuinfo``: its model and its feature flags.

``cpu_model`` names the model, not just the architecture (two x86_64 machines can run different
kernels): an engine records it as a row's ``device_name``. ``cpu_flags`` gives the feature flags the
kernel levels of E6 need (``avx512_bf16``...), checked when the workflow parses. Outside Linux there
is no /proc/cpuinfo: macOS names its model through ``sysctl``, Arm Linux only by implementer and part
ids. No torch.
"""

from __future__ import annotations

import platform
import subprocess

CPUINFO = "/proc/cpuinfo"


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is none: not Linux)."""
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return frozenset()


def cpu_model() -> str:
    """The CPU's model, not just its architecture: two x86_64 machines can run different kernels."""
    if platform.system() == "Darwin":
        try:
            brand = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], check=False, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            brand = ""
        if brand:
            return brand
    fields: dict[str, str] = {}
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if not line.strip() and fields:
                    break  # the first processor describes them all
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass  # not Linux
    if fields.get("model name"):
        return fields["model name"]
    if fields.get("CPU implementer") and fields.get("CPU part"):  # Arm Linux names no model, only these ids
        return f"{platform.machine()} (implementer {fields['CPU implementer']}, part {fields['CPU part']})"
    return platform.processor() or platform.machine()
