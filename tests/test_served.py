"""The config's served block through the real workflow: whole greedy requests to llama-servers as deployed (started
by the job with the server's own defaults and an operator's flags) and as attached (someone else's, started here by
the test as another user would: 4 slots, the default unified and host prompt caches), on the tiny GGUF.

What must hold: the A/A control on every server; a replay from the stage boundary is the whole prefix prefilled anew,
compared with the answer alone after the boundary; a prompt-cache hit reuses the prompt; copies of a request sent at
once are counted by their distinct answers; without a unified cache,
other clients change no answer (each slot's cells from cell 0 of its own stream: docs/findings.md's mechanism);
an attached server is never started, restarted or stopped by the run, its record says what it is, and each of its
faults (nothing at the URL, a missing API key, a server killed mid-job, one restarted with another model) fails
its job in one line with no table written. Skipped without the built server unless STAGEREPLAY_REQUIRE_LLAMASERVER=1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_llamaserver_attach import SOMEONE_ELSES_FLAGS, SomeoneElsesServer
from test_llamaserver_engine import built  # noqa: F401 - fixture
from test_llamaserver_workflow_faults import _servers_under, run_watching_servers
from workflow_helpers import REPO, snakemake, snakemake_command, stagereplay, write_config

from stagereplay.engines.llamaserver.process import free_port
from stagereplay.engines.llamaserver.served import _flag_value
from stagereplay.inputs.checkpoints import build_random_qwen2
from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

SERVED = {"tokens": 16, "clients": 2, "seed": 0, "load_runs": 2, "each_slot": True, "kv_offsets": [37, 64]}
BOUNDARY = 12  # config/test.yaml's stage.max_new_tokens: where a replay starts
WAIT_SECONDS = 300
DEPLOYED = {
    "default": {},
    "no-kv-unified": {"flags": ["--no-kv-unified"]},
    "np-4-no-kv-unified": {"flags": ["-np", "4", "--no-kv-unified"]},
}


def their_flags(tmp_path: Path) -> list[str]:
    """Someone else's server with slot actions on (served.kv_offsets erases the run's slots): a slot folder of its own."""
    slot_dir = tmp_path / "their-slots"
    slot_dir.mkdir(exist_ok=True)
    return [*SOMEONE_ELSES_FLAGS, "--slot-save-path", str(slot_dir)]


def served_config(tmp_path: Path, servers: dict, served: dict | None = None, **overrides) -> tuple[Path, Path]:
    """The binding on a random 2-layer GGUF, 4 items in one shard, E1 and E2 only, and the served block (``served``:
    its options other than SERVED's)."""
    ledger = tmp_path / "ledger"
    config = write_config(
        tmp_path / "config.yaml",
        ledger_dir=str(ledger),
        checkpoints={"tiny": {"engine": "llamacpp", "random_qwen2": {"seed": 2, "layers": 2, "hidden": 64}}},
        matched={"precision": "fp16", "replicas": 1},
        fixed_prefix={"precisions": ["fp16"]},
        transplant={"enabled": False},
        served={**SERVED, **(served or {}), "servers": servers},
        **overrides,
    )
    return ledger, config


def _llama_servers(folder: Path) -> set[int]:
    return set(_servers_under(folder))


@pytest.fixture(scope="module")
def deployed_run(built, tmp_path_factory):  # noqa: F811
    tmp_path = tmp_path_factory.mktemp("served")
    ledger, config = served_config(tmp_path, DEPLOYED)
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp_path, ledger, config


def _summary(ledger: Path) -> dict:
    return json.loads((ledger / "summary.json").read_text())["served"]


@pytest.mark.slow
def test_deployed_servers_hold_the_control_reuse_the_prompt_and_record_how_they_started(deployed_run):
    _, ledger, _ = deployed_run
    served = _summary(ledger)
    # The first server is the reference (the helper writes the config with its keys sorted: default first).
    assert sorted(served["servers"]) == sorted(DEPLOYED) and served["reference"] == "default"
    for name, entry in served["servers"].items():
        assert entry["items"] == 4 and entry["control_identical"] == 4, name
        assert entry["hit_reused_median"] > 0, name  # the cached prompt was taken, not recomputed
    default = served["servers"]["default"]["record"]
    assert default["started"] == "llama-server -m MODEL --no-repack"  # nothing but the one flag the card names
    assert default["total_slots"] == 4 and default["startup_log"]["kv_unified"] == "true"
    assert default["flash_attn"].startswith("auto")  # -fa auto: the default log and /props do not say to what
    # An operator's -fa is recorded as given (the served table of config/deployed_llamaserver.yaml's fa-off server).
    assert _flag_value(("-np", "2", "-fa", "off"), "-fa", "--flash-attn") == "off"
    # With its slots left to auto, the server takes 4 slots and a unified cache whatever --no-kv-unified says
    # (server.cpp: "n_parallel is set to auto, using n_parallel = 4 and kv_unified = true"); its own log says so.
    assert served["servers"]["no-kv-unified"]["record"]["startup_log"]["kv_unified"] == "true"
    assert served["servers"]["np-4-no-kv-unified"]["record"]["startup_log"]["kv_unified"] == "false"
    rows = pq.read_table(ledger / "tables" / "served.parquet").to_pylist()
    assert all(0 < len(row["tokens"]) <= SERVED["tokens"] for row in rows)
    assert all(len(row["margins"]) == len(row["tokens"]) for row in rows)
    loads = [row for row in rows if row["cell"] == "load"]
    assert len(loads) == len(DEPLOYED) * 4 * SERVED["load_runs"] and all(
        len(row["others"]) == SERVED["clients"] for row in loads
    )
    # Each run amid others keeps what every other client got back, by arrival: the server's throughput over the load.
    for row in loads:
        assert len(row["others_generated"]) == len(row["others_seconds"]) == len(row["arrivals"]) == SERVED["clients"]
        assert all(0 < count <= SERVED["tokens"] for count in row["others_generated"])
        assert all(seconds > 0 for seconds in row["others_seconds"])
    for name, entry in served["servers"].items():
        mine = [row for row in loads if row["server"] == name]
        tokens = sum(len(row["tokens"]) + sum(row["others_generated"]) for row in mine)
        # The span of a run: from the earliest arrival (the item's at 0, or an earlier client's) to the last answer.
        span = sum(
            max(row["seconds"], *(at + took for at, took in zip(row["arrivals"], row["others_seconds"])))
            - min(0.0, *row["arrivals"])
            for row in mine
        )
        assert entry["tokens_per_second_all_clients"] == pytest.approx(tokens / span), name
    copies = [row for row in rows if row["cell"] == "copies"]
    assert len(copies) == len(DEPLOYED) * 4 * (1 + SERVED["clients"])
    # Each request of several clients at once says, from the deployed server's own batch log, whether its trigger
    # happened, and which slot served it.
    for cell in ("together", "together_copies"):
        mine = [row for row in rows if row["cell"] == cell]
        assert len(mine) == len(DEPLOYED) * 4 * SERVED["load_runs"], cell
    at_once = [row for row in rows if row["cell"] in ("together", "together_copies", "copies", "load")]
    assert all(row["trigger"].startswith(("met: ", "not met: ")) for row in at_once), {r["trigger"] for r in at_once}
    assert all(row["slot"] is not None for row in rows)
    assert all(row["trigger"] == "" for row in rows if row["cell"] in ("alone", "control", "hit"))
    for name, entry in served["servers"].items():
        assert entry["record"]["batch_log"].startswith(
            "on: --verbose, LLAMA_BATCH_DEBUG=1 and LLAMA_KV_CACHE_DEBUG=1"
        ), name
        battery = entry["battery"]["pinned"]
        assert set(battery) >= {"together", "together_copies", "amid", "copies", "hit", "slot", "offset"}, name
        mine = [row for row in rows if row["server"] == name and row["cell"] == "together"]
        assert battery["together"]["met"] == sum(row["trigger"].startswith("met: ") for row in mine), name
    # The card opens with the verdict per server, right after its introduction.
    card = (ledger / "results.md").read_text()
    assert card.index("## Which server keeps a greedy answer independent of other traffic") < card.index(
        "## The answer, per experiment"
    )
    for name, entry in served["servers"].items():
        assert entry["copies_items"] == 4 and entry["copies_per_item"] == 1 + SERVED["clients"], name
        distinct = {
            item: len({tuple(row["tokens"]) for row in copies if (row["server"], row["item_id"]) == (name, item)})
            for item in {row["item_id"] for row in copies}
        }
        assert entry["copies_differ_items"] == sorted(item for item, count in distinct.items() if count > 1), name
        assert entry["copies_most_distinct"] == max(distinct.values()), name
    # Alone on each slot in turn: every slot of the server, each item; counted against the item's answer alone.
    slots = [row for row in rows if row["cell"] == "slot"]
    for name, entry in served["servers"].items():
        mine = [row for row in slots if row["server"] == name]
        total = entry["record"]["total_slots"]
        assert sorted({row["run"] for row in mine}) == list(range(total)) and len(mine) == 4 * total, name
        assert entry["slot_items"] == 4 and entry["slots_per_item"] == total, name
        alone = {row["item_id"]: row["tokens"] for row in rows if (row["server"], row["cell"]) == (name, "alone")}
        differ = sorted({row["item_id"] for row in mine if row["tokens"] != alone[row["item_id"]]})
        assert entry["slot_differs_items"] == differ, name
    # Alone behind another slot's C idle cells (E6's kv_offset, served): every C, each item, recounted from the rows.
    behind = [row for row in rows if row["cell"] == "offset"]
    for name, entry in served["servers"].items():
        alone = {row["item_id"]: row["tokens"] for row in rows if (row["server"], row["cell"]) == (name, "alone")}
        assert entry["offset_items"] == {str(offset): 4 for offset in SERVED["kv_offsets"]}, name
        for offset in SERVED["kv_offsets"]:
            mine = [row for row in behind if (row["server"], row["run"]) == (name, offset)]
            assert [row["others"] for row in mine] == [[f"{offset} cells on slot 1"]] * 4, name
            differ = sorted(row["item_id"] for row in mine if row["tokens"] != alone[row["item_id"]])
            assert entry["offset_differs_items"][str(offset)] == differ, (name, offset)
    card = (ledger / "results.md").read_text()
    assert "## Served requests: what changes a greedy answer on the server as started" in card
    assert "| default | llama-server -m MODEL --no-repack | 4 | 4/4 |" in card
    verified = stagereplay("verify", str(ledger))
    assert verified.returncode == 0 and "ledger OK" in verified.stdout, verified.stdout + verified.stderr


@pytest.mark.slow
def test_a_served_job_says_how_far_it_is_phase_by_phase(deployed_run):
    # One line per item and phase, in the order served: a long job's log shows where it is, pinned cells first.
    _, ledger, _ = deployed_run
    lines = [
        line
        for line in (ledger / "logs" / "served" / "default.log").read_text().splitlines()
        if line.startswith("served default: ")
    ]
    phases = ["pinned cells", "each slot", "behind a filler", "amid other clients and at once"]
    expected = [f"served default: {phase} {done}/4 items" for phase in phases for done in range(1, 5)]
    assert lines == expected


@pytest.mark.slow
def test_a_replay_prefills_the_prefix_the_decoder_reached_and_is_compared_after_the_boundary(deployed_run):
    """E1 on the server: the prompt and the first BOUNDARY tokens of the answer alone, sent anew without prompt reuse
    (the server computes every position of it), continued, and compared with the answer alone after the boundary."""
    _, ledger, _ = deployed_run
    served = _summary(ledger)
    rows = pq.read_table(ledger / "tables" / "served.parquet").to_pylist()
    by_cell = {(row["server"], row["item_id"], row["cell"]): row for row in rows if row["run"] == 0}
    for name, entry in served["servers"].items():
        alone = {item: row for (server, item, cell), row in by_cell.items() if server == name and cell == "alone"}
        passed = sorted(item for item, row in alone.items() if len(row["tokens"]) > BOUNDARY)
        assert passed and entry["replay_items"] == len(passed) and entry["replay_boundary"] == [BOUNDARY], name
        assert entry["replay_control_identical"] == len(passed), name
        for item in passed:
            replay = by_cell[(name, item, "replay")]
            assert replay["reused"] == 0 and replay["decoded"] == alone[item]["decoded"] + BOUNDARY, (name, item)
            assert len(replay["tokens"]) <= SERVED["tokens"] - BOUNDARY
        differs = [
            item for item in passed if by_cell[(name, item, "replay")]["tokens"] != alone[item]["tokens"][BOUNDARY:]
        ]
        assert entry["replay_differs_items"] == differs, name
    card = (ledger / "results.md").read_text()
    default = served["servers"]["default"]
    n = default["replay_items"]
    assert f"| {len(default['replay_differs_items'])}/{n} ({n}/{n}; boundary {BOUNDARY} tokens) |" in card


@pytest.mark.slow
def test_without_a_unified_cache_other_clients_change_no_answer(deployed_run):
    _, ledger, _ = deployed_run
    entry = _summary(ledger)["servers"]["np-4-no-kv-unified"]
    assert entry["load_every_run"] == [] and entry["load_some_runs"] == []
    # Copies of one prompt at once, each on a slot of its own stream: each copy's cells from cell 0, as alone.
    assert entry["copies_differ_items"] == [] and entry["copies_differ_from_alone_items"] == []


@pytest.mark.slow
def test_an_attached_server_is_used_never_started_and_recorded(deployed_run, tmp_path):
    workdir, ledger, config = deployed_run
    gguf = next((ledger / "models").rglob("*.gguf"))
    started_before = _llama_servers(workdir)
    with SomeoneElsesServer(gguf, their_flags(tmp_path), tmp_path / "theirs.log") as theirs:
        servers = {**DEPLOYED, "theirs": {"url": theirs.address, "slots": [0, 1, 2, 3]}}
        _, config = served_config(workdir, servers)
        result, seen = run_watching_servers(workdir, config, workdir)
        assert result.returncode == 0, result.stderr[-4000:]
        assert seen - started_before == {theirs.pid}  # the run started no server of its own
        assert theirs.process.poll() is None  # ... and stopped nothing
        still = stagereplay("verify", str(ledger), "--servers")
        assert still.returncode == 0, still.stdout + still.stderr
        assert (
            f"theirs: the llama-server at {theirs.address} still reports the build and model recorded" in still.stdout
        )
    gone = stagereplay("verify", str(ledger), "--servers")
    faults = [line for line in gone.stderr.splitlines() if line.startswith("stagereplay: fault:")]
    assert gone.returncode == 1 and len(faults) == 1, gone.stdout + gone.stderr
    assert f"theirs: no llama-server answers at {theirs.address}" in faults[0]
    assert "rule served:" in result.stderr and result.stderr.count("wildcards: server=") == 1  # only the new one ran
    entry = _summary(ledger)["servers"]["theirs"]
    assert entry["control_identical"] == 4 and entry["hit_reused_median"] > 0
    record = entry["record"]
    assert record["attached"] == theirs.address and record["slots"] == [0, 1, 2, 3] and record["total_slots"] == 4
    assert record["slots_pinned"] is False  # every slot listed: the server picks, as the deployed one does
    assert record["model_path"] == str(gguf) and record["model_file_xxh3"]
    # 4 slots, as the deployed default has (its auto slot count puts them in one unified cache; an explicit -np 4
    # gives each a KV stream of its own, as an attached checkpoint's slot file shows): each request alone, the same
    # answers item by item, and every pinned cell the same, tokens and margins (bench/served_pair.py).
    assert entry["vs_reference_differs_items"] == []
    paired = subprocess.run(
        [sys.executable, str(REPO / "bench" / "served_pair.py"), str(ledger), "default", "theirs"],
        capture_output=True,
        text=True,
    )
    assert paired.returncode == 0, paired.stdout + paired.stderr
    for cell in ("alone", "control", "replay", "replay_control", "hit"):
        assert f"| {cell} | 4/4 | 4/4 | — |" in paired.stdout
    assert "| copies at once: distinct answers, per item |" in paired.stdout
    verified = stagereplay("verify", str(ledger))
    assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.slow
def test_the_audit_reproduces_the_pinned_requests_and_refuses_another_server(deployed_run, tmp_path):
    """After the attached run: the audit (E4) recomputes every server's requests. At the recorded URL, a server of
    another model is refused in one line; the one the ledger records reproduces every pinned request."""
    workdir, ledger, config = deployed_run
    gguf = next((ledger / "models").rglob("*.gguf"))
    url = _summary(ledger)["servers"]["theirs"]["record"]["attached"]
    port = int(url.rsplit(":", 1)[1])
    other = write_qwen2_gguf(build_random_qwen2(tmp_path / "other", seed=5, layers=2, hidden=64), tmp_path / "o.gguf")
    with SomeoneElsesServer(other, their_flags(tmp_path), tmp_path / "other.log", port=port):
        refused = snakemake(workdir, config, "--config", "mode=audit")
    assert refused.returncode != 0
    log = (ledger / "logs" / "audit" / "served" / "theirs.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("stagereplay: error:")]
    assert len(errors) == 1 and f"the llama-server at {url} is not the one the ledger records" in errors[0], log
    assert f"model_path {str(other)!r} (recorded {str(gguf)!r})" in errors[0]
    assert not (ledger / "audit" / "runs" / "served" / "theirs.parquet").exists()
    with SomeoneElsesServer(gguf, their_flags(tmp_path), tmp_path / "theirs.log", port=port):
        audited = snakemake(workdir, config, "--config", "mode=audit")
    assert audited.returncode == 0, audited.stderr[-4000:]
    e4 = json.loads((ledger / "audit" / "e4.json").read_text())
    artifacts = e4["artifacts"]
    # alone, control, replay twice, hit, alone on each slot and behind each filler, of 4 items on every server
    offsets = len(SERVED["kv_offsets"])
    pinned = sum((5 + entry["slots_per_item"] + offsets) * 4 for entry in _summary(ledger)["servers"].values())
    assert artifacts["served_tokens"]["count"] == artifacts["served_tokens"]["n"] == pinned
    assert artifacts["served_margins"]["count"] == pinned
    assert artifacts["served_server"]["count"] == len(DEPLOYED) + 1
    # The card redrawn after the audit shows it: e4.json was audited against these very tables, the served one too.
    e4_row = next(line for line in (ledger / "results.md").read_text().splitlines() if line.startswith("| E4 audit |"))
    assert f"| {e4['status']}" in e4_row and "not run yet" not in e4_row, e4_row
    # runs amid load, copies at once, and the runs prefilled together with others' prompts and with copies, per item
    unpinned = SERVED["load_runs"] + 1 + SERVED["clients"] + 2 * SERVED["load_runs"]
    assert e4["under_load"]["artifacts"]["served_tokens"]["n"] == 4 * unpinned * (len(DEPLOYED) + 1)


def _failed_attached(ledger: Path, entry: dict, expected: str, during=None) -> str:
    """A run whose only new job is the attached server's: it fails in one line, with nothing of it written.
    ``during``: called on this thread once the job has served its first item's pinned cells (the job's log says so)."""
    workdir = ledger.parent
    _, config = served_config(workdir, {**DEPLOYED, "theirs": entry})
    log_path = ledger / "logs" / "served" / "theirs.log"
    log_path.unlink(missing_ok=True)
    run = subprocess.Popen(
        snakemake_command(workdir, config), cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    if during is not None:
        deadline = time.monotonic() + WAIT_SECONDS
        while not (log_path.is_file() and "served theirs: pinned cells 1/" in log_path.read_text()):
            assert run.poll() is None and time.monotonic() < deadline, "the attached server's job never served an item"
            time.sleep(0.05)
        during()
    _, stderr = run.communicate(timeout=WAIT_SECONDS)
    assert run.returncode != 0
    errors = [line for line in log_path.read_text().splitlines() if line.startswith("stagereplay: error:")]
    assert len(errors) == 1 and expected in errors[0], log_path.read_text()[-2000:] + stderr.decode()[-2000:]
    assert not (ledger / "runs" / "served" / "theirs.parquet").exists()
    assert not [path for path in ledger.rglob("*") if ".partial" in path.name or path.name.startswith(".tmp")]
    return errors[0]


@pytest.mark.slow
def test_nothing_at_the_url_is_one_line(deployed_run, tmp_path):
    _, ledger, _ = deployed_run
    url = f"http://127.0.0.1:{free_port()}"
    _failed_attached(ledger, {"url": url, "slots": [0, 1]}, f"no llama-server answers at {url}")


@pytest.mark.slow
def test_a_missing_api_key_is_one_line(deployed_run, tmp_path, monkeypatch):
    _, ledger, _ = deployed_run
    gguf = next((ledger / "models").rglob("*.gguf"))
    monkeypatch.delenv("THEIR_KEY", raising=False)
    flags = [*their_flags(tmp_path), "--api-key", "their-secret"]
    with SomeoneElsesServer(gguf, flags, tmp_path / "theirs.log") as theirs:
        entry = {"url": theirs.address, "slots": [0, 1], "api_key_env": "THEIR_KEY"}
        _failed_attached(ledger, entry, "served.servers.theirs.api_key_env names the environment variable THEIR_KEY")


@pytest.mark.slow
def test_kv_offsets_on_a_server_without_slot_actions_is_one_line(deployed_run, tmp_path):
    _, ledger, _ = deployed_run
    gguf = next((ledger / "models").rglob("*.gguf"))
    with SomeoneElsesServer(gguf, SOMEONE_ELSES_FLAGS, tmp_path / "theirs.log") as theirs:  # no --slot-save-path
        entry = {"url": theirs.address, "slots": [0, 1]}
        _failed_attached(ledger, entry, "served.kv_offsets erases the run's slots of the llama-server at")


@pytest.mark.slow
def test_a_server_killed_mid_job_is_one_line(deployed_run, tmp_path):
    _, ledger, _ = deployed_run
    gguf = next((ledger / "models").rglob("*.gguf"))
    with SomeoneElsesServer(gguf, their_flags(tmp_path), tmp_path / "theirs.log") as theirs:
        entry = {"url": theirs.address, "slots": [0, 1]}
        _failed_attached(
            ledger, entry, "no llama-server answers at", during=lambda: os.kill(theirs.pid, signal.SIGKILL)
        )


@pytest.mark.slow
def test_a_server_restarted_with_another_model_is_one_line(deployed_run, tmp_path):
    _, ledger, _ = deployed_run
    gguf = next((ledger / "models").rglob("*.gguf"))
    other = write_qwen2_gguf(build_random_qwen2(tmp_path / "other", seed=5, layers=2, hidden=64), tmp_path / "o.gguf")
    port = free_port()
    theirs = SomeoneElsesServer(gguf, their_flags(tmp_path), tmp_path / "a.log", port=port)
    replaced = SomeoneElsesServer(other, their_flags(tmp_path), tmp_path / "b.log", port=port)

    def restart() -> None:  # the server replaced under the run, at the same address
        theirs.stop()
        replaced.start()

    theirs.start()
    try:
        url = f"http://127.0.0.1:{port}"
        error = _failed_attached(ledger, {"url": url, "slots": [0, 1]}, "is not the one this run recorded", restart)
    finally:
        theirs.stop()
        replaced.stop()
    assert f"model_path {str(other)!r} (was {str(gguf)!r})" in error


def _unreadable_copy(gguf: Path, folder: Path) -> Path:
    """A copy of ``gguf`` for a server to load; the test deletes it once the server has it mapped, so its bytes are
    not readable here, as a server's on another machine."""
    folder.mkdir(exist_ok=True)
    copy = folder / "their-model.gguf"
    copy.write_bytes(gguf.read_bytes())
    return copy


@pytest.mark.slow
def test_a_model_file_not_readable_here_is_checked_by_what_the_server_says(deployed_run, tmp_path):
    """The server's model file gone from this machine: its weights cannot be hashed. The run checks its parameters,
    tensor bytes, vocabulary size and spelling of the prompts' tokens instead, and the record and card say the weights
    were not hashed; the same model gives the deployed default's answers alone."""
    _, ledger, _ = deployed_run
    gguf = next((ledger / "models").rglob("*.gguf"))
    copy = _unreadable_copy(gguf, tmp_path / "theirs")
    with SomeoneElsesServer(copy, their_flags(tmp_path), tmp_path / "theirs.log") as theirs:
        copy.unlink()
        _, config = served_config(ledger.parent, {**DEPLOYED, "theirs": {"url": theirs.address, "slots": [0, 1, 2, 3]}})
        result = snakemake(ledger.parent, config)
    assert result.returncode == 0, result.stderr[-4000:]
    entry = _summary(ledger)["servers"]["theirs"]
    record = entry["record"]
    assert record["model_path"] == str(copy) and record["model_file_xxh3"] is None
    prompts = pq.read_table(ledger / "prompts" / "tiny.parquet").to_pylist()
    distinct = {token for row in prompts for token in row["prompt_tokens"]}
    assert (
        record["model_check"].startswith("weights not hashed")
        and f"the {len(distinct)} token ids" in (record["model_check"])
    )
    assert entry["vs_reference_differs_items"] == [] and entry["control_identical"] == 4
    card = (ledger / "results.md").read_text()
    assert f"| theirs | attached at {theirs.address} (weights not hashed) |" in card


@pytest.mark.slow
def test_another_model_not_readable_here_is_refused_in_one_line(deployed_run, tmp_path):
    _, ledger, _ = deployed_run
    other = write_qwen2_gguf(build_random_qwen2(tmp_path / "other", seed=5, layers=2, hidden=32), tmp_path / "o.gguf")
    with SomeoneElsesServer(other, their_flags(tmp_path), tmp_path / "theirs.log") as theirs:
        other.unlink()
        entry = {"url": theirs.address, "slots": [0, 1]}
        error = _failed_attached(ledger, entry, f"the llama-server at {theirs.address} serves a model of n_params")
    assert "the checkpoint's GGUF has" in error and "serve it in a ledger of its own model" in error


@pytest.mark.slow
def test_a_server_spelling_a_prompt_token_otherwise_is_refused_in_one_line(deployed_run, tmp_path):
    """The tokenizer check itself, on a real server: the checkpoint's spelling of one prompt token changed here."""
    from stagereplay.engines.llamaserver.attached import AttachedServer
    from stagereplay.engines.llamaserver.build import LlamaServerError
    from stagereplay.engines.llamaserver.model_check import check_model

    _, ledger, _ = deployed_run
    gguf = next((ledger / "models").rglob("*.gguf"))
    spellings = {row["token_id"]: row["text"] for row in pq.read_table(ledger / "vocab" / "tiny.parquet").to_pylist()}
    prompt = pq.read_table(ledger / "prompts" / "tiny.parquet").to_pylist()[0]["prompt_tokens"]
    token = next(token for token in prompt if not spellings[token].startswith("‹"))
    copy = _unreadable_copy(gguf, tmp_path / "theirs")
    with SomeoneElsesServer(copy, their_flags(tmp_path), tmp_path / "theirs.log") as theirs:
        copy.unlink()
        server = AttachedServer(theirs.address)
        identity = server.identity()
        assert check_model(server, identity, gguf, spellings, prompt)["model_file_xxh3"] is None
        with pytest.raises(LlamaServerError) as error:
            check_model(server, identity, gguf, {**spellings, token: spellings[token] + "x"}, prompt)
    message = str(error.value)
    assert f"spells token {token} {spellings[token]!r}, the checkpoint's GGUF {spellings[token] + 'x'!r}" in message
    assert "\n" not in message


# The served block refused before any job, each in one line with its fix (no request sent, no server needed).

REFUSED = [
    (
        {"theirs": {"url": "http://127.0.0.1:1", "flags": ["-np", "2"]}},
        "give url (attached) or flags (deployed), not both",
    ),
    ({"theirs": {"url": "http://127.0.0.1:1", "slots": [0]}}, "2 other clients need a slot besides the item's"),
    ({"theirs": {"url": "127.0.0.1:8080", "slots": [0, 1]}}, "give it as http://HOST:PORT"),
    ({"mine": {"flags": ["--port", "9"]}}, "--port is set by stagereplay itself"),
    ({"mine": {"slots": [0, 1]}}, "slots and api_key_env belong to an attached server"),
    ({"my server": {}}, "'my server' is no server name"),
]


def test_requests_that_end_within_the_first_stage_are_refused_in_one_line(tmp_path):
    from stagereplay.design.run_plan import RunRefused, plan_run
    from stagereplay.design.schema import load_config

    _, config = served_config(tmp_path, {"default": {}})
    config.write_text(config.read_text().replace(f"tokens: {SERVED['tokens']}", f"tokens: {BOUNDARY}"))
    with pytest.raises(RunRefused) as error:
        plan_run(load_config(config), REPO)
    assert f"served.tokens: {BOUNDARY} tokens per request end within the first stage" in str(error.value)
    assert f"set served.tokens above {BOUNDARY}" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("servers", "expected"), REFUSED)
def test_a_served_block_that_cannot_run_is_refused_in_one_line(tmp_path, servers, expected):
    from stagereplay.design.run_plan import RunRefused, plan_run
    from stagereplay.design.schema import load_config

    _, config = served_config(tmp_path, servers)
    with pytest.raises(RunRefused) as error:
        plan_run(load_config(config), REPO)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_sampling_without_a_seed_is_refused_in_one_line(tmp_path):
    from stagereplay.design.run_plan import RunRefused, plan_run
    from stagereplay.design.schema import load_config

    _, config = served_config(tmp_path, {"default": {}}, {"sampling": {"temperature": 1.0}})
    with pytest.raises(RunRefused) as error:
        plan_run(load_config(config), REPO)
    assert "served.sampling: temperature 1.0 without a seed" in str(error.value)
    assert "give served.sampling.seed" in str(error.value) and "\n" not in str(error.value)
    # With its seed the same block runs, and its job is told how to sample (a greedy job's command is unchanged).
    _, seeded = served_config(tmp_path, {"default": {}}, {"sampling": {"temperature": 1.0, "seed": 42}})
    plan_run(load_config(seeded), REPO)


def test_served_needs_a_gguf_primary_checkpoint(tmp_path):
    from stagereplay.design.run_plan import RunRefused, plan_run
    from stagereplay.design.schema import load_config

    config = write_config(
        tmp_path / "config.yaml", ledger_dir=str(tmp_path / "ledger"), served={"servers": {"default": {}}}
    )
    with pytest.raises(RunRefused) as error:
        plan_run(load_config(config), REPO)
    assert "served: the servers run the primary checkpoint's GGUF" in str(error.value)


@pytest.mark.slow
def test_two_attached_servers_as_reference_and_level(deployed_run, tmp_path):
    """A per-process option cannot be changed on a server the run did not start: its level is a second server.
    Two attached servers, the defaults and -np 4 --no-kv-unified, the first the reference (runs last in this module:
    it replaces the ledger's served servers)."""
    workdir, ledger, _ = deployed_run
    gguf = next((ledger / "models").rglob("*.gguf"))
    unified = SomeoneElsesServer(gguf, their_flags(tmp_path), tmp_path / "a.log")
    streams = SomeoneElsesServer(gguf, [*their_flags(tmp_path), "--no-kv-unified"], tmp_path / "b.log")
    with unified, streams:
        servers = {"a-unified": {"url": unified.address, "slots": [0, 1, 2, 3]}}
        servers["b-streams"] = {"url": streams.address, "slots": [0, 1, 2, 3]}
        _, config = served_config(workdir, servers)
        result = snakemake(workdir, config)
    assert result.returncode == 0, result.stderr[-4000:]
    served = _summary(ledger)
    assert list(served["servers"]) == ["a-unified", "b-streams"] and served["reference"] == "a-unified"
    level = served["servers"]["b-streams"]
    assert level["vs_reference_items"] == 4 and level["record"]["attached"] == streams.address
    assert level["control_identical"] == 4 and level["load_every_run"] == level["load_some_runs"] == []
    card = (ledger / "results.md").read_text()
    assert f"| b-streams | attached at {streams.address} | 4 (used: 0, 1, 2, 3) | 4/4 |" in card


@pytest.mark.parametrize(
    "missing, recorded",
    [
        (
            ("others_generated", "others_seconds", "client", "slot", "trigger", "sampling"),
            "what the other clients amid load got back and the client, the slot and whether a pattern's trigger"
            " happened and how each token was picked (greedy or seeded sampling)",
        ),
        (
            ("client", "slot", "trigger", "sampling"),
            "the client, the slot and whether a pattern's trigger happened and how each token was picked (greedy or"
            " seeded sampling)",
        ),
        (("sampling",), "how each token was picked (greedy or seeded sampling)"),
    ],
)
def test_a_served_table_without_later_columns_names_its_migration(tmp_path, missing, recorded):
    """A served table written before each run amid others kept what the other clients got back, or before each
    request kept its slot and its pattern's trigger, or how its tokens were picked: one line naming the forced rerun that rewrites it (the workflow
    sees no changed input), from verify and from any reader."""
    from stagereplay.audit.faults import Report
    from stagereplay.audit.verify import verify_tables
    from stagereplay.ledger.tables import SERVED_SCHEMA, LedgerError, read_table, write_table

    before = pa.schema([field for field in SERVED_SCHEMA if field.name not in missing])
    for relative in ("tables/served.parquet", "runs/served/default.parquet", "runs/served/fa-off.parquet"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(before.empty_table(), tmp_path / relative)
    write_table([], SERVED_SCHEMA, tmp_path / "runs" / "served" / "np-1.parquet")  # today's: no fault
    report = Report()
    verify_tables(tmp_path, report)
    assert [str(fault) for fault in report.faults] == [
        f"tables/served.parquet and 2 more served tables: written before the served requests recorded {recorded}"
        f" (no {', '.join(missing)}): only the served jobs compute them —"
        " migrate it: rerun snakemake --forcerun served (the served jobs send every request again; gathering,"
        " summary.json and the card follow)"
    ]
    with pytest.raises(LedgerError, match=f"no {', '.join(missing)}.* rerun snakemake --forcerun served"):
        read_table(tmp_path / "tables" / "served.parquet", SERVED_SCHEMA)


@pytest.mark.slow
def test_copies_that_agree_with_each_other_but_not_with_the_answer_alone_differ(deployed_run):
    """One item's copies rewritten to one answer other than its answer alone: no item has more than one answer among
    its copies, yet the item's copies differ from alone, and the card's copies column counts it so."""
    from stagereplay.ledger.tables import SERVED_SCHEMA
    from stagereplay.report.served_summary import served_summary
    from stagereplay.report.served_view import COLUMNS, served_blocks

    _, ledger, _ = deployed_run
    server = "np-4-no-kv-unified"
    # The server's own table: other tests rerun the workflow in this directory with other servers.
    rows = pq.read_table(ledger / "runs" / "served" / f"{server}.parquet").to_pylist()
    item = sorted({row["item_id"] for row in rows})[0]
    alone = next(row for row in rows if (row["server"], row["item_id"], row["cell"]) == (server, item, "alone"))
    other = [*alone["tokens"][:-1], alone["tokens"][-1] + 1]
    # Every other item's copies made to agree with its answer alone, so only the rewritten item differs.
    alone_of = {row["item_id"]: row["tokens"] for row in rows if (row["server"], row["cell"]) == (server, "alone")}
    for row in rows:
        if row["server"] == server and row["cell"] == "copies":
            row["tokens"] = other if row["item_id"] == item else list(alone_of[row["item_id"]])
    summary = served_summary(pa.Table.from_pylist(rows, schema=SERVED_SCHEMA))
    entry = summary["servers"][server]
    assert entry["copies_differ_items"] == [] and entry["copies_most_distinct"] == 1
    assert entry["copies_differ_from_alone_items"] == [item]
    (table,) = [block for block in served_blocks({"served": summary}) if block[0] == "table"]
    (row,) = [row for row in table[2] if row[0] == server]
    copies = row[COLUMNS.index(next(column for column in COLUMNS if column.startswith("the same request at once")))]
    n = entry["copies_items"]
    assert copies == f"1/{n} (0/{n}; 1 of {1 + SERVED['clients']} copies)"


@pytest.mark.slow
def test_the_verdict_names_its_first_counterexample(deployed_run):
    """A server's rows rewritten so that nothing differs from alone but one proven `together` run of one item: the
    verdict is that run, named by item, pattern, client, run and first divergent step, with both margins there; with
    that run's trigger not met, the server is independent of other traffic, the run counted apart."""
    from stagereplay.ledger.tables import SERVED_SCHEMA
    from stagereplay.report.served_summary import served_summary
    from stagereplay.report.traffic_verdict import verdict_line

    _, ledger, _ = deployed_run
    server = "np-4-no-kv-unified"
    # The server's own table: other tests rerun the workflow in this directory with other servers.
    rows = pq.read_table(ledger / "runs" / "served" / f"{server}.parquet").to_pylist()
    rows = [row for row in rows if row["server"] == server]
    alone = {row["item_id"]: row for row in rows if row["cell"] == "alone"}
    item = sorted(alone)[1]
    for row in rows:
        row["tokens"], row["margins"] = list(alone[row["item_id"]]["tokens"]), list(alone[row["item_id"]]["margins"])
        if row["cell"] in ("together", "together_copies", "copies", "load"):
            row["trigger"] = "met: the prompt in 1 decode call: rewritten by the test"
    flipped = next(row for row in rows if (row["item_id"], row["cell"], row["run"]) == (item, "together", 1))
    step = 3
    flipped["tokens"][step] += 1
    flipped["margins"][step] = 0.25

    def verdict_of(table_rows):
        return served_summary(pa.Table.from_pylist(table_rows, schema=SERVED_SCHEMA))["servers"][server]

    entry = verdict_of(rows)
    margin = alone[item]["margins"][step]
    assert verdict_line(entry) == (
        f"changes answers: item {item}, together (pinned client), run 1, first divergent step {step}"
        f" (margin alone {margin:.3g}, 0.25 there)"
    )
    flipped["trigger"] = "not met: the prompt in 1 decode call: rewritten by the test"
    entry = verdict_of(rows)
    assert entry["battery"]["pinned"]["together"]["differs_trigger_not_met_items"] == [item]
    assert verdict_line(entry).startswith(
        f"independent of other traffic: {len(alone)} items × 7 patterns (together, together_copies, amid, copies, hit,"
        " slot, offset) × 1 client (pinned)"
    )


@pytest.mark.slow
def test_the_default_client_is_served_through_the_workflow(built, tmp_path):  # noqa: F811
    """Both clients on one deployed server: the default client's rows beside the pinned client's, its prompts checked
    against the ledger's in the server's record, and the verdict over both clients."""
    cut = {"send_as": ["pinned", "default"], "each_slot": False, "kv_offsets": [], "load_runs": 1, "clients": 1}
    ledger, config = served_config(tmp_path, {"default": {}}, served=cut, items={"limit": 2})
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = pq.read_table(ledger / "tables" / "served.parquet").to_pylist()
    default = [row for row in rows if row["client"] == "default"]
    cells = {"alone", "control", "hit", "load", "copies", "together", "together_copies"}
    assert {row["cell"] for row in default} == cells
    assert {row["cell"] for row in rows if row["client"] == "pinned"} >= cells | {"replay"}
    entry = _summary(ledger)["servers"]["default"]
    assert entry["record"]["default_client_prompts"] == (
        "the server tokenizes every item's chat messages (2) to the ledger's prompt tokens"
    )
    assert set(entry["battery"]) == {"pinned", "default"}
    found = entry["verdict"]
    if "counterexample" in found:  # the first counterexample names the client that met it
        assert found["counterexample"]["client"] in ("pinned", "default")
    else:
        assert found["clients"] == ["pinned", "default"]
    assert stagereplay("verify", ledger).returncode == 0


def test_a_sampled_answers_missing_margins_reproduce_in_the_audit():
    """A sampled answer keeps NaN where the server drops a step's log-probabilities: the audit compares the saved
    and recomputed margins as the same NaN, and still tells a changed margin."""
    from stagereplay.audit.served_audit import audit_served
    from stagereplay.ledger.tables import SERVED_SCHEMA

    row = dict.fromkeys(SERVED_SCHEMA.names)
    row.update(server="np-2", item_id="arith-000", cell="alone", client="pinned", run=0, tokens=[5, 9])
    row.update(margins=[float("nan"), 0.5], server_record="{}", sampling='{"seed": 42, "temperature": 1.0}')
    saved = pa.Table.from_pylist([row], schema=SERVED_SCHEMA)
    margins = {
        check.artifact: check.reproduced
        for check in audit_served(saved, pa.Table.from_pylist([dict(row)], SERVED_SCHEMA))
    }
    assert margins["served_margins"] is True
    changed = pa.Table.from_pylist([{**row, "margins": [float("nan"), 0.25]}], schema=SERVED_SCHEMA)
    assert not next(check for check in audit_served(saved, changed) if check.artifact == "served_margins").reproduced
