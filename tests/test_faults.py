"""Killed runs and concurrency, with real processes: a SIGKILL never costs a saved result.

The run is killed three times — mid-shard after the first item's artifacts are
stored, while an object's bytes lie under a temporary name, and while the
gathered trajectories table is being written — then completes. `verify` passes
after every kill, and every fingerprint equals that of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from workflow_helpers import fingerprints, ledger_snapshot, snakemake, snakemake_command, write_config

from stagereplay.audit.verify import verify_ledger

pytestmark = pytest.mark.slow

FAULT_INJECTION = Path(__file__).parent / "fault_injection"

KILL_POINTS = [
    # (where, destination substring to hold at, renames let through first)
    ("mid-shard, after the first item's prefix, cache and suffix objects", "/objects/", 3),
    ("while an object is written under a temporary name", "/objects/", 0),
    ("while gathering the trajectories table", "tables/trajectories.parquet", 0),
]


def run_and_kill(workdir: Path, config: Path, pattern: str, allowed: int, timeout: float = 300) -> str:
    marker = workdir / "paused.txt"
    marker.unlink(missing_ok=True)
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_INJECTION), os.environ.get("PYTHONPATH")])),
        "STAGEREPLAY_PAUSE_AT": pattern,
        "STAGEREPLAY_PAUSE_AFTER": str(allowed),
        "STAGEREPLAY_PAUSE_MARKER": str(marker),
    }
    process = subprocess.Popen(
        snakemake_command(workdir, config),
        cwd=workdir,
        env=environment,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if process.poll() is not None:
            raise AssertionError(f"the run ended before reaching {pattern!r}: {process.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"the run never reached {pattern!r}")
        time.sleep(0.05)
    held = marker.read_text()
    os.killpg(process.pid, signal.SIGKILL)
    for line in held.splitlines():  # a held job in a session of its own would survive the group kill
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=60)
    return held


def test_killed_runs_resume_to_the_same_fingerprints(test_run, tmp_path):
    _, reference, _ = test_run
    ledger = tmp_path / "ledger"
    config = write_config(tmp_path / "config.yaml", ledger_dir=str(ledger))
    for where, pattern, allowed in KILL_POINTS:
        held = run_and_kill(tmp_path, config, pattern, allowed)
        temporary = Path(held.split()[1])
        assert temporary.name.startswith(".") and temporary.name.endswith(".tmp"), (where, held)
        # Nothing under a real name is partial: every object hashes to its name, every table to its digest.
        assert verify_ledger(ledger).faults == [], where
        assert not Path(held.split()[2]).exists() or pattern == "/objects/", where
        unlock = snakemake(tmp_path, config, "--unlock")  # SIGKILL leaves snakemake's lock behind
        assert unlock.returncode == 0, unlock.stderr[-2000:]
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    report = verify_ledger(ledger)
    assert report.faults == [] and report.leftover_temporaries >= 1
    assert fingerprints(ledger) == fingerprints(reference)


def replica_fingerprints(ledger: Path) -> dict[tuple, dict[int, tuple]]:
    """Per trajectory side and item, each replica's fingerprints (each replica is its own job)."""
    sides: dict[tuple, dict[int, tuple]] = {}
    for (table, *identity), values in fingerprints(ledger).items():
        if table == "trajectories":
            checkpoint, construction, precision, prefix_precision, replica, item = identity
            sides.setdefault((checkpoint, construction, precision, prefix_precision, item), {})[replica] = values
    return sides


def test_one_core_and_two_cores_give_identical_fingerprints(test_run, tmp_path):
    _, reference, _ = test_run  # run with --cores 2: two model jobs at a time (threads 1 each)
    ledger = tmp_path / "ledger"
    config = write_config(tmp_path / "config.yaml", ledger_dir=str(ledger))
    result = snakemake(tmp_path, config, cores=1)  # one job at a time
    assert result.returncode == 0, result.stderr[-4000:]
    assert fingerprints(ledger) == fingerprints(reference)
    # Byte for byte, too: no object's bytes depend on which job stored it first.
    objects = ledger_snapshot(ledger / "objects")
    assert objects and objects == ledger_snapshot(reference / "objects")
    # Replicas ran side by side (2 jobs) in one run and one after another in the other: every
    # replica of a side reproduces the same fingerprints in both.
    for run in (reference, ledger):
        replicated = [found for found in replica_fingerprints(run).values() if len(found) > 1]
        assert len(replicated) == 8, run  # E1 live and prefill of 4 items, 2 replicas each
        assert all(len(set(found.values())) == 1 for found in replicated), run
