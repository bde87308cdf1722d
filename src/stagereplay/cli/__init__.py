"""The command line: `stagereplay <command>` and `python -m stagereplay <command>`, as the Snakemake rules call it.

One thin subcommand per stage; each imports what it runs when it runs, so `stagereplay --help`
and the parse-time commands stay quick.
"""

from __future__ import annotations

import argparse
import sys

from stagereplay import __version__
from stagereplay.cli import inputs, ledger, model_jobs, plan, review, servers

# The order `stagereplay --help` lists the commands in: a run's, from its inputs to its card.
HELP_ORDER = (
    "make-default-items",
    "items",
    "fetch-wheel-member",
    "convert-gguf",
    "random-qwen2",
    "register-model",
    "qwen2-gguf",
    "prompts",
    "live",
    "rebuild",
    "store-caches-policy",
    "provenance",
    "apply-storage",
    "gather",
    "select-transplants",
    "transplant",
    "factor",
    "served",
    "kernel-worker",
    "compare",
    "summarize",
    "config",
    "plan",
    "probe",
    "verify",
    "show",
    "audit",
    "report",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagereplay", description=__doc__)
    parser.add_argument("--version", action="version", version=f"stagereplay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        **servers.COMMANDS,
        **inputs.COMMANDS,
        **model_jobs.COMMANDS,
        **ledger.COMMANDS,
        **plan.COMMANDS,
        **review.COMMANDS,
    }
    for command in sorted(commands, key=HELP_ORDER.index):
        commands[command](sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from stagereplay.design.factors import FactorError
    from stagereplay.design.names import ConstructionError, TransplantError
    from stagereplay.design.run_plan import RunRefused
    from stagereplay.design.schema import ConfigError
    from stagereplay.design.storage import StorageError
    from stagereplay.engines.shapes import PlanError
    from stagereplay.engines.spec import ModelError
    from stagereplay.inputs.checkpoints import CheckpointError
    from stagereplay.inputs.items import ItemError
    from stagereplay.ledger.tables import LedgerError
    from stagereplay.report.controls import ControlFailed

    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (
        CheckpointError,
        ConfigError,
        ConstructionError,
        ControlFailed,
        FactorError,
        ItemError,
        LedgerError,
        ModelError,
        PlanError,
        RunRefused,
        StorageError,
        TransplantError,
    ) as error:
        print(f"stagereplay: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
