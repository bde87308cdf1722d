"""The ledger's light jobs: what it stores and is computed from, its gathered tables, comparisons and summary."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from stagereplay import __version__
from stagereplay.cli.options import add_model_records, add_rebuild_runtime


def cmd_store_caches_policy(args) -> None:
    from stagereplay.design.storage import storage_document
    from stagereplay.ledger.atomic import atomic_write_text

    atomic_write_text(args.out, json.dumps(storage_document(args.policy), indent=2) + "\n")


def add_store_caches_policy_command(sub) -> None:
    p = sub.add_parser(
        "store-caches-policy", help="write storage.json: which cache tensors this ledger keeps (store_caches)"
    )
    p.add_argument("--policy", required=True, choices=["all", "selected", "none"])
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_store_caches_policy)


def cmd_provenance(args) -> None:
    from stagereplay.engines.registry import ENGINE_LIBRARIES, record_with_engine
    from stagereplay.inputs.checkpoints import read_model_record
    from stagereplay.ledger.provenance import build_provenance, write_provenance

    records = {name: record_with_engine(read_model_record(path)) for name, path in args.model}
    write_provenance(args.out, build_provenance(json.loads(args.design), args.items, records, ENGINE_LIBRARIES))


def add_provenance_command(sub) -> None:
    p = sub.add_parser("provenance", help="record what the ledger is computed from: config, items, models, versions")
    p.add_argument("--design", required=True, help="the resolved config as JSON")
    p.add_argument("--items", required=True, help="the ledger's items.jsonl")
    add_model_records(p, "a used checkpoint and its model.json (repeat)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_provenance)


def cmd_apply_storage(args) -> None:
    from stagereplay.audit.verify import verify_ledger
    from stagereplay.engines.runtime import runtime_from_args
    from stagereplay.experiments.recompute import ModelPool
    from stagereplay.experiments.storage_operation import apply_policy
    from stagereplay.ledger.atomic import atomic_write_text
    from stagereplay.ledger.layout import LedgerLayout
    from stagereplay.ledger.store import ObjectStore
    from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, TRANSPLANT_SCHEMA, read_table

    ledger = LedgerLayout(args.ledger)
    trajectories = read_table(ledger.table("trajectories"), TRAJECTORY_SCHEMA).to_pylist()
    transplants_path = Path(ledger.table("transplants"))
    transplants = read_table(transplants_path, TRANSPLANT_SCHEMA).to_pylist() if transplants_path.is_file() else []
    models = ModelPool(dict(args.model), runtime_from_args(args)) if args.model else None
    change = apply_policy(args.policy, ObjectStore(ledger.objects), trajectories, transplants, models)
    print(change.line())
    report = verify_ledger(args.ledger, documents=False)
    for fault in report.faults:
        print(f"stagereplay: fault: {fault}", file=sys.stderr)
    if report.faults:
        raise SystemExit(
            f"storage: the ledger does not verify after store_caches {args.policy}: {report.summary_line()}"
        )
    atomic_write_text(
        args.out, json.dumps({**dataclasses.asdict(change), "verify": report.summary_line()}, indent=2) + "\n"
    )
    print(f"{change.line()}; {report.summary_line()}")


def add_apply_storage_command(sub) -> None:
    p = sub.add_parser(
        "apply-storage",
        help="make the object store hold what store_caches keeps: delete or materialise cache tensors, then verify",
    )
    p.add_argument("--ledger", required=True, help="the ledger_dir of a finished run")
    p.add_argument("--policy", required=True, help="the store_caches policy to apply")
    add_rebuild_runtime(p)
    p.add_argument("--out", required=True, help="stored.json: what the store holds now")
    p.set_defaults(func=cmd_apply_storage)


def cmd_gather(args) -> None:
    from stagereplay.ledger.tables import SCHEMAS, concat_tables, write_table

    schema = SCHEMAS[args.table]
    write_table(concat_tables(args.shards, schema).to_pylist(), schema, args.out)


def add_gather_command(sub) -> None:
    p = sub.add_parser("gather", help="gather shard tables into one ledger table")
    p.add_argument("--table", default="trajectories", choices=["trajectories", "transplants", "factors", "served"])
    p.add_argument("--out", required=True, help="table to write (Parquet)")
    p.add_argument("shards", nargs="+")
    p.set_defaults(func=cmd_gather)


def cmd_compare(args) -> None:
    from stagereplay.design.jobs import comparisons, replication_comparisons
    from stagereplay.design.names import parse_construction
    from stagereplay.engines.runtime import runtime_from_args
    from stagereplay.experiments.compare import comparison_table
    from stagereplay.experiments.recompute import CacheSource, ModelPool
    from stagereplay.ledger.store import ObjectStore
    from stagereplay.ledger.tables import COMPARISON_SCHEMA, TRAJECTORY_SCHEMA, read_table, write_table

    for construction in args.constructions:
        parse_construction(construction)
    specs = comparisons(args.primary, args.matched_precision, args.replicas, args.precisions, args.constructions)
    for name in dict.fromkeys(args.replications):
        if name != args.primary:
            specs += replication_comparisons(name, args.matched_precision)
    # With the model records given, a cache that is not stored (store_caches selected or none) is rebuilt.
    models = ModelPool(dict(args.model), runtime_from_args(args)) if args.model else None
    stores = [ObjectStore(root) for root in [args.store, *args.source_store]]
    table = comparison_table(read_table(args.trajectories, TRAJECTORY_SCHEMA), CacheSource(stores, models), specs)
    write_table(table.to_pylist(), COMPARISON_SCHEMA, args.out)


def add_compare_command(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare trajectory pairs of E1, E2 and E3: caches per layer, suffixes per token"
    )
    p.add_argument("--trajectories", required=True)
    p.add_argument("--store", required=True, help="object store directory")
    p.add_argument(
        "--source-store",
        nargs="*",
        default=[],
        help="further stores a cache may be read from (the audit's comparisons: the saved ledger's)",
    )
    add_rebuild_runtime(p)
    p.add_argument("--primary", required=True, help="the checkpoint E1 (with replicas), E2 and E3 run on")
    p.add_argument(
        "--replications",
        nargs="*",
        default=[],
        help="other checkpoints, each with only E1 live and prefill of replica 0 (the outcome-blind replication)",
    )
    p.add_argument("--matched-precision", required=True, help="precision of E1 (its live prefix feeds E2)")
    p.add_argument("--replicas", type=int, required=True, help="replicas per E1 side")
    p.add_argument("--precisions", nargs="+", required=True, help="E2/E3 precisions")
    p.add_argument(
        "--constructions", nargs="+", required=True, help="E2 constructions (incremental, prefill, chunked:N)"
    )
    p.add_argument("--out", required=True, help="comparisons table to write (Parquet)")
    p.set_defaults(func=cmd_compare)


def cmd_summarize(args) -> None:
    from stagereplay.ledger.tables import (
        COMPARISON_SCHEMA,
        FACTOR_SCHEMA,
        SERVED_SCHEMA,
        TRAJECTORY_SCHEMA,
        TRANSPLANT_SCHEMA,
        read_table,
    )
    from stagereplay.report.controls import check_controls
    from stagereplay.report.factor_summary import e6_controls
    from stagereplay.report.summary import summary, write_json

    factors = read_table(args.factors, FACTOR_SCHEMA) if args.factors else None
    if factors is not None:
        # A control that did not reproduce the reference means the E6 harness is broken: no figure is written.
        check_controls(e6_controls(factors.to_pylist()))
    comparisons = read_table(args.comparisons, COMPARISON_SCHEMA)
    trajectories = read_table(args.trajectories, TRAJECTORY_SCHEMA)
    transplants = read_table(args.transplants, TRANSPLANT_SCHEMA) if args.transplants else None
    served = read_table(args.served, SERVED_SCHEMA) if args.served else None
    write_json(summary(comparisons, trajectories, __version__, transplants, factors, served), args.out)


def add_summarize_command(sub) -> None:
    p = sub.add_parser("summarize", help="write summary.json from the ledger tables")
    p.add_argument("--trajectories", required=True)
    p.add_argument("--comparisons", required=True)
    p.add_argument("--transplants", default=None)
    p.add_argument("--factors", default=None, help="tables/factors.parquet (E6), when the config has factors")
    p.add_argument("--served", default=None, help="tables/served.parquet, when the config serves requests")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_summarize)


COMMANDS = {
    "store-caches-policy": add_store_caches_policy_command,
    "provenance": add_provenance_command,
    "apply-storage": add_apply_storage_command,
    "gather": add_gather_command,
    "compare": add_compare_command,
    "summarize": add_summarize_command,
}
