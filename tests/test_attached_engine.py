"""E1–E6 with cache bytes on a llama-server someone else runs: a checkpoint with ``attach`` (``attached_engine``).

Each server is started here by the test, as its operator would, with ``--slot-save-path``:

- with the flags this project's own server starts with (``reference_settings``): an attached run must agree with a
  run on a server the workflow starts, table by table and column by column (caches, suffixes, margins, E5, E6);
- with flags the project never uses (4 slots, flash attention and the host prompt cache left to the server): the
  run uses the one slot it is given, reads the cache type and flash attention from a slot file, leaves the slot
  folder as it found it, and starts no server of its own.

Faults, each one line: a config asking an attached checkpoint for what its server cannot change (parse time), a
job whose flash attention is not the server's, a server without slot files, an audit against a server restarted
with other flags. Real Snakemake, llama-server and a tiny GGUF; skipped without the built server unless
STAGEREPLAY_REQUIRE_LLAMASERVER=1.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_llamaserver_attach import SOMEONE_ELSES_FLAGS, SomeoneElsesServer
from test_llamaserver_engine import built  # noqa: F401 - fixture
from test_llamaserver_workflow_faults import run_watching_servers
from workflow_helpers import snakemake, stagereplay, write_config

from stagereplay.engines.base import Runtime
from stagereplay.engines.llamaserver.reference import reference_settings
from stagereplay.inputs.checkpoints import build_random_qwen2
from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

# Columns that say where a row ran, not what it computed: the attached rows name the server they were sent to.
WHERE_IT_RAN = {"device_name", "cpu_capability", "engine_version", "engine_build", "model_seconds"}
TABLES = ("trajectories", "comparisons", "transplants", "factors")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    folder = build_random_qwen2(tmp_path_factory.mktemp("model") / "model", seed=2, layers=2, hidden=64)
    return write_qwen2_gguf(folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def attach_config(tmp_path: Path, gguf: Path, attach: dict | None, name: str, **overrides) -> tuple[Path, Path]:
    """E1 (two replicas), E2, E5 and E6's prefix_reuse at one precision on 4 items, attached or on a server the
    workflow starts (``attach`` None)."""
    checkpoint = {"engine": "llamaserver", "gguf": str(gguf), **({"attach": attach} if attach else {})}
    ledger = tmp_path / f"ledger-{name}"
    settings = {
        "ledger_dir": str(ledger),
        "checkpoints": {"tiny": checkpoint},
        "items": {"limit": 4},
        "shard_size": 4,
        "matched": {"precision": "fp16", "replicas": 2},
        "fixed_prefix": {"precisions": ["fp16"]},
        "transplant": {"cross_precision": None, "outcome_blind": {"sample": 2, "seed": 0}},
        "factors": {"prefix_reuse": ["prompt", "restore:prompt"]},
        **overrides,
    }
    return ledger, write_config(tmp_path / f"{name}.yaml", **settings)


def _slot_server(gguf: Path, flags: list[str], tmp_path: Path, name: str) -> tuple[SomeoneElsesServer, Path]:
    slot_dir = tmp_path / f"slots-{name}"
    slot_dir.mkdir()
    server = SomeoneElsesServer(gguf, [*flags, "--slot-save-path", str(slot_dir)], tmp_path / f"{name}.log")
    return server, slot_dir


def _one_error_line(ledger: Path, result) -> str:
    lines = [
        line
        for log in (ledger / "logs").rglob("*.log")
        for line in log.read_text().splitlines()
        if line.startswith("stagereplay: error:")
    ]
    assert lines, result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_attached_with_the_projects_flags_agrees_with_the_projects_own_server_column_for_column(
    built,  # noqa: F811
    gguf,
    tmp_path,
):
    flags = reference_settings(Runtime("fp16", "cpu", 1)).arguments()
    server, slot_dir = _slot_server(gguf, flags, tmp_path, "reference")
    with server:
        attach = {"url": server.address, "slot": 0, "slot_dir": str(slot_dir)}
        attached, config = attach_config(tmp_path, gguf, attach, "attached")
        result, seen = run_watching_servers(tmp_path, config, gguf.parent)
        assert result.returncode == 0, result.stderr[-4000:]
        assert seen == {server.pid}  # the run started no server: only the operator's ran on the GGUF
        assert server.process.poll() is None  # ... and stopped nothing
        # The slot folder as the run found it: every slot file it wrote was removed, the slot's lock file stays.
        assert [path.name for path in slot_dir.iterdir()] == ["stagereplay-slot-0.lock"]
    own, config = attach_config(tmp_path, gguf, None, "own")
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    for table in TABLES:
        ours = pq.read_table(attached / "tables" / f"{table}.parquet").to_pandas()
        theirs = pq.read_table(own / "tables" / f"{table}.parquet").to_pandas()
        assert len(ours) == len(theirs) > 0, table
        for column in sorted(set(ours.columns) - WHERE_IT_RAN):
            assert ours[column].astype(str).tolist() == theirs[column].astype(str).tolist(), (table, column)
    build = pq.read_table(attached / "tables" / "trajectories.parquet").column("engine_build")[0].as_py()
    assert build.startswith(f"attached llama-server at {server.address}, slot 0")
    card = (attached / "results.md").read_text()
    assert f"run on the llama-server attached at {server.address} (slot 0" in card
    assert "the model file's bytes are the checkpoint's GGUF" in card


@pytest.mark.slow
def test_someone_elses_server_runs_on_its_slot_and_an_audit_refuses_it_restarted(built, gguf, tmp_path):  # noqa: F811
    # Their flags: 4 slots, each its own KV stream (an explicit -np), flash attention left to the server (on, here),
    # the host prompt cache on.
    server, slot_dir = _slot_server(gguf, SOMEONE_ELSES_FLAGS, tmp_path, "theirs")
    with server:
        port = server.port
        attach = {"url": server.address, "slot": 2, "slot_dir": str(slot_dir)}
        # The run's flash attention off, the server's on: refused in one line naming the flag, nothing written.
        ledger, config = attach_config(tmp_path, gguf, attach, "fa-off", factors={})
        result = snakemake(tmp_path, config)
        assert result.returncode != 0
        line = _one_error_line(ledger, result)
        assert "runs with flash attention on (read from its slot file), this job asks for it off" in line
        assert "set runtime.flash_attn: true, or attach a server started with -fa off" in line
        assert not (ledger / "tables").exists()

        ledger, config = attach_config(tmp_path, gguf, attach, "theirs", runtime={"flash_attn": True})
        result = snakemake(tmp_path, config)
        assert result.returncode == 0, result.stderr[-4000:]
        rows = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
        build = rows[0]["engine_build"]
        assert "slot 2" in build and "4 slots" in build and "a KV stream per slot" in build and "-fa on" in build
        # The A/A control on their server: two replicas of every live build, the same caches and suffixes.
        live = {(row["item_id"], row["replica"]): row for row in rows if row["construction"] == "live"}
        for (item, replica), row in live.items():
            if replica == 1:
                twin = live[(item, 0)]
                assert (row["cache_object"], row["suffix_object"]) == (twin["cache_object"], twin["suffix_object"])
        assert [path.name for path in slot_dir.iterdir()] == ["stagereplay-slot-2.lock"]
        verified = stagereplay("verify", str(ledger), "--servers")
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert "checkpoints.tiny.attach: the llama-server at" in verified.stdout
    # The same address, restarted with other flags: verify names it, and the audit refuses it before any rerun.
    restarted = SomeoneElsesServer(
        gguf, ["-np", "2", "--no-repack", "--slot-save-path", str(slot_dir)], tmp_path / "again.log", port=port
    )
    with restarted:
        verified = stagereplay("verify", str(ledger), "--servers")
        assert verified.returncode != 0 and "total_slots 2 (recorded 4)" in verified.stdout + verified.stderr
        result = snakemake(tmp_path, config, "--config", "mode=audit")
        assert result.returncode != 0
        refusal = (ledger / "logs" / "audit" / "register_model" / "tiny.log").read_text().splitlines()[-1]
        assert refusal.startswith("stagereplay: error: the llama-server at"), result.stderr[-3000:]
        assert "is not the one the ledger records:" in refusal and "total_slots 2 (was 4)" in refusal
        assert not (ledger / "audit" / "tables").exists()


def test_a_server_without_slot_files_is_refused_at_registration(built, gguf, tmp_path):  # noqa: F811
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()  # given in the config, but the server was started without --slot-save-path
    with SomeoneElsesServer(gguf, SOMEONE_ELSES_FLAGS, tmp_path / "server.log") as server:
        attach = {"url": server.address, "slot_dir": str(slot_dir)}
        ledger, config = attach_config(tmp_path, gguf, attach, "no-files", factors={})
        result = snakemake(tmp_path, config)
    assert result.returncode != 0
    line = _one_error_line(ledger, result)
    assert "writes no slot files — start it with --slot-save-path" in line
    assert not (ledger / "models" / "tiny" / "model.json").exists()


def test_a_slot_folder_not_here_is_refused_at_registration(built, gguf, tmp_path):  # noqa: F811
    # No server is asked: the folder is checked first.
    attach = {"url": "http://127.0.0.1:1", "slot_dir": str(tmp_path / "missing")}
    ledger, config = attach_config(tmp_path, gguf, attach, "no-folder", factors={})
    result = snakemake(tmp_path, config)
    assert result.returncode != 0
    line = _one_error_line(ledger, result)
    assert f"checkpoints.tiny.attach.slot_dir: {tmp_path / 'missing'} is not a folder here — start the server" in line
    assert not (ledger / "models" / "tiny" / "model.json").exists()


def test_an_unset_api_key_variable_is_refused_at_registration(built, gguf, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv("THEIR_UNSET_KEY", raising=False)
    attach = {"url": "http://127.0.0.1:1", "slot_dir": str(tmp_path), "api_key_env": "THEIR_UNSET_KEY"}
    ledger, config = attach_config(tmp_path, gguf, attach, "no-key", factors={})
    result = snakemake(tmp_path, config)
    assert result.returncode != 0
    line = _one_error_line(ledger, result)
    assert (
        "checkpoints.tiny.attach.api_key_env names the environment variable THEIR_UNSET_KEY, which is not set" in line
    )
    assert not (ledger / "models" / "tiny" / "model.json").exists()


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (
            {"factors": {"flash_attn": ["off"]}},
            "factors.flash_attn: checkpoints.tiny is attached to a server this run never restarts, which takes"
            " it only when it starts (-fa)",
        ),
        (
            {"factors": {"batch": [2]}},
            "factors.batch: checkpoints.tiny is attached to a server this run never restarts, which would need"
            " slots of its own",
        ),
        (
            {"fixed_prefix": {"precisions": ["fp16", "fp32"]}},
            "checkpoints.tiny is attached: its server holds one cache type, and this run asks for fp16, fp32",
        ),
        ({"engine": "llamacpp"}, "checkpoints.tiny.attach: the llamacpp engine attaches to no server"),
    ],
)
def test_what_an_attached_server_cannot_run_is_refused_before_any_job(gguf, tmp_path, change, refusal):
    attach = {"url": "http://127.0.0.1:1", "slot_dir": str(tmp_path)}
    ledger, config = attach_config(tmp_path, gguf, attach, "refused", factors={})
    if "engine" in change:
        import yaml

        loaded = yaml.safe_load(config.read_text())
        loaded["checkpoints"]["tiny"]["engine"] = change.pop("engine")
        config.write_text(yaml.safe_dump(loaded))
    if change:
        ledger, config = attach_config(tmp_path, gguf, attach, "refused", **{"factors": {}, **change})
    result = snakemake(tmp_path, config, "-n")
    assert result.returncode != 0
    assert refusal in result.stdout + result.stderr, (result.stdout + result.stderr)[-2000:]
    assert not ledger.exists()
