"""A llama-server killed in the middle of a workflow: its job fails with one line, nothing half-written is left in
the ledger, and a rerun completes a ledger that verifies.

Real Snakemake, llama-server and the tiny GGUF; skipped without the server unless STAGEREPLAY_REQUIRE_LLAMASERVER=1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from test_llamaserver_engine import built, server_config  # noqa: F401 - fixture
from workflow_helpers import snakemake, snakemake_command, stagereplay

WAIT_SECONDS = 300


def _servers_under(folder: Path) -> list[int]:
    """The pids of llama-server processes whose command line names a file under ``folder``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if command and command[0].endswith(b"llama-server") and any(str(folder).encode() in part for part in command):
            found.append(int(entry.name))
    return found


def run_watching_servers(workdir: Path, config: Path, watched: Path) -> tuple[subprocess.CompletedProcess, set[int]]:
    """A workflow run, and every llama-server alive whose command line names a file under ``watched`` while it ran."""
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(_servers_under(watched))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = snakemake(workdir, config)
    finally:
        done.set()
        watcher.join()
    return result, seen


@pytest.mark.slow
def test_a_server_killed_mid_workflow_fails_its_job_in_one_line_and_a_rerun_completes(built, tmp_path):  # noqa: F811
    ledger, config = server_config(
        tmp_path, matched={"precision": "fp16"}, fixed_prefix={"precisions": ["fp16"]}, transplant={"enabled": False}
    )
    run = subprocess.Popen(
        snakemake_command(tmp_path, config, cores=1), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + WAIT_SECONDS
    while not (servers := _servers_under(tmp_path)):
        assert run.poll() is None and time.monotonic() < deadline, "no llama-server started"
        time.sleep(0.02)
    time.sleep(0.3)  # the job is talking to it
    os.kill(servers[0], signal.SIGKILL)
    _, stderr = run.communicate(timeout=WAIT_SECONDS)
    assert run.returncode != 0
    logged = [line for log in (ledger / "logs").rglob("*.log") for line in log.read_text().splitlines()]
    died = [
        line
        for line in logged
        if f"stagereplay: error: llama-server (pid {servers[0]}) died (killed by SIGKILL)" in line
    ]
    assert died, stderr.decode()[-3000:]
    # Nothing half-written: no table of the run exists, and no partial file anywhere in the ledger.
    assert not (ledger / "tables").exists() or not list((ledger / "tables").glob("*.parquet"))
    assert not [path for path in ledger.rglob("*") if ".partial" in path.name or path.name.startswith(".tmp")]
    assert not _servers_under(tmp_path)  # the killed job left no server behind

    rerun = snakemake(tmp_path, config)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    verified = stagereplay("verify", str(ledger))
    assert verified.returncode == 0 and "ledger OK" in verified.stdout, verified.stdout + verified.stderr
