"""Every config the project ships schedules a whole run: a dry run of each succeeds, so none can rot."""

from __future__ import annotations

import pytest
from workflow_helpers import REPO, snakemake, snakemake_command, write_config

SHIPPED = sorted(
    str(path.relative_to(REPO)) for path in [*REPO.glob("config/*.yaml"), *REPO.glob("bench/config_*.yaml")]
)


@pytest.mark.parametrize("config", SHIPPED)
def test_shipped_config_dry_runs(config, tmp_path):
    # The config as shipped, in a fresh ledger: every job from the model on is scheduled.
    configfile = write_config(tmp_path / "config.yaml", base=config, ledger_dir=str(tmp_path / "ledger"))
    result = snakemake(tmp_path, configfile, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    scheduled = result.stdout + result.stderr
    for rule in ("register_model", "live", "rebuild", "compare", "summary", "report"):
        assert f"rule {rule}:" in scheduled, (config, rule)


def test_the_all200_config_schedules_every_item_of_the_published_run(tmp_path):
    # docs/all200.md publishes this design's run: 200 items in 8 shards, 3 live and 6 rebuild trajectories
    # per shard (E1 x2 replicas, E2 2x2, E3), and E5's selected and outcome-blind transplant jobs per shard.
    configfile = write_config(tmp_path / "config.yaml", base="config/all200.yaml", ledger_dir=str(tmp_path / "ledger"))
    result = snakemake(tmp_path, configfile, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    counts = dict(
        line.split()
        for line in (result.stdout + result.stderr).splitlines()
        if len(line.split()) == 2 and line.split()[1].isdigit()
    )
    assert (counts["live"], counts["rebuild"], counts["transplant"]) == ("24", "48", "16")


def test_the_first8_overlay_stacks_on_the_server_sweep(tmp_path):
    # docs/findings.md's 8-item sweep: the overlay after config/factors_llamaserver.yaml keeps its every level and
    # server, on one shard of 8 items, in the overlay's own ledger (here moved under tmp_path).
    import subprocess

    base = write_config(tmp_path / "base.yaml", base="config/factors_llamaserver.yaml")
    overlay = write_config(
        tmp_path / "first8.yaml", base="config/overlays/first8.yaml", ledger_dir=str(tmp_path / "l8")
    )
    command = snakemake_command(tmp_path, base, "--dry-run")
    command.insert(command.index(str(base)) + 1, str(overlay))
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    scheduled = result.stdout + result.stderr
    counts = dict(
        line.split() for line in scheduled.splitlines() if len(line.split()) == 2 and line.split()[1].isdigit()
    )
    assert (counts["factor"], counts["served"], counts["live"]) == ("26", "6", "2")
    assert f"{tmp_path / 'l8'}/runs/served/np-1.parquet" in scheduled


def test_the_schemas_precision_takes_what_the_registry_takes():
    """The config schema spells the precision pattern once ($defs), and it must take exactly the precisions some
    engine takes: every name and every K-V pair of the registry's, and none of a few that no engine takes."""
    import itertools
    import re

    import yaml

    from stagereplay.engines.registry import SPECS, any_precision

    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    pattern = schema["$defs"]["precision"]["pattern"]
    names = sorted({name for spec in SPECS.values() for name in spec.precisions})
    candidates = [*names, *("-".join(pair) for pair in itertools.product(names, repeat=2)), "q5_1", "int8", "bf16-"]
    for candidate in candidates:
        assert (re.fullmatch(pattern.strip("^$"), candidate) is not None) == any_precision(candidate), candidate
    assert yaml.safe_dump(schema).count(pattern) == 1
