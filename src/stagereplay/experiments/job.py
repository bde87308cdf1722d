"""What every model job shares: its shard of items, the environment columns of its rows, its progress line."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from stagereplay.engines.base import Environment
from stagereplay.ledger.tables import ENVIRONMENT_COLUMNS


@dataclass(frozen=True)
class ShardSpec:
    checkpoint: str
    precision: str
    replica: int
    shard: int
    shard_size: int


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
