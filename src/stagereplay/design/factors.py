"""E6 (factors): the runtime settings a server changes, their levels, and the verdict of each item.

No torch: the workflow's parse-time checks, summary, verify and the report read this.

A factor has one reference level — the setting every other experiment ran with (one-shot prefill,
batch 1, the run's attention kernel and thread count, the CPU kernel level torch picks on this
machine; on llama.cpp the run's flash attention, one micro-batch, its cache type rotated as llama.cpp
rotates it by default) — and the test levels the config lists. For a test level t and the reference r, an item's
boundary state over the E1 prefix is built under b and continued under c, for b, c in {r, t}:

- ``(r, r)`` the reference: E2's prefill row at the factor precision, reused, never recomputed;
- ``(t, r)`` the write side: the cache built under t, continued under r;
- ``(r, t)`` the read side: the reference cache, continued under t;
- ``(t, t)`` the factor as a server runs it.

A factor that acts only while the cache is built (``BUILD_ONLY``: prefix reuse, chunked prefill,
micro-batches) reads the same way at every level, so it has two cells, ``(r, r)`` and ``(t, r)``;
``(t, t)`` is the same computation as ``(t, r)`` and is not recorded twice. A factor whose one-sided
cells cannot be built honestly (``SERVER_ONLY``: the rotation) has ``(t, t)`` alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stagereplay.design.cache_types import QUANTIZED, CacheTypeError, cache_types, check_cache_precision

FACTORS = (
    "prefix_reuse",
    "batch",
    "attention",
    "threads",
    "chunk",
    "kernels",
    "flash_attn",
    "ubatch",
    "cache_type",
    "rotation",
)
BUILD_ONLY = frozenset({"prefix_reuse", "chunk", "ubatch"})
# A factor whose one-sided cells cannot be built honestly, and why: only (t, t) is computed, and its
# rows of (t, r) and (r, t) say they are not applicable, with this reason.
SERVER_ONLY = {
    "rotation": (
        "a cache llama.cpp wrote rotated is read only by a context that rotates, and a plain one only by one"
        " that does not: reading it across would re-quantize it, which neither setting does"
    ),
}
ATTENTION_LEVELS = ("sdpa", "eager", "flash_attention_2")
# torch's ATEN_CPU_CAPABILITY values on x86-64, and the CPU flags each needs (torch's own test).
KERNEL_LEVELS = {
    "default": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
}
ON_OFF = ("on", "off")
# Settings of the CPU's own computation: nothing on a GPU run.
CPU_ONLY = frozenset({"threads", "kernels"})
# The engines each factor runs on today.
FACTOR_ENGINES = {
    "prefix_reuse": ("transformers", "llamacpp"),
    "batch": ("transformers", "llamacpp"),
    "attention": ("transformers",),
    "threads": ("transformers", "llamacpp"),
    "chunk": ("transformers", "llamacpp"),
    "kernels": ("transformers",),
    "flash_attn": ("llamacpp",),
    "ubatch": ("llamacpp",),
    "cache_type": ("llamacpp",),
    "rotation": ("llamacpp",),
}

# Cells, as (build, read): "ref" or "test".
REFERENCE = ("ref", "ref")
WRITE = ("test", "ref")
READ = ("ref", "test")
SERVER = ("test", "test")
VERDICTS = ("none", "write", "read", "both", "interaction", "served")


class FactorError(ValueError):
    """One-line message naming the problem and the fix."""


def cells_of(factor: str) -> tuple[tuple[str, str], ...]:
    """The cells a factor level computes (the reference cell is E2's row, never computed here)."""
    if factor in SERVER_ONLY:
        return (SERVER,)
    return (WRITE,) if factor in BUILD_ONLY else (WRITE, READ, SERVER)


def unbuilt_cells(factor: str) -> dict[tuple[str, str], str]:
    """The cells of the 2x2 a factor cannot build honestly, each with the reason its row records."""
    if factor in SERVER_ONLY:
        return {WRITE: SERVER_ONLY[factor], READ: SERVER_ONLY[factor]}
    return {}


def served_cell(factor: str) -> tuple[str, str]:
    """The cell that runs the level as a server would: (t, t), or (t, r) for a build-only factor."""
    return WRITE if factor in BUILD_ONLY else SERVER


def cell_label(cell: tuple[str, str]) -> str:
    return f"{cell[0]}-{cell[1]}"


@dataclass(frozen=True)
class Level:
    """One test level of one factor, as the path component (wildcard) that names it."""

    factor: str
    name: str  # e.g. "4", "eager", "prompt", "block-16", "avx2"

    @property
    def value(self):
        """The level as the engine takes it: an int for batch, threads, chunk, ubatch; a block size for
        (restore-)block-N; True/False for on/off."""
        if self.factor in ("batch", "threads", "chunk", "ubatch"):
            return int(self.name)
        if self.factor == "prefix_reuse":
            reused = self.name.removeprefix("restore-")
            return int(reused.removeprefix("block-")) if reused.startswith("block-") else reused
        if self.factor in ("flash_attn", "rotation"):
            return self.name == "on"
        return self.name

    @property
    def restores(self) -> bool:
        """A prefix-cache hit through a saved and restored sequence (llama.cpp's slot save/restore)."""
        return self.factor == "prefix_reuse" and self.name.startswith("restore-")


def level_name(factor: str, level) -> str:
    """A config level as its path component: block:16 -> block-16; 4 -> "4"."""
    if isinstance(level, bool):  # YAML reads on/off as booleans
        return "on" if level else "off"
    text = str(level).strip()
    return text.replace(":", "-") if factor == "prefix_reuse" else text


def reference_level(factor: str, runtime: dict, cpu_capability: str | None = None) -> str:
    """The setting every other experiment ran with."""
    return {
        "prefix_reuse": "none",  # a miss: everything prefilled in one shot
        "batch": "1",
        "attention": runtime.get("attn_implementation", "sdpa"),
        "threads": str(runtime.get("threads", 1)),
        "chunk": "whole",  # one forward over the whole prefix
        "kernels": (cpu_capability or "default").lower(),
        "flash_attn": "on" if runtime.get("flash_attn") else "off",
        "ubatch": "whole",  # the whole prefix in one micro-batch
        "cache_type": runtime.get("precision", "fp16"),
        "rotation": "on",  # llama.cpp's default for a quantized cache
    }[factor]


def _positive_int(factor: str, text: str, what: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]*", text):
        raise FactorError(f"factors.{factor}: level {text!r} is not a positive integer — give {what}")
    return int(text)


def check_levels(
    factors: dict,
    engine: str,
    item_count: int,
    shortest_prompt: int,
    cpu_flags: frozenset[str] | None = None,
    device: str = "cpu",
    precision: str = "",
    flash_attn: bool = False,
) -> list[Level]:
    """Every configured test level, checked before any job; one line naming the supported values otherwise.
    ``precision`` and ``flash_attn``: the run's (E1's) precision and llama.cpp flash attention."""
    levels = []
    for factor, given in factors.items():
        if factor not in FACTORS:
            raise FactorError(f"factors: unknown factor {factor!r} — use one of {', '.join(FACTORS)}")
        if factor in CPU_ONLY and device != "cpu":
            raise FactorError(
                f"factors.{factor}: sets how the CPU computes, but runtime.device is {device} — remove it, or run"
                " this config with device: cpu"
            )
        if engine not in FACTOR_ENGINES[factor]:
            raise FactorError(
                f"factors.{factor}: not supported on the {engine} engine — run it on a checkpoint of the"
                f" {', '.join(FACTOR_ENGINES[factor])} engine, or remove it"
            )
        if not given:
            raise FactorError(f"factors.{factor}: no levels — list at least one test level, or remove the factor")
        names = [level_name(factor, value) for value in given]
        if len(set(names)) != len(names):
            raise FactorError(f"factors.{factor}: a level is listed twice — list each once")
        for name in names:
            _check_level(factor, name, item_count, shortest_prompt, cpu_flags)
            _check_llamacpp_level(factor, name, engine, precision, flash_attn)
            levels.append(Level(factor, name))
    return levels


def _check_llamacpp_level(factor: str, name: str, engine: str, precision: str, flash_attn: bool) -> None:
    if factor == "prefix_reuse" and name.startswith("restore-") and engine != "llamacpp":
        raise FactorError(
            f"factors.prefix_reuse: {name.replace('-', ':', 1)} restores llama.cpp's saved sequence file — run it"
            " on a llama.cpp checkpoint, or use prompt / block:N"
        )
    if factor == "cache_type":
        try:
            check_cache_precision(name, flash_attn)
        except CacheTypeError as error:
            raise FactorError(f"factors.cache_type: {error}") from None
    if factor == "flash_attn" and name == "off" and precision and cache_types(precision).v in QUANTIZED:
        raise FactorError(
            f"factors.flash_attn: the run's {precision} V cache needs flash attention, so off cannot run — remove it"
        )
    if factor == "rotation" and not (precision and cache_types(precision).quantized):
        raise FactorError(
            f"factors.rotation: llama.cpp rotates only a quantized cache and the run's is {precision or 'not one'} —"
            " set matched.precision to a quantized type (q8_0), or remove rotation"
        )


def _check_level(factor: str, name: str, item_count: int, shortest_prompt: int, cpu_flags) -> None:
    if factor == "batch":
        size = _positive_int(factor, name, "a batch size such as 2, 4 or 8")
        if size > item_count:
            raise FactorError(
                f"factors.batch: a batch of {size} needs {size} items, the run has {item_count} — use at most {item_count}"
            )
    elif factor == "threads":
        _positive_int(factor, name, "an intra-op thread count such as 1 or 2")
    elif factor == "chunk":
        _positive_int(factor, name, "a chunk size in tokens such as 4 or 7")
    elif factor == "attention":
        if name not in ATTENTION_LEVELS:
            raise FactorError(f"factors.attention: unknown level {name!r} — use {', '.join(ATTENTION_LEVELS)}")
    elif factor == "prefix_reuse":
        reused = name.removeprefix("restore-")
        if reused != "prompt" and not re.fullmatch(r"block-[1-9][0-9]*", reused):
            raise FactorError(
                f"factors.prefix_reuse: unknown level {name!r} — use prompt (the cached prompt), block:N (the"
                " longest run of whole N-token blocks of the prefix), or on llama.cpp restore:prompt / restore:block:N"
                " (the same, through a saved and restored sequence)"
            )
        # Every context holds its prompt, so a block no longer than the shortest prompt is reused on every item.
        if reused != "prompt" and Level(factor, name).value > shortest_prompt:
            raise FactorError(
                f"factors.prefix_reuse: a block of {Level(factor, name).value} tokens is longer than the shortest"
                f" prompt ({shortest_prompt} tokens), so a hit could reuse nothing — use block:N with N at most"
                f" {shortest_prompt}"
            )
    elif factor == "ubatch":
        _positive_int(factor, name, "a micro-batch size in tokens such as 512 or 7")
    elif factor in ("flash_attn", "rotation"):
        if name not in ON_OFF:
            raise FactorError(f"factors.{factor}: unknown level {name!r} — use on or off")
    elif factor == "kernels":
        if name not in KERNEL_LEVELS:
            raise FactorError(f"factors.kernels: unknown level {name!r} — use {', '.join(KERNEL_LEVELS)}")
        missing = [flag for flag in KERNEL_LEVELS[name] if cpu_flags is not None and flag not in cpu_flags]
        if missing:
            # torch takes a level the CPU lacks without complaint and then dies on an illegal instruction.
            supported = [level for level, needs in KERNEL_LEVELS.items() if all(f in cpu_flags for f in needs)]
            raise FactorError(
                f"factors.kernels: this CPU lacks {', '.join(missing)}, so it cannot run {name} kernels — use"
                f" {', '.join(supported)} here"
            )


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return frozenset()


def verdict(reference: list[int], write: list[int] | None, read: list[int] | None, server: list[int] | None) -> str:
    """Where the divergence of one item enters, from the suffixes of its cells (token lists).

    - ``none``: every cell continues like the reference;
    - ``write``: the test-built cache changes the continuation (``(t, r)`` differs) and reading under
      the test level does not (``(r, t)`` is the reference's);
    - ``read``: the other way round;
    - ``both``: ``(t, r)`` and ``(r, t)`` each differ from the reference;
    - ``interaction``: neither one-sided cell differs, only ``(t, t)``.

    For a build-only factor (``read`` and ``server`` None) it is ``write`` or ``none``. For a factor with
    (t, t) alone (``write`` and ``read`` None, ``SERVER_ONLY``) it is ``served`` (the level changes the
    continuation, where it enters is not separable) or ``none``. With identical cache bytes ``(t, r)`` is the
    reference computation, so such an item is ``none`` or ``read``.
    """
    if write is None:
        return "served" if server != reference else "none"
    write_differs = write != reference
    if read is None:
        return "write" if write_differs else "none"
    read_differs = read != reference
    if write_differs and read_differs:
        return "both"
    if write_differs:
        return "write"
    if read_differs:
        return "read"
    return "interaction" if server != reference else "none"
