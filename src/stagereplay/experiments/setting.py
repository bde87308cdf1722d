"""The reference setting of E6 and the registry of every factor's setting: a setting builds an item's boundary
state and continues from one (``Setting``); each factor's test levels are run by one class, registered by the
factor's name (``runs``). The settings themselves are ``factor_settings`` (switches, contexts, chunks, prefix
reuse, kernels) and ``batch_settings`` (batches, concurrent load, and where the item's cells lie)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

from stagereplay.design.factors import FactorError, Level
from stagereplay.engines.base import Engine
from stagereplay.engines.registry import spec_for_loaded_engine
from stagereplay.experiments.constructions import build_boundary_state
from stagereplay.experiments.decode import Decoded, continue_from
from stagereplay.experiments.level_job import Built, LevelJob, Prefix
from stagereplay.ledger.kvstate import KVState

# factor name -> the setting that runs its test levels (each class says which factor it runs)
SETTINGS: dict[str, type[Setting]] = {}
# knob mechanism -> the setting that runs a factor's levels by it, where no setting runs that factor by name
BY_MECHANISM: dict[str, type[Setting]] = {}


def runs(factor: str):
    """Register a setting class as the one that runs ``factor``'s test levels."""

    def register(cls):
        SETTINGS[factor] = cls
        return cls

    return register


def runs_by(*mechanisms: str):
    """Register a setting class as the one that runs any factor an engine runs by one of ``mechanisms`` (a new
    context, a server restart: the engine takes the factor's value under the factor's own name)."""

    def register(cls):
        BY_MECHANISM.update(dict.fromkeys(mechanisms, cls))
        return cls

    return register


class Setting:
    """The reference level: a one-shot prefill, then batch-1 greedy decoding with the run's settings."""

    def __init__(self, engine: Engine, budget: int, eos: frozenset[int]):
        self.engine, self.budget, self.eos = engine, budget, eos

    @classmethod
    def for_level(cls, level: Level, job: LevelJob) -> Setting:
        """This setting at a factor's test level."""
        return cls(job.engine, job.budget, job.eos)

    def unavailable(self) -> str | None:
        """Why the level cannot run here (recorded on every row of the job), or None."""
        return None

    def runs(self) -> tuple[int | None, ...]:
        """The runs of each item's cells: one, unnumbered, where this setting pins its whole input, so that
        a second run must reproduce the first; numbered runs where it does not (``ConcurrentLoad``)."""
        return (None,)

    def fed_positions(self) -> int:
        """Positions fed through the model so far for this setting's builds and reads (and the job's)."""
        return self.engine.fed_positions

    @contextmanager
    def active(self) -> Iterator[None]:
        yield

    def build(self, prefix: Prefix) -> Built:
        with self.active():
            return Built(build_boundary_state(self.engine, list(prefix.tokens), "prefill", prefix.prompt_length), "")

    def read(self, prefix: Prefix, state: KVState, built: Built | None) -> Decoded:
        """Continue from ``state``; ``built`` is this level's build of the same item (batch companions)."""
        if prefix.ended_by_eos:
            return Decoded((), (), "eos")
        with self.active():
            return continue_from(self.engine, state, prefix.tokens[-1], self.budget, self.eos)

    def with_budget(self, budget: int) -> Setting:
        """This setting, decoding at most ``budget`` tokens (E6 replays the reference only as far as it needs)."""
        shorter = copy.copy(self)
        shorter.budget = budget
        return shorter

    def for_reference(self, state: KVState) -> KVState:
        """A cache this level built, as the reference setting reads it (as it is, unless it stores another type)."""
        return state

    def for_test(self, state: KVState) -> KVState:
        """The reference cache, as this level reads it."""
        return state


def mechanism(job: LevelJob, factor: str) -> str | None:
    """How the job's engine runs ``factor``: its knob's mechanism (``engines.spec.MECHANISMS``), which picks the
    setting of a factor two engines run by different means (a batch the engine composes, or load on a server)."""
    return spec_for_loaded_engine(job.engine).mechanism(factor)


def level_setting(level: Level, job: LevelJob) -> Setting:
    """The setting that runs a factor's test level: the factor's own class (``SETTINGS``), else the class of the
    mechanism the engine's knob names (``BY_MECHANISM``)."""
    kind = SETTINGS.get(level.factor) or BY_MECHANISM.get(mechanism(job, level.factor))
    if kind is None:
        raise FactorError(f"factors.{level.factor}: no setting of this factor runs in one process — see design.factors")
    return kind.for_level(level, job)
