"""Before a run: the config it computes, each value's source (`stagereplay config`), and what it will store and
need (`stagereplay plan`)."""

from __future__ import annotations

from pathlib import Path


def cmd_plan(args) -> None:
    """The run's parse-time checks (those snakemake runs, design.run_plan), then its projection."""
    from stagereplay.design.run_plan import default_repo, plan_run
    from stagereplay.design.schema import load_config
    from stagereplay.design.storage_plan import project_run, render

    config = load_config(args.configfile, {"ledger_dir": args.ledger_dir} if args.ledger_dir else None)
    projection, shapes, model = project_run(plan_run(config, default_repo()), args.model_config)
    print(render(projection, model, shapes))


def add_plan_command(sub) -> None:
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


def cmd_config(args) -> None:
    """The effective config, as the workflow resolves it (design.schema), each value with its source."""
    from stagereplay.design.run_plan import default_repo
    from stagereplay.design.schema import config_layers, effective_config, render_config, value_sources

    layers = config_layers(args.configfiles, args.config)
    repo = default_repo().resolve()
    # A file in the checkout is named from its root, so the same file reads the same from any directory.
    named = [(_repo_relative(name, repo) if name != "--config" else name, layer) for name, layer in layers]
    config = effective_config(named)
    print(render_config(config, value_sources(config, named)))
    if config.get("mode") == "audit":
        print("# mode audit: the workflow audits the design its ledger's provenance.json records, not this one")


def _repo_relative(path: str, repo: Path) -> str:
    resolved = Path(path).resolve()
    return str(resolved.relative_to(repo)) if resolved.is_relative_to(repo) else path


def add_config_command(sub) -> None:
    p = sub.add_parser(
        "config",
        help="print the config a run computes: the files merged as snakemake merges them, completed with the"
        " schema's defaults, each value's source in a comment",
        description="Print the effective config of `snakemake --configfile FILE... --config KEY=VALUE...` as"
        " YAML, each value followed by its source: schema (the default run's value), a file, or --config. The"
        " workflow resolves its config with the same function. Example: stagereplay config config/factors.yaml",
    )
    p.add_argument(
        "configfiles", nargs="*", metavar="FILE", help="config files in snakemake's order (none: the default run)"
    )
    p.add_argument(
        "--config", nargs="*", default=[], metavar="KEY=VALUE", help="overrides, as snakemake --config takes them"
    )
    p.set_defaults(func=cmd_config)


COMMANDS = {
    "config": add_config_command,
    "plan": add_plan_command,
}
