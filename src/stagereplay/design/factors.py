"""E6 (factors): the runtime settings a server changes, one object per factor, and the verdict of each item.

No torch: the workflow's parse-time checks, summary, verify and the report read this. How a level builds
and reads a cache is the torch side's (``experiments.factor_settings``, one setting class per factor, found by
the factor's name).

A factor has one reference level — the setting every other experiment ran with (one-shot prefill,
batch 1, the run's attention kernel and thread count, the CPU kernel level torch picks on this
machine; on llama.cpp the run's flash attention, one micro-batch, its cache type rotated as llama.cpp
rotates it by default) — and the test levels the config lists. For a test level t and the reference r, an item's
boundary state over the E1 prefix is built under b and continued under c, for b, c in {r, t}:

- ``(r, r)`` the reference: E2's prefill row at the factor precision, reused, never recomputed;
- ``(t, r)`` the write side: the cache built under t, continued under r;
- ``(r, t)`` the read side: the reference cache, continued under t;
- ``(t, t)`` the factor as a server runs it.

A factor that acts only while the cache is built (build-only: prefix reuse, chunked prefill,
micro-batches) reads the same way at every level, so it has two cells, ``(r, r)`` and ``(t, r)``;
``(t, t)`` is the same computation as ``(t, r)`` and is not recorded twice. A factor whose one-sided
cells cannot be built honestly (server-only: the rotation) has ``(t, t)`` alone.

Every factor also runs a control level (``Factor.control``): the reference setting pushed through the
test machinery (a switch set to the run's own value, a new context with the run's own settings, batch 1
through the batched path, one chunk of the whole context, the reference cache through the prefix store,
the kernels worker at this CPU's own level). It must give the reference's bytes and suffix on every item:
a harness artefact would otherwise look exactly like a finding. ``check_levels`` adds it to every
configured factor.

Adding a factor: one ``Factor`` here (its levels, reference, cells; the kinds of level grammar are
``factor_grammar``'s), and a ``Knob`` in the spec of each engine that runs it (``engines``: by which mechanism,
under which name of its own, which levels it refuses). A factor an engine runs by a new context or a server
restart needs no setting of its own (``experiments.factor_settings.Reconfigured`` hands the engine the level's
value under the factor's name); any other gets one setting class in ``experiments``, registered by its name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from stagereplay.design.cells import SERVER, WRITE
from stagereplay.design.factor_grammar import (
    WHOLE,
    Count,
    Factor,
    FactorError,
    LevelContext,
    OnOff,
    WholeOrCount,
    positive_int,
)
from stagereplay.engines.spec import EngineSpec


class PrefixReuse(Factor):
    name = "prefix_reuse"
    cells = (WRITE,)
    reuses_prefix = True

    def level_name(self, given):
        return super().level_name(given).replace(":", "-")

    def check(self, name, context):
        reused = name.removeprefix("restore-")
        if reused not in ("prompt", WHOLE) and not re.fullmatch(r"block-[1-9][0-9]*", reused):
            raise FactorError(
                f"factors.prefix_reuse: unknown level {name!r} — use prompt (the cached prompt), block:N (the"
                " longest run of whole N-token blocks of the prefix), whole (the whole context), or on llama.cpp"
                " restore:prompt / restore:block:N (the same, through a saved and restored sequence)"
            )
        # Every context holds its prompt, so a block no longer than the shortest prompt is reused on every item.
        if reused.startswith("block-") and self.value(name) > context.shortest_prompt:
            raise FactorError(
                f"factors.prefix_reuse: a block of {self.value(name)} tokens is longer than the shortest"
                f" prompt ({context.shortest_prompt} tokens), so a hit could reuse nothing — use block:N with N at most"
                f" {context.shortest_prompt}"
            )
        if self.restores(name) and context.engine.mechanism("prefix_reuse") != "kept":
            raise FactorError(
                f"factors.prefix_reuse: {name.replace('-', ':', 1)} restores llama.cpp's saved sequence file — run it"
                " on a llama.cpp checkpoint, or use prompt / block:N"
            )

    def reference(self, runtime, cpu_capability):
        return "none"  # a miss: everything prefilled in one shot

    def control_of(self, reference):
        # A hit over the whole context: the one-shot prefill (the reference's computation) goes through the
        # prefix store and is loaded back, with nothing prefilled on top.
        return WHOLE

    def value(self, name):
        """A block size for (restore-)block-N; "prompt" for the cached prompt, "whole" for the whole context."""
        reused = name.removeprefix("restore-")
        return int(reused.removeprefix("block-")) if reused.startswith("block-") else reused

    def restores(self, name):
        return name.startswith("restore-")


class Batch(Count):
    """B requests decoded together: the item with the next B-1 items (``B``: rows of other lengths, so left
    padding and a mask), or the item repeated B times (``same:B``: rows of one length, no padding). Beside
    batch 1 through the same path (the control), the two tell padding and masking apart from batch size."""

    name = "batch"
    what = "a batch size such as 2, 4 or 8, or same:B (the item repeated B times)"

    def level_name(self, given):
        return super().level_name(given).replace(":", "-")

    def check(self, name, context):
        size = positive_int(self.name, name.removeprefix(REPEATED), self.what)
        if self.repeats_item(name):
            if size < 2:
                raise FactorError(
                    "factors.batch: same:1 is a batch of the item alone, the control batch 1 runs it — use same:B with B"
                    " of at least 2"
                )
        elif size > context.item_count:
            raise FactorError(
                f"factors.batch: a batch of {size} needs {size} items, the run has {context.item_count} — use at most"
                f" {context.item_count}, or same:{size} (the item repeated)"
            )

    def reference(self, runtime, cpu_capability):
        return "1"

    def value(self, name):
        """The batch size (rows decoded together), for either kind of batch."""
        return int(name.removeprefix(REPEATED))

    def repeats_item(self, name: str) -> bool:
        """Whether every row of the batch is the item itself (same-B)."""
        return name.startswith(REPEATED)


REPEATED = "same-"  # a batch level of the item repeated: same:B in a config, same-B as a path component


class Attention(Factor):
    name = "attention"

    def reference(self, runtime, cpu_capability):
        return runtime.get("attn_implementation", "sdpa")


class Threads(Count):
    name = "threads"
    what = "an intra-op thread count such as 1 or 2"
    cpu_only = True

    def reference(self, runtime, cpu_capability):
        return str(runtime.get("threads", 1))

    def threads(self, name, run_threads):
        return max(run_threads, int(name))


class Chunk(WholeOrCount):
    name = "chunk"
    what = "a chunk size in tokens such as 4 or 7, or whole"
    cells = (WRITE,)


# The kernels control: the worker at the level torch picks on this CPU. Named, not spelled out, because
# only torch knows its pick (its build may lack a level the CPU has), and the workflow parses without it.
OWN_KERNELS = "own"
# torch's ATEN_CPU_CAPABILITY values on x86-64, and the CPU flags each needs (torch's own test).
KERNEL_LEVELS = {
    "default": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
}
# ATEN_CPU_CAPABILITY fixes only ATen's own kernels. torch's bf16 matmuls run in oneDNN and its fp32 ones in
# MKL, each picking its ISA on its own, so a level pins both at the same vector width (oneDNN's ISA names:
# ONEDNN_MAX_CPU_ISA; MKL's: MKL_ENABLE_INSTRUCTIONS). AVX-512 keeps bf16 instructions and excludes AMX.
KERNEL_PINS = {
    "default": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}


class Kernels(Factor):
    name = "kernels"
    cpu_only = True

    def check(self, name, context):
        if name == OWN_KERNELS:
            return  # torch's own pick runs on this CPU by construction
        if name not in KERNEL_LEVELS:
            raise FactorError(
                f"factors.kernels: unknown level {name!r} — use {', '.join(KERNEL_LEVELS)} or {OWN_KERNELS} (torch's pick)"
            )
        flags = context.cpu_flags
        missing = [flag for flag in KERNEL_LEVELS[name] if flags is not None and flag not in flags]
        if missing:
            # torch takes a level the CPU lacks without complaint and then dies on an illegal instruction.
            supported = [level for level, needs in KERNEL_LEVELS.items() if all(f in flags for f in needs)]
            raise FactorError(
                f"factors.kernels: this CPU lacks {', '.join(missing)}, so it cannot run {name} kernels — use"
                f" {', '.join(supported)} here"
            )

    def reference(self, runtime, cpu_capability):
        return (cpu_capability or "default").lower()

    def control_of(self, reference):
        return OWN_KERNELS

    def environment(self, name: str, own_capability: str) -> dict[str, str]:
        """The variables the worker process starts with at this level. ``own`` (the control) sets ATen's
        capability to the one this process picked and leaves oneDNN and MKL as this process has them."""
        if name == OWN_KERNELS:
            return {"ATEN_CPU_CAPABILITY": own_capability.lower()}
        return {"ATEN_CPU_CAPABILITY": name, **KERNEL_PINS[name]}


class FlashAttn(OnOff):
    name = "flash_attn"

    def reference(self, runtime, cpu_capability):
        return "on" if runtime.get("flash_attn") else "off"


class Ubatch(WholeOrCount):
    name = "ubatch"
    what = "a micro-batch size in tokens such as 512 or 7, or whole"
    cells = (WRITE,)


class CacheType(Factor):
    name = "cache_type"
    other_cache_type = True

    def reference(self, runtime, cpu_capability):
        return runtime.get("precision", "fp16")


class Rotation(OnOff):
    name = "rotation"
    cells = (SERVER,)
    unbuilt_reason = (
        "a cache llama.cpp wrote rotated is read only by a context that rotates, and a plain one only by one"
        " that does not: reading it across would re-quantize it, which neither setting does"
    )

    def reference(self, runtime, cpu_capability):
        return "on"  # llama.cpp's default for a quantized cache


# A kv_offset level whose filler is decoded and removed before the item arrives: the control's prefix.
REMOVED = "removed-"
# The control's filler: not a multiple of 64 (the key tiles of CPU flash attention), so a filler that was
# not really removed would move the item's cells off the tile edges and show.
CONTROL_FILLER = 100


class KvOffset(Factor):
    """The item's cells behind another sequence's in one unified cache: ``c`` cells of an idle filler sequence
    (the next items' tokens) are decoded first, so the item's cells start at cell ``c`` instead of 0. Nothing
    else shares the item's calls. ``removed:c`` (the control) decodes the same filler and removes it before the
    item arrives: the filler path, with the item at cell 0 again. It separates where the item's cells lie in
    the cache from what else is in its decode calls (concurrent load changes both)."""

    name = "kv_offset"
    what = "a cell count such as 1, 37, 64 or 100, or removed:N (the control: the filler removed first)"

    def level_name(self, given):
        return super().level_name(given).replace(":", "-")

    def check(self, name, context):
        positive_int(self.name, name.removeprefix(REMOVED), self.what)

    def reference(self, runtime, cpu_capability):
        return "0"  # the item alone in its cache, from cell 0

    def control_of(self, reference):
        return f"{REMOVED}{CONTROL_FILLER}"

    def value(self, name):
        """The filler's cell count."""
        return int(name.removeprefix(REMOVED))

    def removes_filler(self, name: str) -> bool:
        """Whether the filler is removed before the item arrives (the control)."""
        return name.startswith(REMOVED)


class KvUnified(Factor):
    """Concurrent requests in one KV stream per sequence instead of one unified cache (llama-server's
    ``--no-kv-unified``): ``off:B`` is ``batch`` B with every sequence's cells from cell 0 of its own stream.
    Beside ``batch`` B (one unified cache, the item's cells behind the others'), it separates the cells'
    place from the company in the decode calls. ``off:1`` (the control) is the item alone on that path."""

    name = "kv_unified"
    splits_by_sequence = True
    what = "off:B with B a batch size such as 2 or 4 (off:1 is the control)"

    def level_name(self, given):
        return super().level_name(given).replace(":", "-")

    def check(self, name, context):
        if not name.startswith("off-"):
            raise FactorError(f"factors.kv_unified: unknown level {name!r} — use {self.what}")
        size = positive_int(self.name, name.removeprefix("off-"), self.what)
        if size > context.item_count:
            raise FactorError(
                f"factors.kv_unified: {name.replace('-', ':')} needs {size} items, the run has {context.item_count}"
                f" — use at most off:{context.item_count}"
            )

    def reference(self, runtime, cpu_capability):
        return "none"  # no other request: the one-sequence cache of every other experiment

    def control_of(self, reference):
        return "off-1"

    def value(self, name):
        """The batch size (sequences decoded together, each in its own stream)."""
        return int(name.removeprefix("off-"))


FACTOR_OBJECTS: dict[str, Factor] = {
    factor.name: factor
    for factor in (
        PrefixReuse(),
        Batch(),
        Attention(),
        Threads(),
        Chunk(),
        Kernels(),
        FlashAttn(),
        Ubatch(),
        CacheType(),
        Rotation(),
        KvOffset(),
        KvUnified(),
    )
}
FACTORS = tuple(FACTOR_OBJECTS)


def factor_named(name: str) -> Factor:
    if name not in FACTOR_OBJECTS:
        raise FactorError(f"factors: unknown factor {name!r} — use one of {', '.join(FACTORS)}")
    return FACTOR_OBJECTS[name]


@dataclass(frozen=True)
class Level:
    """One test level of one factor, as the path component (wildcard) that names it."""

    factor: str
    name: str  # e.g. "4", "eager", "prompt", "block-16", "avx2"
    # The factor's A/A control (Factor.control): it must reproduce the reference. Not part of the level's
    # identity: a user-listed level equal to the control is that control.
    control: bool = field(default=False, compare=False)

    @property
    def factor_type(self) -> Factor:
        return factor_named(self.factor)

    @property
    def value(self):
        """The level as the engine takes it: an int for batch, threads, chunk, ubatch; a block size for
        (restore-)block-N; True/False for on/off."""
        return self.factor_type.value(self.name)

    @property
    def restores(self) -> bool:
        """A prefix-cache hit through a saved and restored sequence (llama.cpp's slot save/restore)."""
        return self.factor_type.restores(self.name)


def reference_level(factor: str, runtime: dict, cpu_capability: str | None = None) -> str:
    """The setting every other experiment ran with."""
    return factor_named(factor).reference(runtime, cpu_capability)


def is_control(factor: str, level: str, reference: str) -> bool:
    """Whether a level (as a row names it, with its ``reference_level``) is its factor's A/A control."""
    return level == factor_named(factor).control_of(reference)


def check_levels(
    factors: dict,
    engine: EngineSpec,
    item_count: int,
    shortest_prompt: int,
    cpu_flags: frozenset[str] | None = None,
    device: str = "cpu",
    precision: str = "",
    flash_attn: bool = False,
    runtime: dict | None = None,
    engines: Iterable[EngineSpec] = (),
) -> list[Level]:
    """Every configured test level, checked before any job; one line naming the supported values otherwise.
    ``engine``: the spec of the engine that runs the primary checkpoint; ``precision`` and ``flash_attn``: the
    run's (E1's) precision and llama.cpp flash attention; ``runtime``: the config's runtime block; ``engines``:
    every registered engine's spec, so a factor this engine does not run is refused naming those that do.

    Each configured factor also gets its control level (``Factor.control``) after its listed levels, unless
    the list names it already (then that level is the control)."""
    context = LevelContext(engine, item_count, shortest_prompt, cpu_flags, device, precision, flash_attn)
    # The run's own settings, as the job's runtime gives them: precision is E1's, flash attention the run's.
    run = {**(runtime or {}), "flash_attn": flash_attn, **({"precision": precision} if precision else {})}
    levels = []
    for name, given in factors.items():
        factor = factor_named(name)
        if factor.cpu_only and device != "cpu":
            raise FactorError(
                f"factors.{name}: sets how the CPU computes, but runtime.device is {device} — remove it, or run"
                " this config with device: cpu"
            )
        if name not in engine.factors:
            raise FactorError(
                f"factors.{name}: not supported on the {engine.name} engine — run it on a checkpoint of the"
                f" {', '.join(factor.engines(engines))} engine, or remove it"
            )
        if not given:
            raise FactorError(f"factors.{name}: no levels — list at least one test level, or remove the factor")
        names = [factor.level_name(value) for value in given]
        if len(set(names)) != len(names):
            raise FactorError(f"factors.{name}: a level is listed twice — list each once")
        control = factor.control(run)
        knob = context.engine.factors[name]
        for level in names if control in names else [*names, control]:
            factor.check(level, context)  # the level's grammar and the run's items
            refusal = knob.refusal(level, precision, flash_attn)  # what this engine cannot run
            if refusal:
                raise FactorError(f"factors.{name}: {refusal}")
            levels.append(Level(name, level, control=level == control))
    return levels
