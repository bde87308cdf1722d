"""The arguments several commands share: a model job's runtime and shard, and the checkpoints a light job
may rebuild a cache with."""

from __future__ import annotations

import argparse


def runtime(args):
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


def spec(args):
    from stagereplay.experiments.shards import ShardSpec

    return ShardSpec(
        checkpoint=args.checkpoint,
        precision=args.precision,
        replica=args.replica,
        shard=args.shard,
        shard_size=args.shard_size,
    )


def _precision(text: str) -> str:
    """bf16, or a precision llama.cpp runs (fp16, fp32, or a cache type such as q8_0 or q8_0-fp16)."""
    from stagereplay.engines.cache_types import CacheTypeError, cache_types

    if text != "bf16":
        try:
            cache_types(text)
        except CacheTypeError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_runtime(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, as the model jobs ran")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention, as the jobs ran")
    parser.add_argument("--trust-remote-code", action="store_true")
