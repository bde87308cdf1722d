"""What every model job shares: its context (the checkpoint, runtime, shard, inputs and stores its command
line names), the environment columns of its rows, its progress line."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from stagereplay.design.storage import store_policy
from stagereplay.engines.base import Engine, Environment
from stagereplay.engines.registry import spec_for_record
from stagereplay.engines.runtime import Runtime
from stagereplay.engines.spec import EngineSpec
from stagereplay.inputs.checkpoints import read_model_record
from stagereplay.ledger.environment import ENVIRONMENT_COLUMNS
from stagereplay.ledger.store import ObjectStore


@dataclass(frozen=True)
class ShardSpec:
    checkpoint: str
    precision: str
    replica: int
    shard: int
    shard_size: int


@dataclass(frozen=True)
class JobContext:
    """What a model job (live, rebuild, transplant, factor) is given besides its own work: built once from
    the options every model job takes (``cli.options.job_context``), or with ``read`` by a test or bench."""

    record_path: str | Path  # model.json as given: a model pool and the kernels worker read it again
    record: dict  # the model record, its paths resolved (read_model_record)
    engine_spec: EngineSpec  # the engine the record names
    runtime: Runtime
    shard_spec: ShardSpec
    items_path: str | Path
    suffix_tokens: int  # budget of the continuation after the boundary
    store_root: str | Path  # the object store the job writes to
    out_path: str | Path  # the shard table the job writes
    prompts_path: str | Path | None = None  # prompt tokens and readout cues (live and rebuild jobs)
    # Where saved prefixes and caches are read from (None: store_root); the audit reads the saved ledger's.
    source_store_root: str | Path | None = None
    # The store_caches policy given (None: the ledger's own). Resolved only when a job stores (cache_policy),
    # so a job that stores nothing (factor) never reads storage.json.
    store_caches: str | None = None

    @classmethod
    def read(cls, record_path: str | Path, **options) -> JobContext:
        """The context of a job on the checkpoint of ``record_path``; ``options``: the other fields."""
        record = read_model_record(record_path)
        return cls(record_path=record_path, record=record, engine_spec=spec_for_record(record), **options)

    def load_engine(self) -> Engine:
        """The checkpoint loaded by its engine at the job's runtime (what registry.load_checkpoint does)."""
        return self.engine_spec.engine_class(attached="attach" in self.record).load(self.record, self.runtime)

    def store(self) -> ObjectStore:
        return ObjectStore(self.store_root)

    def source_store(self) -> ObjectStore:
        return ObjectStore(self.source_store_root or self.store_root)

    def cache_policy(self) -> str:
        """The store_caches policy the job stores at: the one given, else that of its ledger's storage.json."""
        return self.store_caches or store_policy(self.store_root)


def environment_columns(environment: Environment) -> dict:
    return {name: getattr(environment, name) for name in ENVIRONMENT_COLUMNS}


def progress_bar(total: int, label: str) -> tuple[tqdm, callable]:
    bar = tqdm(total=total, desc=label, unit="item", mininterval=2.0)
    # Set from the start, so even a job with nothing to decode ends its log with a tok_s figure.
    bar.set_postfix(tok_s="0.0", refresh=False)
    counter = {"tokens": 0}
    started = time.perf_counter()

    def on_token() -> None:
        counter["tokens"] += 1
        bar.set_postfix(tok_s=f"{counter['tokens'] / max(time.perf_counter() - started, 1e-9):.1f}", refresh=False)

    return bar, on_token
