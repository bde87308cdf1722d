"""The model jobs: E1-E3 live and rebuilt trajectories, E5's selection and transplants, E6's factor levels."""

from __future__ import annotations

import json
from pathlib import Path

from stagereplay.cli.options import add_runtime, job_context


def cmd_live(args) -> None:
    from stagereplay.experiments.constructions import StageBoundary
    from stagereplay.experiments.shards import run_live_shard

    run_live_shard(job_context(args), StageBoundary(args.max_new_tokens, args.marker or None))


def add_live_command(sub) -> None:
    p = sub.add_parser("live", help="E1 live side: generate to the stage boundary, keep the cache, continue")
    add_runtime(p)
    p.add_argument("--prompts", required=True, help="prompt tokens table (Parquet)")
    p.add_argument("--max-new-tokens", type=int, required=True, help="stage budget")
    p.add_argument("--marker", default=None, help="string that ends the stage")
    p.set_defaults(func=cmd_live)


def cmd_rebuild(args) -> None:
    from stagereplay.experiments.shards import run_construction_shard

    run_construction_shard(job_context(args), args.source_shard, args.construction)


def add_rebuild_command(sub) -> None:
    p = sub.add_parser(
        "rebuild", help="rebuild the boundary states of a live shard by another construction, then continue"
    )
    add_runtime(p)
    p.add_argument("--construction", required=True, help="prefill, incremental or chunked:N")
    p.add_argument("--source-shard", required=True, help="the live shard whose saved prefixes are rebuilt")
    p.add_argument("--prompts", required=True, help="prompt tokens table (Parquet): the readout's cue and letters")
    p.set_defaults(func=cmd_rebuild)


def cmd_select_transplants(args) -> None:
    from stagereplay.experiments.transplants import select_divergent
    from stagereplay.ledger.atomic import atomic_write_text
    from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, concat_tables

    live = concat_tables(args.live, TRAJECTORY_SCHEMA).to_pylist()
    prefill = concat_tables(args.prefill, TRAJECTORY_SCHEMA).to_pylist()
    selected = select_divergent(live, prefill, args.first_k)
    selection = {
        "selected": {"rule": f"E1 suffixes differ; first {args.first_k or 'all'} by item id", "item_ids": selected},
        "outcome_blind": {
            "rule": f"seeded sample (seed {args.seed}) fixed in the config before any outcome",
            "checkpoint": args.outcome_blind_checkpoint,
            "item_ids": sorted(args.outcome_blind_ids),
        },
    }
    atomic_write_text(args.out, json.dumps(selection, indent=2) + "\n")


def add_select_transplants_command(sub) -> None:
    p = sub.add_parser(
        "select-transplants", help="E5: record which items are transplanted (selected and outcome-blind)"
    )
    p.add_argument("--live", nargs="+", required=True, help="E1 live rep0 shard tables")
    p.add_argument("--prefill", nargs="+", required=True, help="E1 prefill rep0 shard tables")
    p.add_argument("--first-k", type=int, default=None, help="keep the first K divergent items by id (default: all)")
    p.add_argument("--outcome-blind-checkpoint", required=True)
    p.add_argument("--outcome-blind-ids", nargs="*", default=[])
    p.add_argument("--seed", type=int, default=0, help="seed the outcome-blind sample was drawn with (recorded)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_select_transplants)


def cmd_transplant(args) -> None:
    from stagereplay.design.names import SweepPlan, parse_layers
    from stagereplay.experiments.transplant_job import TransplantJob, run_transplant_shard

    selection = json.loads(Path(args.selection_file).read_text())
    item_ids = selection["selected" if args.selection == "cross_precision" else args.selection]["item_ids"]
    plan = None
    if args.sweep:
        plan = SweepPlan(
            single_layers=parse_layers(args.single_layers),
            block_sizes=tuple(args.block_sizes),
            kv_only=args.kv_only,
            windows=tuple(args.windows),
        )
    job = TransplantJob(args.selection, frozenset(item_ids), tuple(tuple(pair) for pair in args.pair), plan)
    run_transplant_shard(job_context(args), job)


def add_transplant_command(sub) -> None:
    p = sub.add_parser("transplant", help="E5: transplant donor caches into recipient states and continue")
    add_runtime(p)
    p.add_argument("--selection", required=True, choices=["selected", "outcome_blind", "cross_precision"])
    p.add_argument("--selection-file", required=True, help="selection.json written by select-transplants")
    p.add_argument(
        "--pair",
        nargs=2,
        action="append",
        required=True,
        metavar=("DONOR", "RECIPIENT"),
        help="shard tables of the donor and the recipient trajectories (repeat for each direction)",
    )
    p.add_argument("--sweep", action="store_true", help="try the layer/K/V/position subsets, not only all layers")
    p.add_argument("--single-layers", default="all", help="all, none, or comma-separated layer indices")
    p.add_argument("--block-sizes", type=int, nargs="*", default=[], help="leading and trailing blocks of these sizes")
    p.add_argument("--kv-only", action="store_true", help="also K only and V only")
    p.add_argument("--windows", type=int, nargs="*", default=[], help="also the last W positions only")
    p.set_defaults(func=cmd_transplant)


def cmd_factor(args) -> None:
    from stagereplay.design.factors import Level
    from stagereplay.experiments.factor_job import run_factor_shard

    run_factor_shard(job_context(args), Level(args.factor, args.level), args.reference, args.load_runs)


def add_factor_command(sub) -> None:
    p = sub.add_parser("factor", help="E6: build under a factor level and the reference, continue under each")
    add_runtime(p)
    p.add_argument("--factor", required=True, help="a factor of design/factors.py, e.g. batch")
    p.add_argument("--level", required=True, help="its test level as a path component, e.g. 4 or block-16")
    p.add_argument(
        "--reference",
        nargs="+",
        required=True,
        help="every shard table of the E2 prefill rows (replica 0) at the factor precision, in shard order",
    )
    p.add_argument(
        "--load-runs",
        type=int,
        default=1,
        help="how many times a level under concurrent load runs each item, each with fresh companions",
    )
    p.set_defaults(func=cmd_factor)


def cmd_kernel_worker(args) -> None:
    from stagereplay.experiments.kernel_worker import run_kernel_worker

    run_kernel_worker(args.folder)


def add_kernel_worker_command(sub) -> None:
    p = sub.add_parser(
        "kernel-worker", help="E6 kernels: the test level's side, run by `factor` with ATEN_CPU_CAPABILITY set"
    )
    p.add_argument("folder", help="the scratch store holding request.json; answer.json is written there")
    p.set_defaults(func=cmd_kernel_worker)


COMMANDS = {
    "live": add_live_command,
    "rebuild": add_rebuild_command,
    "select-transplants": add_select_transplants_command,
    "transplant": add_transplant_command,
    "factor": add_factor_command,
    "kernel-worker": add_kernel_worker_command,
}
