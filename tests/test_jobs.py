"""The one job list (design.jobs): what it holds, that it needs no torch, and that the workflow runs exactly it."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import yaml
from workflow_helpers import REPO, snakemake, write_config

from stagereplay.design.jobs import job_list, live, rebuilt
from stagereplay.design.schema import load_config, resolve_config
from stagereplay.ledger.layout import LedgerLayout, construction_of_token, construction_token


def test_the_test_design_has_the_trajectories_the_paper_describes():
    jobs = job_list(load_config(REPO / "config/test.yaml"))
    name = jobs.primary
    expected = {
        live(name, "bf16", 0),  # E1, with its replica
        live(name, "bf16", 1),
        rebuilt(name, "bf16", "bf16", "prefill", 0),
        rebuilt(name, "bf16", "bf16", "prefill", 1),
        rebuilt(name, "bf16", "bf16", "incremental"),  # E2 over the bf16 prefix (prefill bf16 is E1's)
        rebuilt(name, "bf16", "fp32", "incremental"),
        rebuilt(name, "bf16", "fp32", "prefill"),
        live(name, "fp32"),  # E3 at fp32 (at bf16 it is E1 live and E2 incremental)
        rebuilt(name, "fp32", "fp32", "incremental"),
    }
    assert set(jobs.trajectories) == expected and len(jobs.trajectories) == len(expected)
    selections = [(job.selection, job.precision, len(job.pairs)) for job in jobs.transplants]
    assert selections == [
        ("selected", "bf16", 2),
        ("outcome_blind", "bf16", 2),
        ("cross_precision", "fp32", 2),
        ("cross_precision", "bf16", 2),
    ]
    # Each selection transplants both ways; the cross-precision jobs are each other's reverse.
    cross_up, cross_down = jobs.transplants[2].pairs, jobs.transplants[3].pairs
    assert cross_down == tuple((recipient, donor) for donor, recipient in cross_up)


def test_the_job_list_and_the_projection_import_no_torch():
    probe = "import sys, stagereplay.design.jobs, stagereplay.design.storage_plan; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0


def scheduled_outputs(workdir, config) -> set[str]:
    result = snakemake(workdir, config, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    return {path for line in re.findall(r"output: (.*)", result.stdout + result.stderr) for path in line.split(", ")}


def test_the_workflow_schedules_exactly_the_job_list(tmp_path):
    """Every shard table snakemake schedules comes from the job list, and every job of the list is scheduled:
    a rule or an input function that derived its own jobs would fail here. Outcome-blind on a second
    checkpoint, so the replication's trajectories are counted too."""
    base = yaml.safe_load((REPO / "config/test.yaml").read_text())
    second = {"random_qwen2": {"seed": 3, "layers": 2, "hidden": 64, "near_ties": True}}
    config = write_config(
        tmp_path / "config.yaml",
        ledger_dir=str(tmp_path / "ledger"),
        checkpoints={**base["checkpoints"], "z-second": second},
        transplant={"outcome_blind": {**base["transplant"]["outcome_blind"], "checkpoint": "z-second"}},
    )
    resolved = resolve_config(yaml.safe_load(config.read_text()))
    jobs = job_list(resolved)
    layout = LedgerLayout(tmp_path / "ledger")
    shards = [f"{shard:03d}" for shard in range(math.ceil(resolved["items"]["limit"] / resolved["shard_size"]))]
    expected = {layout.trajectory_table(*t.fields(), shard) for t in jobs.trajectories for shard in shards}
    expected |= {
        layout.transplant_table(job.selection, job.checkpoint, job.precision, shard)
        for job in jobs.transplants
        for shard in shards
    }
    scheduled = {path for path in scheduled_outputs(tmp_path, config) if "/runs/" in path}
    assert jobs.replications == ("z-second",)  # write_config sorts the checkpoints: the primary stays first
    assert scheduled == expected


def test_a_construction_and_its_path_component_map_both_ways_and_a_shard_table_names_its_job():
    for construction in ("live", "prefill", "incremental", "chunked:16"):
        assert construction_of_token(construction_token(construction)) == construction
    assert construction_token("chunked:16") == "chunked-16"
    layout = LedgerLayout("ledger")
    assert layout.job_kind(layout.live_table("m", "bf16", 0, "000")) == "live"
    assert layout.job_kind(layout.rebuilt_table("m", "bf16", "fp32", "chunked:4", 1, "002")) == "rebuild"
    assert layout.job_kind(layout.transplant_table("selected", "m", "bf16", "000")) == "transplant"
    assert layout.job_kind(layout.factor_table("m", "bf16", "threads", "t2", "000")) == "factor"
