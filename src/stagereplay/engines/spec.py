"""What an engine declares before it loads anything: one ``EngineSpec`` per engine, no torch.

The workflow's parse-time checks, the CLI, the plan, E6's factors, provenance and the card ask an
engine's spec what it takes (precisions, checkpoint sources, runtime switches, factors) and what it
records (libraries, environment fields); only a model job loads the engine itself (``engine_class``,
through ``registry``). Adding an engine is one spec module, one engine module and a line in ``registry``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

# The fields every engine's environment record fills (engines.base.Environment); an engine adds its own.
SHARED_ENVIRONMENT = (
    "device",
    "device_name",
    "cpu_capability",
    "precision",
    "threads",
    "engine",
    "engine_version",
    "engine_build",
)


class ControlScope(NamedTuple):
    """What an E6 factor's A/A control (``design.factors.Factor.control``) runs on one engine, in words for the
    card: the machinery it exercises, and what it does not exercise (so cannot fail on)."""

    exercises: str
    does_not: str


# How an engine runs an E6 factor's test level (``Knob.mechanism``).
MECHANISMS = {
    "switch": "a runtime switch, set around each build and read and set back",
    "context": "a new context with the setting changed",
    "restart": "a server restart with the option changed",
    "worker": "a worker process of its own, started with the setting",
    "request": "how the engine's own calls are made: chunked, reused, batched or placed",
    "load": "other requests served beside the item's by the server itself",
    "kept": "the engine's own kept sequences: a sequence's first positions kept for a later request, saved and"
    " restored through the engine's own files",
}


@dataclass(frozen=True)
class Knob:
    """How one engine runs one E6 factor: by which mechanism (``MECHANISMS``), under which name of its own, and
    which levels it refuses. ``refuse(level, precision, flash_attn)`` gives the reason a level cannot run with the
    run's precision and flash attention (one line, without the config key), or None."""

    mechanism: str
    setting: str = ""  # the engine's own name for what the level changes (attn_implementation, -fa, ...)
    refuse: Callable[[str, str, bool], str | None] | None = None

    def __post_init__(self):
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"unknown knob mechanism {self.mechanism!r} — use one of {', '.join(MECHANISMS)}")

    def refusal(self, level: str, precision: str, flash_attn: bool) -> str | None:
        return self.refuse(level, precision, flash_attn) if self.refuse else None


class ModelError(RuntimeError):
    """An engine cannot load or run as asked: one-line message naming the problem and the fix."""


class SpecError(ValueError):
    """One line: a config asks an engine for something it does not take, and the fix."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine, as the rest of stagereplay sees it without loading it."""

    name: str  # a model record's and a checkpoint's ``engine``
    summary: str  # what it runs, in a few words
    # precision name -> what it sets: the weight and cache dtype, or the KV-cache type
    precisions: dict[str, str]
    precision_pattern: str  # a regular expression of every precision it takes (the workflow's wildcard)
    precision_kind: str  # "weight dtype" or "KV-cache type": what a precision names here
    checkpoint_sources: tuple[str, ...]  # the config's checkpoint sources it runs
    record_kind: str  # what its model record names: "folder" (a safetensors folder) or "gguf"
    factors: dict[str, Knob]  # E6 factors it runs, each with how it runs it
    libraries: tuple[str, ...]  # distributions whose versions decide what it computes (provenance, audit)
    # runtime keys that are another engine's, each with the one-line refusal (the config key and the fix)
    refused_switches: dict[str, str] = field(default_factory=dict)
    environment_fields: tuple[str, ...] = SHARED_ENVIRONMENT  # what its environment record means
    engine_class_path: str = ""  # "module:Class", imported only when a job loads the engine
    # Whether a batch of sequences of unequal lengths is padded to the longest (transformers' left padding),
    # so a batched build feeds B times the longest; else each sequence's own positions.
    pads_batches: bool = False
    # What a reader of the card must know of this engine's precisions (empty: nothing beyond their names).
    precision_note: str = ""
    # factor -> what its control exercises on this engine and what it does not: one for every factor it runs
    # (tests/test_control_scopes.py); summary.json's E6.controls and the card's controls table read it.
    control_scopes: dict[str, ControlScope] = field(default_factory=dict)
    # The module that serves whole requests to a running server of this engine, deployed by the workflow or
    # attached at a URL (``serve``, ``check_server``, ``probe_text``: the config's ``served`` block and
    # ``stagereplay probe``); empty: the engine serves none.
    server_module: str = ""
    # The engine on a server someone else runs, for a checkpoint with ``attach`` ("module:Class", a subclass of the
    # engine's own class); empty: this engine attaches to none.
    attached_class_path: str = ""

    def mechanism(self, factor: str) -> str | None:
        """How this engine runs ``factor`` (a ``MECHANISMS`` key), or None: a factor it does not run."""
        knob = self.factors.get(factor)
        return knob.mechanism if knob else None

    def control_scope(self, factor: str) -> ControlScope | None:
        """What ``factor``'s control exercises on this engine, and what not (None: a factor it does not declare)."""
        return self.control_scopes.get(factor)

    def takes(self, precision: str) -> bool:
        return re.fullmatch(self.precision_pattern, precision) is not None

    def check_precision(self, precision: str, flash_attn: bool = False) -> None:
        """Refuse, in one line (SpecError), a precision this engine does not run with these switches."""
        if not self.takes(precision):
            raise SpecError(
                f"{precision} is not a {self.name} precision — use {self.precision_choices()} ({self.precision_kind})"
            )

    def precision_choices(self) -> str:
        """The precisions it takes, as a refusal lists them: "bf16, fp16 or fp32"."""
        names = list(self.precisions)
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"

    def head_bytes(self, precision: str, part: str, head_dim: int) -> int:
        """Bytes of one head's K (``part`` "k") or V ("v") at one position, as this engine caches them."""
        raise NotImplementedError

    def weight_bytes(self, precision: str) -> int:
        """Bytes per weight of a job at ``precision`` (what its memory figure counts)."""
        raise NotImplementedError

    def stored_part(self, precision: str, part: str, head_dim: int, rotation: bool) -> tuple[str, str, int]:
        """One layer's K (``part`` "k") or V ("v") as the object store holds it: the tensor name's suffix, the
        safetensors dtype and the last dimension. ``rotation``: a quantized cache stored rotated."""
        raise NotImplementedError

    def check_run(self, checkpoint: str, precisions: set[str], runtime: dict) -> None:
        """Refuse, in one line, precisions asked of the checkpoint (E1, E2, E5's cast) that this engine does not
        run with the runtime's switches."""
        for precision in sorted(precisions):
            try:
                self.check_precision(precision, runtime.get("flash_attn", False))
            except SpecError as error:
                raise SpecError(f"checkpoint {checkpoint!r}: {error}") from None

    def check_cast(self, precision: str, cast_to: str | None) -> None:
        """Refuse E5's cross-precision transplant (a ``precision`` cache cast to ``cast_to``) where this engine
        cannot cast its caches (nothing refused by default: values cast)."""

    def check_switches(self, runtime: dict) -> None:
        """Refuse a runtime switch set that is another engine's."""
        for key, refusal in self.refused_switches.items():
            if runtime.get(key):
                raise SpecError(refusal)

    def check_source(self, checkpoint: str, source: str) -> None:
        if source not in self.checkpoint_sources:
            raise SpecError(
                f"checkpoint {checkpoint!r}: the {self.name} engine runs {self.summary} — use"
                f" {', '.join(self.checkpoint_sources)} as its source"
            )

    def server_protocol(self):
        """The module that serves whole requests to this engine's servers (imported now)."""
        return importlib.import_module(self.server_module)

    def engine_class(self, attached: bool = False) -> type:
        """The engine itself, an ``engines.base.Engine`` (its module, and torch, are imported now); ``attached``: the
        one on a server someone else runs (a checkpoint with ``attach``)."""
        module, _, name = (self.attached_class_path if attached else self.engine_class_path).partition(":")
        return getattr(importlib.import_module(module), name)
