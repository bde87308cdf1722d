"""A job's command line as the workflow's rules pass it: a model job's runtime and shard (``runtime_args``), the
model records a comparison rebuilds caches from (``rebuild_args``), and E5's sweep (``sweep_args``). common.smk's
params call these with the checked config; nothing here reads a file."""

from __future__ import annotations

import shlex

from stagereplay.design.served import GREEDY_JSON, sampling_json
from stagereplay.engines.runtime import runtime_options


def runtime_args(
    config: dict,
    runtime: dict,
    wildcards,
    max_positions: int,
    replica: int | None = None,
    store_caches: str | None = None,
) -> str:
    """A model job's runtime (``engines.runtime.runtime_options``) and shard. The run's jobs are not told the
    store_caches policy (a job reads it from the ledger's storage.json when it stores), so a new policy reruns no
    job: the storage rule applies it. The audit names its own (audit.keep_caches)."""
    args = [
        f"--checkpoint {wildcards.checkpoint}",
        f"--precision {wildcards.precision}",
        *runtime_options(runtime),
        f"--shard {int(wildcards.shard)}",
        f"--shard-size {config['shard_size']}",
        f"--replica {int(wildcards.replica) if replica is None else replica}",
        f"--suffix-tokens {config['stage']['suffix_tokens']}",
        f"--max-positions {max_positions}",
    ]
    if runtime["device_memory_gb"]:
        args.append(f"--device-memory-gb {runtime['device_memory_gb']}")
    if store_caches is not None:
        args.append(f"--store-caches {store_caches}")
    return " ".join(args)


def rebuild_args(model_records: dict[str, str], runtime: dict) -> str:
    """What compare needs to rebuild a cache that is not stored: each compared checkpoint's model record (the
    saved one, or the audit tree's) and the runtime the rows were computed with."""
    args = [f"--model {name} {shlex.quote(record)}" for name, record in model_records.items()]
    return " ".join(args + runtime_options(runtime))


def sweep_args(sweep: dict) -> str:
    """E5's sweep of the transplant job: the single layers, block sizes, K/V alone, windows."""
    single = sweep["single_layers"]
    args = ["--sweep", f"--single-layers {','.join(map(str, single)) if isinstance(single, list) else single}"]
    if sweep["block_sizes"]:
        args.append("--block-sizes " + " ".join(map(str, sweep["block_sizes"])))
    if sweep["kv_only"]:
        args.append("--kv-only")
    if sweep["windows"]:
        args.append("--windows " + " ".join(map(str, sweep["windows"])))
    return " ".join(args)


def served_design(served: dict, tokens: int, boundary: int) -> str:
    """The served job's design options: tokens per request, other clients, the schedule's seed and runs, the stage
    boundary a replay starts at, whether the request is sent alone on each slot in turn, and its sampling where it
    is not greedy (so a greedy run's job is the same command it always was)."""
    sampling = sampling_json(served.get("sampling"))
    return (
        f"--tokens {tokens} --clients {served['clients']} --seed {served['seed']} --load-runs {served['load_runs']}"
        f" --boundary {boundary}"
        + (" --each-slot" if served.get("each_slot") else "")
        + "".join(f" --kv-offset {offset}" for offset in served.get("kv_offsets") or ())
        + "".join(f" --send-as {client}" for client in served.get("send_as") or ("pinned",))
        + (f" --sampling {shlex.quote(sampling)}" if sampling != GREEDY_JSON else "")
    )
