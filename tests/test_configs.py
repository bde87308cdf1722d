"""Every config the project ships schedules a whole run, the same from any directory, and states only what differs
from the default run (the schema's defaults); `stagereplay config` shows the result and each value's source."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from workflow_helpers import REPO, snakemake, snakemake_command, stagereplay, write_config

SHIPPED = sorted(
    str(path.relative_to(REPO)) for path in [*REPO.glob("config/*.yaml"), *REPO.glob("bench/config_*.yaml")]
)


def scheduled_jobs(workdir: Path, configfile: str) -> list[str]:
    """Every job a dry run of the config schedules in ``workdir`` (all of them, --forceall, whatever a ledger there
    holds): its rule, outputs, wildcards and shell command, sorted."""
    command = snakemake_command(workdir, Path(configfile), "--dry-run", "--forceall", "--nolock", "--printshellcmds")
    result = subprocess.run(command, capture_output=True, text=True, cwd=workdir)
    assert result.returncode == 0, (configfile, result.stderr[-3000:])
    jobs, job = [], None
    for line in (result.stdout + result.stderr).splitlines():
        if re.match(r"^(local)?(rule|checkpoint) \S+:", line):
            job = [line.removeprefix("local")]
            jobs.append(job)
        elif job is not None and line.strip() and not line.strip().startswith(("jobid:", "reason:")):
            job.append(line)
        else:
            job = None
    return sorted("\n".join(job) for job in jobs)


@pytest.mark.parametrize("config", SHIPPED)
def test_shipped_config_schedules_the_same_jobs_from_any_directory(config, tmp_path):
    # The config as users run it, from the repo root, and named by its full path from another directory: the
    # defaults live in the schema, not in a file of the working directory, so both schedule the same jobs.
    from_root = scheduled_jobs(REPO, config)
    assert scheduled_jobs(tmp_path, str(REPO / config)) == from_root
    for rule in ("register_model", "live", "rebuild", "compare", "summary", "report"):
        assert any(job.startswith(f"rule {rule}:") for job in from_root), (config, rule)


@pytest.mark.parametrize("config", [name for name in SHIPPED if name != "config/config.yaml"])
def test_a_shipped_preset_states_only_what_differs_from_the_default_run(config):
    # config/config.yaml names the default run's ledger and nothing else; every other preset is short, and
    # restates no value of the default run (a restated default would hide where the value lives).
    from stagereplay.design.schema import resolve_config

    defaults = resolve_config({})
    stated = yaml.safe_load((REPO / config).read_text())
    restated = [".".join(path) for path, value in leaves(stated) if value_at(defaults, path) == value]
    assert restated == [], config
    lines = [
        line for line in (REPO / config).read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    assert len(lines) <= 20, config


def leaves(mapping: dict, prefix: tuple = ()):
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def value_at(mapping: dict, path: tuple):
    for key in path:
        if not isinstance(mapping, dict) or key not in mapping:
            return _ABSENT
        mapping = mapping[key]
    return mapping


_ABSENT = object()


def test_stagereplay_config_prints_the_same_config_from_any_directory(tmp_path):
    from_root = stagereplay("config", "config/factors.yaml", cwd=REPO)
    elsewhere = stagereplay("config", str(REPO / "config" / "factors.yaml"), cwd=tmp_path)
    assert from_root.returncode == 0, from_root.stderr
    assert elsewhere.stdout == from_root.stdout
    assert "limit: 48" in from_root.stdout and "# config/factors.yaml" in from_root.stdout


def test_stagereplay_config_names_each_values_source_and_reads_back(tmp_path):
    from stagereplay.design.schema import config_layers, effective_config

    files = ["config/factors_llamaserver.yaml", "config/overlays/first8.yaml"]
    result = stagereplay("config", *files, "--config", "load_runs=5", cwd=REPO)
    assert result.returncode == 0, result.stderr
    lines = {
        line.split("#")[0].strip(): line.split("#")[-1].strip() for line in result.stdout.splitlines() if "#" in line
    }
    assert lines["limit: 8"] == "config/overlays/first8.yaml"  # the overlay over the preset's 64
    assert lines["flash_attn: true"] == "config/factors_llamaserver.yaml"
    assert lines["max_new_tokens: 16"] == "schema"
    assert lines["load_runs: 5"] == "--config"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        expected = effective_config(config_layers(files, ["load_runs=5"]))
    assert yaml.safe_load(result.stdout) == expected
    assert list(yaml.safe_load(result.stdout)["checkpoints"]) == ["smollm2-135m-llamaserver"]  # no other gained


def test_stagereplay_config_refuses_a_missing_file_in_one_line(tmp_path):
    result = stagereplay("config", str(tmp_path / "nothere.yaml"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"stagereplay: error: config file {tmp_path / 'nothere.yaml'} not readable (No such file or directory)"
        " — give a config file's path"
    ]


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
    # The 8-item sweep (docs/runs/2026-12-07-factors-llamaserver-8.md): the overlay after
    # config/factors_llamaserver.yaml keeps its every level and server, on one shard of 8 items, in the overlay's
    # own ledger (here moved under tmp_path).
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
