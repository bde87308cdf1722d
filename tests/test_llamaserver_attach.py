"""A llama-server someone else runs, attached by URL (``llamaserver.attached``, ``llamaserver.probe``,
``stagereplay probe``).

Each server here is started by the test as another user would start theirs: the model, an address and flags
this project's own jobs never use (4 slots, the default unified cache, the host prompt cache on with idle-slot
caching), plus ``--no-repack``: without it the built server crashed at start on this project's AMX test
machine (SIGSEGV after "llama threadpool init"), as the binding does. Real binary, tiny GGUF; skipped without
the server unless STAGEREPLAY_REQUIRE_LLAMASERVER=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_llamaserver_process import PROMPT, SRC, built, tiny_gguf  # noqa: F401 - fixtures

from stagereplay.engines.llamaserver.attached import AttachedServer, api_key_from
from stagereplay.engines.llamaserver.build import LlamaServerError, server_build
from stagereplay.engines.llamaserver.probe import probe
from stagereplay.engines.llamaserver.process import ServerProcess, free_port
from stagereplay.inputs.checkpoints import build_random_qwen2
from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

# What a user might start: 4 slots, everything else the server's own default (see the module's docstring).
SOMEONE_ELSES_FLAGS = ["-np", "4", "--no-repack"]


class SomeoneElsesServer(ServerProcess):
    """A llama-server started with the model, an address and ``flags`` only: none of this project's settings."""

    def __init__(self, model: Path, flags: list[str], log_path: Path, port: int | None = None):
        super().__init__(model, log_path=log_path, port=port)
        self.flags = flags

    def command(self, port: int) -> list[str]:
        return [str(self.binary), "--model", str(self.model), "--host", "127.0.0.1", "--port", str(port), *self.flags]


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.fixture
def their_server(built, tiny_gguf, tmp_path):  # noqa: F811
    with SomeoneElsesServer(tiny_gguf, SOMEONE_ELSES_FLAGS, tmp_path / "server.log") as server:
        yield server


@pytest.fixture
def their_server_with_slot_files(built, tiny_gguf, tmp_path):  # noqa: F811
    slot_dir = tmp_path / "their-slots"
    slot_dir.mkdir()
    flags = [*SOMEONE_ELSES_FLAGS, "--slot-save-path", str(slot_dir)]
    with SomeoneElsesServer(tiny_gguf, flags, tmp_path / "server.log") as server:
        yield server, slot_dir


def test_probe_reads_the_server_and_allows_no_cache_bytes_without_slot_files(their_server, tiny_gguf):  # noqa: F811
    guest = AttachedServer(their_server.address, slots=(0, 1))
    found = probe(guest)
    assert found.identity.total_slots == 4
    assert found.identity.model_path == str(tiny_gguf)
    assert found.identity.commit == server_build().llama_cpp_commit
    assert found.model_file_here and found.slot_files is False
    runs = {allowance.what: allowance for allowance in found.allowances}
    assert runs["E1 matched: suffixes"].runs
    assert runs["served: alone, control, hit"].runs and runs["served: amid other clients"].runs
    for needs_cache_bytes in ("E1 matched: boundary caches", "E3 bridge", "E5 transplant"):
        assert not runs[needs_cache_bytes].runs and "--slot-save-path" in runs[needs_cache_bytes].why
    assert "restore levels need --slot-save-path" in runs["E6 prefix_reuse (prompt, block)"].why
    assert runs["E6 batch"].runs and "amid up to 1 other clients" in runs["E6 batch"].why
    # An offset behind an idle slot's cells: served requests, the filler on the run's second slot.
    assert runs["E6 kv_offset"].runs and "served.kv_offsets" in runs["E6 kv_offset"].why
    for per_process in ("E6 cache_type", "E6 flash_attn", "E6 ubatch", "E6 threads", "E6 kv_unified"):
        assert (
            not runs[per_process].runs and "list a second server started with the other value" in runs[per_process].why
        )
    # One slot only: concurrent load and an offset behind another slot need two.
    alone = {allowance.what: allowance for allowance in probe(AttachedServer(their_server.address)).allowances}
    assert not alone["E6 batch"].runs and not alone["E6 kv_offset"].runs
    assert not alone["served: amid other clients"].runs


def test_probe_learns_slot_files_are_on_without_writing_one(their_server_with_slot_files):
    server, slot_dir = their_server_with_slot_files
    found = probe(AttachedServer(server.address))
    assert found.slot_files is True
    runs = {allowance.what: allowance.runs for allowance in found.allowances}
    assert runs["E1 matched: boundary caches"] and runs["E3 bridge"] and runs["E5 transplant"]
    assert runs["E6 prefix_reuse"]
    assert list(slot_dir.iterdir()) == []  # the probe saved nothing


def test_the_probe_command_prints_the_table(their_server):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "stagereplay", "probe", their_server.address, "--slots", "0", "1", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"llama-server at {their_server.address}" in result.stdout
    assert "slots: 4, context" in result.stdout and "this run may use [0, 1, 2]" in result.stdout
    assert "slot files: off: started without --slot-save-path" in result.stdout
    table = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("  E6 ")}
    assert "yes" in table["batch"].split() and "amid up to 2 other clients" in table["batch"]


def test_a_guest_sends_nothing_to_a_slot_it_was_not_given(their_server):
    guest = AttachedServer(their_server.address, slots=(1,))
    with pytest.raises(LlamaServerError) as error:
        guest.complete(PROMPT, 2, slot=0)
    assert "this run may use slots [1] of the llama-server at" in _one_line(error)
    answer = guest.complete(PROMPT, 2, slot=1, cache_prompt=False)
    assert len(answer["tokens"]) == 2
    with pytest.raises(LlamaServerError) as error:
        probe(AttachedServer(their_server.address, slots=(0, 4)))
    assert "slot 4 is not one of the 4 slots" in _one_line(error)


def test_nothing_answering_at_the_url_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LlamaServerError) as error:
        probe(AttachedServer(url))
    assert f"no llama-server answers at {url} (ConnectionRefusedError)" in _one_line(error)
    with pytest.raises(LlamaServerError) as error:
        AttachedServer("localhost:8080")
    assert "is not a llama-server address — give it as http://HOST:PORT" in _one_line(error)


def test_another_clients_failed_request_names_its_item():
    # Amid other clients, the first failure raised is a companion's (sent first): its item is named, not the run's.
    import random

    from stagereplay.engines.llamaserver.traffic import amid_clients

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LlamaServerError) as error:
        amid_clients(AttachedServer(url), [1, 2, 3], {"arith-007": [4, 5], "arith-003": [6]}, 4, 0.01, random.Random(0))
    assert f"another client's request (item arith-007) amid the item's: no llama-server answers at {url}" in _one_line(
        error
    )


def test_an_api_key_comes_from_the_variable_the_config_names(built, tiny_gguf, tmp_path, monkeypatch):  # noqa: F811
    flags = [*SOMEONE_ELSES_FLAGS, "--api-key", "their-secret"]
    with SomeoneElsesServer(tiny_gguf, flags, tmp_path / "server.log") as server:
        with pytest.raises(LlamaServerError) as error:
            probe(AttachedServer(server.address))
        assert "HTTP 401" in _one_line(error) and "api_key_env" in str(error.value)
        monkeypatch.delenv("THEIR_KEY", raising=False)
        with pytest.raises(LlamaServerError) as error:
            api_key_from("THEIR_KEY", "served.servers.theirs.api_key_env")
        assert "served.servers.theirs.api_key_env names the environment variable THEIR_KEY, which is not set" in (
            _one_line(error)
        )
        monkeypatch.setenv("THEIR_KEY", "their-secret")
        found = probe(
            AttachedServer(server.address, api_key=api_key_from("THEIR_KEY", "served.servers.theirs.api_key_env"))
        )
        assert found.identity.total_slots == 4


def test_a_server_restarted_with_another_model_is_one_line(built, tiny_gguf, tmp_path):  # noqa: F811
    other_folder = build_random_qwen2(tmp_path / "other", seed=1, layers=2, hidden=64)
    other = write_qwen2_gguf(other_folder, tmp_path / "other.gguf")
    port = free_port()
    with SomeoneElsesServer(tiny_gguf, SOMEONE_ELSES_FLAGS, tmp_path / "a.log", port=port) as server:
        guest = AttachedServer(server.address)
        recorded = guest.identity()
        guest.check_unchanged(recorded)  # the same server: nothing to say
    with SomeoneElsesServer(other, SOMEONE_ELSES_FLAGS, tmp_path / "b.log", port=port):
        with pytest.raises(LlamaServerError) as error:
            guest.check_unchanged(recorded)
    message = _one_line(error)
    assert f"is not the one this run recorded: model_path {str(other)!r} (was {str(tiny_gguf)!r})" in message
