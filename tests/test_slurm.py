"""Where the jobs run changes no byte: one core, two cores, and a real SLURM controller with profiles/slurm.

config/test.yaml run one job at a time gives the session's two-core run (`test_run`) byte for byte; a smaller
config through SLURM gives the same fingerprints for every trajectory it computes; a job that fails on the
cluster fails the run with its one-line error. The SLURM runs mostly wait on the queue's polling, so the
one-core run goes at the same time.

CI starts a single-node cluster first (`bash .ci/slurm.sh start`, called by
.ci/run). Without SLURM the SLURM tests skip with the reason; with
STAGEREPLAY_REQUIRE_SLURM=1 (set by .ci/run) a missing SLURM fails them instead.

The CI node has no GPU and a few GB of memory, so the test runs a variant of the
real profile that changes only that: GPU requests dropped, memory capped, status
polled with squeue (no slurmdbd, so no sacct), soon after submission and every second.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from workflow_helpers import REPO, ledger_snapshot, skip_unless_required, snakemake, write_config
from workflow_helpers import fingerprints as ledger_fingerprints

pytestmark = pytest.mark.slow

PROFILE = REPO / "profiles" / "slurm" / "config.yaml"
MODEL_RULES = ("live", "rebuild", "transplant")
LOCAL_RULES = ("items", "gather", "compare", "gather_transplants", "summary", "select_transplants")
# A run that hangs instead of failing is a failure of the test, not a stuck CI.
TIMEOUT_S = 900
# config/test.yaml, one precision and no cross-precision casts: every kind of model
# job (live, rebuild, transplant) runs under SLURM in about ten jobs.
SMALL = {"fixed_prefix": {"precisions": ["bf16"]}, "transplant": {"cross_precision": None}}


def slurm_problem() -> str | None:
    """Why no SLURM cluster can run jobs here, or None when one can."""
    for tool in ("sbatch", "squeue", "sinfo", "scontrol"):
        if shutil.which(tool) is None:
            return f"{tool} not found — install SLURM and start a test cluster with: bash .ci/slurm.sh start"
    try:
        result = subprocess.run(["sinfo", "--noheader", "--format=%t"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s — is slurmctld running? (bash .ci/slurm.sh start)"
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return f"sinfo failed ({last}) — start the test cluster with: bash .ci/slurm.sh start"
    if not any(state.startswith(("idle", "mix", "alloc")) for state in result.stdout.split()):
        return (
            f"no SLURM node is up (states: {result.stdout.split() or 'none'}) — check slurmd (bash .ci/slurm.sh start)"
        )
    return None


def ci_profile(directory: Path) -> Path:
    """profiles/slurm adapted to the CPU-only test node; every other setting is the real profile's."""
    profile = yaml.safe_load(PROFILE.read_text())
    for resources in profile["set-resources"].values():
        for key in ("gpu", "gpu_model", "gres"):
            resources.pop(key, None)
        resources["mem_mb"] = min(resources.get("mem_mb", 2000), 2000)
    profile["slurm-status-command"] = "squeue"  # sacct needs slurmdbd; the test cluster keeps jobs (MinJobAge)
    profile["slurm-init-seconds-before-status-checks"] = 1
    profile["seconds-between-status-checks"] = 1  # the test's jobs take seconds, not the hours the profile is for
    profile["slurm-keep-successful-logs"] = True  # so the test can see which rules ran as SLURM jobs
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(profile))
    return directory


def through_slurm(workdir: Path, configfile: Path, profile: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "--configfile",
        str(configfile),
        "--workflow-profile",
        str(profile),
        "--directory",
        str(workdir),
    ]
    # Output to a file, not a pipe: nobody reads a pipe while the local run goes, and a full one would stall snakemake.
    with open(workdir / "snakemake.log", "w") as log:
        return subprocess.Popen(command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, workdir: Path, started: float) -> tuple[int, str, float]:
    try:
        process.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        output = (workdir / "snakemake.log").read_text()
        pytest.fail(f"snakemake through SLURM did not finish within {TIMEOUT_S} s (it hangs):\n{output[-3000:]}")
    return process.returncode, (workdir / "snakemake.log").read_text(), time.monotonic() - started


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """config/test.yaml run locally on one core; while it runs, where a cluster is up, a good and a failing run
    through SLURM."""
    base = tmp_path_factory.mktemp("slurm")
    one_core = base / "one-core"
    one_core.mkdir()
    one_core_config = write_config(one_core / "config.yaml", ledger_dir=str(one_core / "ledger"))
    problem = slurm_problem()
    if problem is not None:
        result = snakemake(one_core, one_core_config, cores=1)
        return {"one_core": (one_core / "ledger", result), "slurm_problem": problem}
    profile = ci_profile(base / "profile")
    cluster, bad = base / "cluster", base / "bad"
    for directory in (cluster, bad):
        directory.mkdir()
    cluster_config = write_config(cluster / "config.yaml", ledger_dir=str(cluster / "ledger"), **SMALL)
    fake = bad / "model.gguf"
    fake.write_bytes(b"GGUF not really")
    # The checksum is checked inside the convert_gguf job, so this fails on the cluster, not at parse time.
    bad_config = write_config(
        bad / "config.yaml",
        ledger_dir=str(bad / "ledger"),
        checkpoints={"fake": {"gguf": str(fake), "sha256": "0" * 64}},
    )
    started = time.monotonic()
    good_run = through_slurm(cluster, cluster_config, profile)
    bad_run = through_slurm(bad, bad_config, profile)
    try:
        result = snakemake(one_core, one_core_config, cores=1)  # one job at a time
        runs = {"cluster": (cluster, *finish(good_run, cluster, started)), "bad": (bad, *finish(bad_run, bad, started))}
    finally:
        for process in (good_run, bad_run):  # never leave a snakemake submitting jobs behind a failed test
            if process.poll() is None:
                process.kill()
                process.wait()
    return {**runs, "one_core": (one_core / "ledger", result), "slurm_problem": None}


@pytest.fixture(scope="module")
def slurm_runs(runs):
    skip_unless_required(runs["slurm_problem"], "STAGEREPLAY_REQUIRE_SLURM")
    return runs


def trajectory_fingerprints(ledger: Path) -> dict[tuple, tuple]:
    """The trajectory rows' fingerprints (``workflow_helpers.fingerprints``), one per row: keys are unique."""
    table = {key: values for key, values in ledger_fingerprints(ledger).items() if key[0] == "trajectories"}
    assert len(table) == pq.read_table(ledger / "tables" / "trajectories.parquet").num_rows, "rows share a key"
    return table


def replica_fingerprints(ledger: Path) -> dict[tuple, dict[int, tuple]]:
    """Per trajectory side and item, each replica's fingerprints (each replica is its own job)."""
    sides: dict[tuple, dict[int, tuple]] = {}
    for (_, *identity), values in trajectory_fingerprints(ledger).items():
        checkpoint, construction, precision, prefix_precision, replica, item = identity
        sides.setdefault((checkpoint, construction, precision, prefix_precision, item), {})[replica] = values
    return sides


def test_one_core_and_two_cores_give_identical_fingerprints(runs, test_run):
    _, reference, _ = test_run  # run with --cores 2: two model jobs at a time (threads 1 each)
    ledger, result = runs["one_core"]
    assert result.returncode == 0, result.stderr[-4000:]
    assert ledger_fingerprints(ledger) == ledger_fingerprints(reference)
    # Byte for byte, too: no object's bytes depend on which job stored it first.
    objects = ledger_snapshot(ledger / "objects")
    assert objects and objects == ledger_snapshot(reference / "objects")
    # Replicas ran side by side (2 jobs) in one run and one after another in the other: every
    # replica of a side reproduces the same fingerprints in both.
    for run in (reference, ledger):
        replicated = [found for found in replica_fingerprints(run).values() if len(found) > 1]
        assert len(replicated) == 8, run  # E1 live and prefill of 4 items, 2 replicas each
        assert all(len(set(found.values())) == 1 for found in replicated), run


def test_slurm_run_reproduces_the_local_fingerprints(slurm_runs, test_run):
    cluster, returncode, output, seconds = slurm_runs["cluster"]
    assert returncode == 0, output[-4000:]
    _, local_ledger, _ = test_run
    through_cluster, local = trajectory_fingerprints(cluster / "ledger"), trajectory_fingerprints(local_ledger)
    # 4 items x (E1 live and prefill x 2 replicas + E2/E3 incremental), each also in the local run.
    assert len(through_cluster) == 20
    differing = sorted(key for key in through_cluster if local.get(key) != through_cluster[key])
    assert not differing, differing[:5]
    print(f"\nSLURM run: {seconds:.0f} s wall")


def test_model_rules_ran_as_slurm_jobs_and_gathering_rules_locally(slurm_runs):
    cluster, returncode, output, _ = slurm_runs["cluster"]
    assert returncode == 0, output[-4000:]
    logs = cluster / ".snakemake" / "slurm_logs"
    submitted = {path.name.removeprefix("rule_") for path in logs.iterdir()} if logs.is_dir() else set()
    assert set(MODEL_RULES) <= submitted, submitted
    assert not submitted & set(LOCAL_RULES), submitted & set(LOCAL_RULES)
    assert "SLURM run ID" in output


def test_a_failing_job_fails_the_run_with_its_one_line_error(slurm_runs):
    bad, returncode, output, seconds = slurm_runs["bad"]
    assert returncode != 0
    assert "SLURM-job" in output and "convert_gguf" in output, output[-3000:]  # it failed on the cluster
    lines = [line for line in output.splitlines() if "checksum mismatch" in line]
    assert lines and "—" in lines[0], output[-3000:]  # the job's own error reaches the console (show-failed-logs)
    assert not (bad / "ledger" / "models" / "fake" / "converted").exists()


def model_rules(tmp_path: Path) -> set[str]:
    """Rules whose jobs declare a gpu resource (common.smk's MODEL_RESOURCES), read off a dry run."""
    result = snakemake(
        tmp_path,
        REPO / "config/test.yaml",
        "--dry-run",
        "--workflow-profile",
        "none",
        "--config",
        f"ledger_dir={tmp_path / 'ledger'}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rules, rule = set(), None
    for line in result.stdout.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[1].rstrip(":")
        elif line.strip().startswith("resources:") and "gpu=" in line:
            rules.add(rule)
    return rules


def test_profile_names_real_rules_and_requests_gpus_for_every_model_job(tmp_path):
    profile = yaml.safe_load(PROFILE.read_text())
    assert profile["executor"] == "slurm"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "--configfile",
            str(REPO / "config/test.yaml"),
            "--list-rules",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rules = set(result.stdout.split())
    named = set(profile["set-resources"])
    assert named <= rules, f"profile names rules the workflow lacks: {sorted(named - rules)}"
    assert not named & set(LOCAL_RULES), "localrules never run as SLURM jobs: drop them from set-resources"
    # A model rule added later (an audit rule, say) must get its GPU here too.
    running_models = model_rules(tmp_path)
    assert set(MODEL_RULES) <= running_models, running_models
    missing = sorted(rule for rule in running_models if profile["set-resources"].get(rule, {}).get("gpu") != 1)
    assert not missing, f"model rules without gpu: 1 in profiles/slurm/config.yaml: {missing} — add them like live"
    # Partition and account are the user's to fill in: never a real value in the shipped profile.
    assert not {"slurm_partition", "slurm_account"} & set(profile["default-resources"])
