"""What E6's settings (``factor_settings``) work on and hand back: an item's E1 prefix, what a build gives,
what a level's setting is made from."""

from __future__ import annotations

from dataclasses import dataclass

from stagereplay.engines.base import Engine, Runtime
from stagereplay.experiments.decode import Decoded
from stagereplay.ledger.kvstate import KVState
from stagereplay.ledger.store import ObjectStore


@dataclass(frozen=True)
class Prefix:
    """One item's E1 prefix, as its reference row saved it."""

    item_id: str
    tokens: tuple[int, ...]  # the last one is pending
    prompt_length: int
    ended_by_eos: bool  # the stage ended the answer: nothing is continued, caches are still compared

    @property
    def context(self) -> list[int]:
        return list(self.tokens[:-1])


@dataclass(frozen=True)
class Built:
    state: KVState
    note: str  # what this build did, in words (reused tokens, chunks, companions)
    reused_tokens: int | None = None
    reused_digest: str | None = None
    companions: tuple[str, ...] = ()
    companion_states: tuple[KVState, ...] = ()  # a batch's other rows, as the same batched prefill built them
    # The served continuation, where the level serves the item as one request (build and read in one load
    # block): the served cell is that read, not a restore of the built cache. None elsewhere.
    served: Decoded | None = None
    served_positions: int = 0  # positions the served read fed (part of the build's count until the cell takes them)


@dataclass
class LevelJob:
    """What a factor level's setting is made from: the job's engine and runtime, the continuation budget,
    every item's prefix (a batch's companions come from any shard), a scratch store and the model record."""

    engine: Engine
    runtime: Runtime
    budget: int
    eos: frozenset[int]
    prefixes: dict[str, Prefix]
    scratch: ObjectStore
    record: dict  # the model record, with "path": the model.json it was read from
    load_runs: int = 1  # how many times a level whose input is not pinned (concurrent load) runs each item
