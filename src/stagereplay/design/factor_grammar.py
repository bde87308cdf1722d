"""What every E6 factor is, before any one factor: the ``Factor`` base (its levels, reference, control and cells),
the context a level is checked against, and the kinds of level grammar several factors share (a count, a count or
``whole``, on/off). The factors themselves, and the check of a config's levels, are ``design.factors``."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from stagereplay.design.cells import FULL, SERVER, WRITE, cell_patterns
from stagereplay.engines.spec import EngineSpec

ON_OFF = ("on", "off")
# The level of a build-only factor that builds the whole context at once (one chunk, one micro-batch, a
# prefix-cache hit over all of it): the reference computation, through the factor's own machinery.
WHOLE = "whole"


class FactorError(ValueError):
    """One-line message naming the problem and the fix."""


@dataclass(frozen=True)
class LevelContext:
    """What a level is checked against: the engine, the items, the machine and the run's settings."""

    engine: EngineSpec
    item_count: int
    shortest_prompt: int
    cpu_flags: frozenset[str] | None = None
    device: str = "cpu"
    precision: str = ""  # the run's (E1's) precision
    flash_attn: bool = False  # llama.cpp's flash attention in the run


class Factor:
    """One E6 factor: its levels (parsed, checked), its reference level, its cells and the engines that run it."""

    name = ""
    cells: tuple[tuple[str, str], ...] = FULL  # the cells a level computes (the reference is E2's row)
    unbuilt_reason: str | None = None  # why the 2x2's other cells cannot be built (a server-only factor)
    cpu_only = False  # a setting of the CPU's own computation: nothing on a GPU run
    reuses_prefix = False  # a test level takes positions from an earlier request's cache (each row says how many)
    other_cache_type = False  # a test level stores another cache type: never the reference's bytes
    splits_by_sequence = False  # a test level gives each sequence a KV stream of its own (llama.cpp's split_equal)

    def level_name(self, given) -> str:
        """A config level as its path component (4 -> "4"; YAML's on/off booleans -> on/off)."""
        if isinstance(given, bool):
            return "on" if given else "off"
        return str(given).strip()

    def check(self, name: str, context: LevelContext) -> None:
        """Refuse, in one line (FactorError), a level this run cannot have."""

    def reference(self, runtime: dict, cpu_capability: str | None) -> str:
        """The setting every other experiment ran with."""
        raise NotImplementedError

    def control(self, runtime: dict, cpu_capability: str | None = None) -> str:
        """The A/A control level: the reference setting, run through this factor's test machinery."""
        return self.control_of(self.reference(runtime, cpu_capability))

    def control_of(self, reference: str) -> str:
        """The control level of a run whose reference level is ``reference`` (a row records it): the
        reference's own name, where the test machinery can run it as a level."""
        return reference

    def value(self, name: str):
        """The level as the engine takes it."""
        return name

    def restores(self, name: str) -> bool:
        """Whether the level restores a saved sequence (llama.cpp's slot save/restore)."""
        return False

    def threads(self, name: str, run_threads: int) -> int:
        """The threads a job of this level declares (the run's, unless the level runs more)."""
        return run_threads

    @property
    def served_cell(self) -> tuple[str, str]:
        """The cell that runs the level as a server would: (t, t), or (t, r) for a build-only factor."""
        return SERVER if SERVER in self.cells else WRITE

    @property
    def patterns(self) -> tuple[str, ...]:
        """Every pattern of differing cells a level of this factor can show (``cell_patterns``)."""
        return cell_patterns(self.cells)

    def unbuilt_cells(self) -> dict[tuple[str, str], str]:
        """The cells of the 2x2 this factor cannot build honestly, each with the reason its row records."""
        return {cell: self.unbuilt_reason for cell in FULL if cell not in self.cells} if self.unbuilt_reason else {}

    def engines(self, specs: Iterable[EngineSpec]) -> tuple[str, ...]:
        """The engines among ``specs`` that run this factor (each engine's spec lists its factors)."""
        return tuple(spec.name for spec in specs if self.name in spec.factors)


def positive_int(factor: str, text: str, what: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]*", text):
        raise FactorError(f"factors.{factor}: level {text!r} is not a positive integer — give {what}")
    return int(text)


class Count(Factor):
    """A level that is a positive count (batch size, threads, chunk or micro-batch size)."""

    what = ""  # the hint of the refusal

    def check(self, name, context):
        positive_int(self.name, name, self.what)

    def value(self, name):
        return int(name)


class WholeOrCount(Count):
    """A build size (chunk, micro-batch) whose reference, ``whole``, is also a level: the whole context in one
    piece, built through the same splitting machinery as any count."""

    def check(self, name, context):
        if name != WHOLE:
            super().check(name, context)

    def reference(self, runtime, cpu_capability):
        return WHOLE

    def value(self, name):
        """0 for ``whole``: no limit (one chunk of the whole context; llama.cpp's n_ubatch 0 is n_ctx)."""
        return 0 if name == WHOLE else int(name)


class OnOff(Factor):
    def check(self, name, context):
        if name not in ON_OFF:
            raise FactorError(f"factors.{self.name}: unknown level {name!r} — use on or off")

    def value(self, name):
        return name == "on"
