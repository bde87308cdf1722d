"""How an engine runs a checkpoint (``Runtime``), and the one translation between it and the command line.

No torch. The workflow turns the config's ``runtime`` block into a model job's options with
``runtime_options``; the CLI declares them with ``add_runtime_options`` and reads them back into a
``Runtime`` with ``runtime_from_args``. A job that loads models of several precisions (compare,
apply-storage, a transplant's donors) is given the runtime less its precision, and sets the precision
per model (``Runtime.at``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class Runtime:
    precision: str | None  # None: set per model by the job that loads several (``at``)
    device: str  # "cpu", "cuda" or "auto"
    threads: int
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    flash_attn: bool = False  # llama.cpp's flash attention (its quantized V caches need it)
    # What the fit check at load time needs: the longest sequence a job holds (prompt, stage and
    # suffix; 0: weights only) and the device memory it may use (None: the device's free memory).
    max_positions: int = 0
    device_memory_gb: float | None = None

    def at(self, precision: str) -> Runtime:
        """The same runtime at ``precision``."""
        return dataclasses.replace(self, precision=precision)


def runtime_options(runtime: dict) -> list[str]:
    """The config's runtime block (or the audit's) as a job's command-line options."""
    options = [
        f"--device {runtime['device']}",
        f"--threads {runtime['threads']}",
        f"--attn-implementation {runtime['attn_implementation']}",
    ]
    if runtime["flash_attn"]:
        options.append("--flash-attn")
    if runtime["trust_remote_code"]:
        options.append("--trust-remote-code")
    return options


def add_runtime_options(parser: argparse.ArgumentParser, *, model_job: bool, precision=str) -> None:
    """The options ``runtime_options`` writes; a model job's also take its precision (``precision``: the
    argparse type that checks one) and fit-check limits (a job that rebuilds caches on several models takes
    each model's precision from the rows it rebuilds)."""
    if model_job:
        parser.add_argument(
            "--precision", required=True, type=precision, help="bf16, fp16, fp32 or a llama.cpp cache type"
        )
    parser.add_argument("--device", default="cpu", choices=list(DEVICES))
    if model_job:
        parser.add_argument(
            "--threads", type=int, required=True, help="intra-op threads (fixed: replicas depend on it)"
        )
    else:
        parser.add_argument("--threads", type=int, default=1, help="intra-op threads, as the model jobs ran")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument(
        "--flash-attn",
        action="store_true",
        help="llama.cpp's flash attention" + ("" if model_job else ", as the jobs ran"),
    )
    if model_job:
        parser.add_argument(
            "--trust-remote-code", action="store_true", help="run code shipped with the model (off by default)"
        )
        parser.add_argument(
            "--max-positions", type=int, default=0, help="longest sequence a job holds (the fit check's caches)"
        )
        parser.add_argument(
            "--device-memory-gb",
            type=float,
            default=None,
            help="device memory the job may use (default: what is free)",
        )
    else:
        parser.add_argument("--trust-remote-code", action="store_true")


def runtime_from_args(args: argparse.Namespace) -> Runtime:
    """The runtime the options of ``add_runtime_options`` give (precision None where a job takes none)."""
    return Runtime(
        precision=getattr(args, "precision", None),
        device=args.device,
        threads=args.threads,
        attn_implementation=args.attn_implementation,
        trust_remote_code=args.trust_remote_code,
        flash_attn=args.flash_attn,
        max_positions=getattr(args, "max_positions", 0),
        device_memory_gb=getattr(args, "device_memory_gb", None),
    )
