"""The arguments several commands share: a model job's options and the one context they give (``job_context``),
and the checkpoints a light job may rebuild a cache with."""

from __future__ import annotations

import argparse

from stagereplay.engines.runtime import add_runtime_options


def runtime(args):
    """The runtime a job's options give (engines.runtime: the one translation back)."""
    from stagereplay.engines.runtime import runtime_from_args

    return runtime_from_args(args)


def job_context(args):
    """The context a model job's options (``add_runtime``) give: the one place a job's context is built."""
    from stagereplay.experiments.job import JobContext, ShardSpec

    return JobContext.read(
        args.model_record,
        runtime=runtime(args),
        shard_spec=ShardSpec(
            checkpoint=args.checkpoint,
            precision=args.precision,
            replica=args.replica,
            shard=args.shard,
            shard_size=args.shard_size,
        ),
        items_path=args.items,
        suffix_tokens=args.suffix_tokens,
        store_root=args.store,
        out_path=args.out,
        prompts_path=getattr(args, "prompts", None),  # only the live and rebuild commands take --prompts
        source_store_root=args.source_store,
        store_caches=args.store_caches,
    )


def _precision(text: str) -> str:
    """A precision some engine takes (bf16, fp16, fp32, or a llama.cpp cache type such as q8_0 or q8_0-fp16)."""
    from stagereplay.engines.registry import precision_spec
    from stagereplay.engines.spec import SpecError

    try:
        precision_spec(text)
    except SpecError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_runtime(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-record", required=True, help="model.json written by register-model")
    parser.add_argument("--items", required=True, help="normalised items.jsonl")
    parser.add_argument("--checkpoint", required=True, help="checkpoint name (recorded in every row)")
    add_runtime_options(parser, model_job=True, precision=_precision)
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


def add_model_records(parser: argparse.ArgumentParser, help_text: str, required: bool = False) -> None:
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


def add_rebuild_runtime(parser: argparse.ArgumentParser) -> None:
    """What a light job needs to rebuild a cache that is not stored: the models and how to run them."""
    add_model_records(parser, "a checkpoint's name and model.json (repeat); without one, every cache must be stored")
    add_runtime_options(parser, model_job=False)
