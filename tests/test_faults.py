"""Killed runs, with real processes: a SIGKILL never costs a saved result (one core against two: test_slurm.py).

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
from workflow_helpers import fingerprints, snakemake, snakemake_command, write_config

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
