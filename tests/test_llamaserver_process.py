"""llama.cpp's own server as a child process, on the tiny random Qwen2 GGUF: real binary, real processes.

Without the built server (SPEC=envs/llamaserver.txt bash envs/setup.sh) these tests skip with the
reason; with STAGEREPLAY_REQUIRE_LLAMASERVER=1 (set by .ci/run) a missing server fails them instead.
The checks of a missing or foreign binary need no server and always run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from workflow_helpers import skip_unless_required

from stagereplay.engines.llamacpp.state import LlamaStateError
from stagereplay.engines.llamaserver.build import (
    LlamaServerError,
    installed_binding_version,
    server_binary,
    server_build,
)
from stagereplay.engines.llamaserver.client import greedy_margin
from stagereplay.engines.llamaserver.process import ServerProcess, ServerSettings
from stagereplay.engines.llamaserver.slots import gguf_geometry, read_slot_file, write_slot_file
from stagereplay.inputs.checkpoints import build_random_qwen2
from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

SRC = Path(__file__).resolve().parents[1] / "src"
PROMPT = [197, 215, 20, 132, 248, 207, 155, 244, 183, 111, 71, 144]  # byte ids: any the vocabulary has


def _server_problem() -> str | None:
    try:
        server_binary()
    except LlamaServerError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def built():
    skip_unless_required(_server_problem(), "STAGEREPLAY_REQUIRE_LLAMASERVER")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The tiny random Qwen2 with near-tied logits: its greedy continuations vary from token to token (the plain
    one, with a tied head, repeats the last prompt token), so a wrong or sampled token would show."""
    folder = build_random_qwen2(tmp_path_factory.mktemp("ties") / "model", seed=0, layers=2, hidden=64, near_ties=True)
    return write_qwen2_gguf(folder, tmp_path_factory.mktemp("gguf") / "ties.gguf")


@pytest.fixture
def server(built, tiny_gguf, tmp_path):
    settings = ServerSettings(ctx_size=512)
    # The log in the test's folder: a failure keeps it (a default, temporary one would outlive the test).
    with ServerProcess(tiny_gguf, settings, slot_dir=tmp_path / "slots", log_path=tmp_path / "server.log") as server:
        yield server


def _alive(pid: int) -> bool:
    """Running, and not a zombie left for a parent that no longer reaps it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# The binary: missing or foreign, one line with the fix (no server needed).


def test_a_missing_binary_is_one_line_with_the_fix(tmp_path):
    with pytest.raises(LlamaServerError) as error:
        server_binary(tmp_path / "bin" / "llama-server")
    assert "llama-server is not built" in _one_line(error)
    assert "SPEC=envs/llamaserver.txt bash envs/setup.sh" in str(error.value)


def test_a_binary_without_a_record_or_built_for_another_binding_is_refused(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    with pytest.raises(LlamaServerError) as error:
        server_binary(binary)
    assert "has no build record" in _one_line(error)
    record = {
        "llama_cpp_python": "0.0.1",
        "llama_cpp_commit": "unknown",
        "cmake_flags": [],
        "march_native": "x",
        "cpu_features": [],
        "version_output": "",
    }
    binary.with_name("llama-server.json").write_text(json.dumps(record))
    with pytest.raises(LlamaServerError) as error:
        server_binary(binary)
    assert "built from llama-cpp-python 0.0.1" in _one_line(error)
    assert f"the installed one is {installed_binding_version() or 'none'}" in str(error.value)
    assert "SPEC=envs/llamaserver.txt bash envs/setup.sh" in str(error.value)


# The server: start, answer, stop.


def test_a_token_tied_with_the_top_is_greedy_whichever_the_server_lists_first():
    # The server lists its top tokens by an unstable partial sort: at an exact tie the token it chose (the lowest id
    # of the tied) may be listed second. A tie is greedy, with margin 0; a token below the top is not, in one line.
    tie = -0.6931471805599453
    listed_second = {"top_logprobs": [{"id": 578, "logprob": tie}, {"id": 260, "logprob": tie}]}
    assert greedy_margin(260, listed_second) == 0.0 and greedy_margin(578, listed_second) == 0.0
    below = {"top_logprobs": [{"id": 578, "logprob": -0.5}, {"id": 260, "logprob": -1.25}]}
    assert greedy_margin(578, below) == 0.75
    with pytest.raises(LlamaServerError, match=r"^llama-server chose token 260 \(log-probability -1.25\), its highest"):
        greedy_margin(260, below)
    with pytest.raises(LlamaServerError, match=r"chose token 7 \(not among its top 2\).*: not greedy$"):
        greedy_margin(7, below)


def test_build_record_names_the_binding_its_commit_and_cpu(built):
    build = server_build()
    assert build.llama_cpp_python == installed_binding_version()
    assert "-DGGML_NATIVE=ON" in build.cmake_flags and build.cpu_features
    assert build.llama_cpp_commit in build.version_output


def test_starts_healthy_reports_its_build_and_stops(built, tiny_gguf, tmp_path):
    with ServerProcess(tiny_gguf, ServerSettings(ctx_size=512), slot_dir=tmp_path / "slots") as server:
        pid = server.pid
        assert _alive(pid)
        assert server.request("/health") == {"status": "ok"}
        props = server.props()
        assert props["build_info"].endswith(server_build().llama_cpp_commit)
        assert props["total_slots"] == 1
    assert not _alive(pid)
    assert server.process is None


def test_token_completion_is_greedy_and_deterministic(server):
    first = server.complete(PROMPT, 12, cache_prompt=False)
    second = server.complete(PROMPT, 12, cache_prompt=False)
    assert first["tokens"] == second["tokens"]
    assert len(first["tokens"]) == 12 and first["stop_type"] == "limit"
    assert first["tokens_evaluated"] == len(PROMPT)
    # Greedy: the generated ids continue the prompt, so feeding prompt + the first k back gives the rest.
    resumed = server.complete(PROMPT + first["tokens"][:4], 8, cache_prompt=False)
    assert resumed["tokens"] == first["tokens"][4:12]


def test_a_slot_saved_is_read_by_the_state_parser_and_restores(server, tiny_gguf):
    first = server.complete(PROMPT, 8)
    generated = first["tokens"]
    saved = server.save_slot(0, "slot0.bin")
    path = server.slot_dir / "slot0.bin"
    assert saved["n_written"] == path.stat().st_size
    assert sorted(p.name for p in server.slot_dir.iterdir()) == ["slot0.bin"]  # saved under a partial name, renamed
    tokens, state = read_slot_file(path, gguf_geometry(tiny_gguf))
    # The slot holds the prompt and every generated token but the last, which was sampled, never decoded.
    assert tokens == PROMPT + generated[:-1]
    assert saved["n_saved"] == len(tokens) == state.kv.num_positions
    assert state.cache_type == "fp16" and state.v_trans and state.seq_id == 0
    server.erase_slot(0)
    restored = server.restore_slot(0, "slot0.bin")
    assert restored["n_restored"] == len(tokens)
    # The restored cache is reused: only the last generated token is fed, and greedy goes on the same.
    again = server.complete(PROMPT + generated, 4)
    assert again["tokens_evaluated"] == len(PROMPT) + len(generated)
    assert again["timings"]["prompt_n"] == 1
    reference = server.complete(PROMPT + generated, 4, cache_prompt=False)
    assert again["tokens"] == reference["tokens"]


def test_slots_of_a_unified_cache_parse_each_as_its_own_sequence(built, tiny_gguf, tmp_path):
    settings = ServerSettings(ctx_size=1024, parallel=2, kv_unified=True)
    with ServerProcess(tiny_gguf, settings, slot_dir=tmp_path / "slots") as server:
        server.complete(PROMPT, 8, slot=1)
        server.complete(PROMPT[:6], 5, slot=0)  # a task on slot 0 leaves slot 1's cache in place
        for slot, held in ((0, 6 + 4), (1, len(PROMPT) + 7)):
            assert server.save_slot(slot, f"slot{slot}.bin")["n_saved"] == held
            tokens, state = read_slot_file(server.slot_dir / f"slot{slot}.bin", gguf_geometry(tiny_gguf), slot=slot)
            assert len(tokens) == state.kv.num_positions == held and state.seq_id == slot


def test_slots_of_separate_caches_are_read_and_written_back_byte_for_byte(built, tiny_gguf, tmp_path):
    """Without a unified cache each slot is a stream of its own and a slot file holds every stream (the others
    empty): the parser finds the slot's stream, and the state written back as a slot file (its token list in
    the older plain layout) reads back the same. (Before kv_unified, the parser refused any state of more than
    one stream.)"""
    settings = ServerSettings(ctx_size=1024, parallel=2, kv_unified=False)
    with ServerProcess(tiny_gguf, settings, slot_dir=tmp_path / "slots") as server:
        server.complete(PROMPT, 4, slot=1)
        server.save_slot(1, "slot1.bin")
        tokens, state = read_slot_file(server.slot_dir / "slot1.bin", gguf_geometry(tiny_gguf), slot=1)
        assert (state.streams, state.stream, state.kv.num_positions) == (2, 1, len(tokens))
        assert tokens[: len(PROMPT)] == PROMPT
        write_slot_file(tmp_path / "again.bin", state, tokens)
        again_tokens, again = read_slot_file(tmp_path / "again.bin", gguf_geometry(tiny_gguf), slot=1)
        assert again_tokens == tokens and (again.streams, again.stream) == (2, 1)
        assert all(a.equal(b) for a, b in zip((*again.kv.keys, *again.kv.values), (*state.kv.keys, *state.kv.values)))
        server.erase_slot(1)
        (server.slot_dir / "again.bin").write_bytes((tmp_path / "again.bin").read_bytes())
        assert server.restore_slot(1, "again.bin")["n_restored"] == len(tokens)  # the server takes it back


def test_server_greedy_is_the_binding_engines_greedy(server, tiny_gguf):
    """The server and the binding come from one llama.cpp tree: one prompt batch then one token per decode, on
    one thread each, gives the same greedy ids."""
    from test_llamacpp import _binding_problem

    skip_unless_required(_binding_problem(), "STAGEREPLAY_REQUIRE_LLAMACPP")
    from stagereplay.engines.llamacpp.engine import EngineSettings, LlamaCppEngine

    engine = LlamaCppEngine(tiny_gguf, EngineSettings(cache_type="fp16", n_threads=1, n_threads_batch=1, n_ctx=512))
    cache, ids = engine.empty_cache(), []
    logits = engine.forward(PROMPT, cache)
    for _ in range(16):
        ids.append(int(logits.argmax()))
        logits = engine.forward([ids[-1]], cache)
    engine.close()
    assert server.complete(PROMPT, 16, cache_prompt=False)["tokens"] == ids


def test_a_truncated_slot_file_gets_the_parsers_one_line(server, tiny_gguf, tmp_path):
    server.complete(PROMPT, 4)
    server.save_slot(0, "slot0.bin")
    data = (server.slot_dir / "slot0.bin").read_bytes()
    broken = tmp_path / "truncated.bin"
    broken.write_bytes(data[:-5])
    with pytest.raises(LlamaStateError) as error:
        read_slot_file(broken, gguf_geometry(tiny_gguf))
    assert "llama-cpp-python 0.3.36" in _one_line(error)
    broken.write_bytes(data[:10])
    with pytest.raises(LlamaStateError) as error:
        read_slot_file(broken, gguf_geometry(tiny_gguf))
    assert "inside its header" in _one_line(error)


# Faults: one line each.


def test_a_request_error_names_the_endpoint_and_the_servers_message(server):
    with pytest.raises(LlamaServerError) as error:
        server.complete([999999], 2)
    assert _one_line(error) == "llama-server POST /completion: HTTP 400: Prompt contains invalid tokens"
    with pytest.raises(LlamaServerError) as error:
        server.restore_slot(0, "absent.bin")
    assert _one_line(error).startswith("llama-server POST /slots/0?action=restore: HTTP 400: Unable to restore slot")


def test_a_slot_the_server_does_not_have_is_refused_before_it_wraps_around(server):
    # The server takes slot ids modulo its slot count: slot 7 of one slot would silently be slot 0.
    with pytest.raises(LlamaServerError) as error:
        server.save_slot(7, "x.bin")
    assert "slot 7: this server has 1 slot (0..0)" in _one_line(error)


def test_a_request_timeout_is_one_line(server):
    with pytest.raises(LlamaServerError) as error:
        server.request("/completion", {"prompt": PROMPT, "n_predict": 400, "ignore_eos": True}, timeout=0.001)
    assert "POST /completion: no answer within 0.001 s" in _one_line(error)


def test_a_bad_model_file_is_one_line_from_the_servers_log(built, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(LlamaServerError) as error:
        ServerProcess(bad, log_path=tmp_path / "bad.log").start()
    message = _one_line(error)
    assert message.startswith(f"llama-server did not start for {bad} (exit status 1): ")
    with pytest.raises(LlamaServerError) as error:
        ServerProcess(tmp_path / "absent.gguf").start()
    assert "not found" in _one_line(error)


def test_a_port_in_use_is_one_line(built, tiny_gguf, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LlamaServerError) as error:
            ServerProcess(tiny_gguf, port=port, log_path=tmp_path / "server.log").start()
    assert f"could not listen on 127.0.0.1:{port}: the port is in use" in _one_line(error)


def test_a_server_killed_mid_job_gives_one_line_with_its_exit_status(server):
    errors, started = [], threading.Event()

    def job():
        try:
            while True:  # completions back to back until the server is gone
                started.set()
                server.complete(PROMPT, 400, cache_prompt=False, ignore_eos=True)
        except LlamaServerError as error:
            errors.append(str(error))

    thread = threading.Thread(target=job)
    thread.start()
    started.wait(10)
    time.sleep(0.3)
    os.kill(server.pid, signal.SIGKILL)
    thread.join(30)
    assert len(errors) == 1 and "\n" not in errors[0]
    assert "died (killed by SIGKILL): POST /completion" in errors[0]
    with pytest.raises(LlamaServerError) as error:
        server.request("/health")
    assert "died (killed by SIGKILL): GET /health not sent" in _one_line(error)


# No orphan: the server goes with the Python process that started it.

CHILD = """
import sys, time
from stagereplay.engines.llamaserver.process import ServerProcess, ServerSettings
with ServerProcess(sys.argv[1], ServerSettings(ctx_size=512), log_path=sys.argv[2]) as server:
    print(server.pid, flush=True)
    while True:  # completions back to back: the signal comes mid-job
        server.complete([72, 101], 400, cache_prompt=False, ignore_eos=True)
"""


def _child_with_server(tiny_gguf, log: Path) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tiny_gguf), str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    line = child.stdout.readline()
    assert line.strip().isdigit(), child.stderr.read()
    time.sleep(0.5)  # the completion is running
    return child, int(line)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_server_outlives_its_python_process(built, tiny_gguf, how, tmp_path):
    child, server_pid = _child_with_server(tiny_gguf, tmp_path / "server.log")
    assert _alive(server_pid)
    child.send_signal(how)
    child.wait(30)
    assert child.returncode == (143 if how == signal.SIGTERM else -signal.SIGKILL)
    assert _gone_within(server_pid, 10), f"llama-server {server_pid} outlived its parent ({how.name})"
