"""The llamaserver engine on a real llama-server and the tiny near-tied GGUF, beside the binding's engine.

Without the built server (SPEC=envs/llamaserver.txt bash envs/setup.sh) or the binding these tests skip with the
reason; with STAGEREPLAY_REQUIRE_LLAMASERVER=1 (.ci/run) a missing server fails them instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from test_llamaserver_process import PROMPT, _alive, _server_problem
from workflow_helpers import skip_unless_required, snakemake, write_config

from stagereplay.engines.llamacpp.engine import load_llamacpp
from stagereplay.engines.runtime import Runtime
from stagereplay.experiments.constructions import StageBoundary, build_boundary_state, build_live
from stagereplay.experiments.decode import continue_from
from stagereplay.inputs.checkpoints import build_random_qwen2
from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

SRC = Path(__file__).resolve().parents[1] / "src"
# The server's log-probabilities are float32 exp/sum/log of the same float32 logits: a difference of two
# (a margin) is the logits' difference to a few ulps of |logprob| (about log of the vocabulary, < 8 here).
MARGIN_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def built():
    skip_unless_required(_server_problem(), "STAGEREPLAY_REQUIRE_LLAMASERVER")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = build_random_qwen2(tmp_path_factory.mktemp("ties") / "model", seed=0, layers=2, hidden=64, near_ties=True)
    return write_qwen2_gguf(folder, tmp_path_factory.mktemp("gguf") / "ties.gguf")


@pytest.fixture(scope="module")
def engines(built, tiny_gguf):
    from stagereplay.engines.llamaserver.engine import load_llamaserver

    runtime = Runtime("fp16", "cpu", 1)
    server, binding = load_llamaserver(tiny_gguf, runtime), load_llamacpp(tiny_gguf, runtime)
    yield server, binding
    server.close()
    binding.close()


def server_config(tmp_path: Path, **overrides) -> tuple[Path, Path]:
    """A tiny workflow on the server (2 items in one shard, a random 2-layer GGUF): its ledger and config."""
    ledger = tmp_path / "ledger"
    config = write_config(
        tmp_path / "config.yaml",
        ledger_dir=str(ledger),
        checkpoints={"tiny-server": {"engine": "llamaserver", "random_qwen2": {"seed": 2, "layers": 2, "hidden": 64}}},
        items={"limit": 2},
        shard_size=2,
        **overrides,
    )
    return ledger, config


def _same(a, b) -> bool:
    return all(x.equal(y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)))


def test_live_and_constructions_match_the_binding_byte_for_byte(engines):
    server, binding = engines
    runs = {}
    for name, engine in (("server", server), ("binding", binding)):
        live = build_live(engine, PROMPT, StageBoundary(10), engine.eos_ids, engine.tokenizer)
        built = {
            construction: build_boundary_state(engine, list(live.prefix), construction, len(PROMPT))
            for construction in ("prefill", "incremental", "chunked:4")
        }
        runs[name] = live, built
    (server_live, server_built), (binding_live, binding_built) = runs["server"], runs["binding"]
    assert server_live.prefix == binding_live.prefix and server_live.reasoning.stop == binding_live.reasoning.stop
    assert _same(server_live.state, binding_live.state)
    for construction, state in server_built.items():
        assert _same(state, binding_built[construction]), construction
        # Where the binding's live boundary equals a rebuilt one, the server's does too, and the other way.
        assert _same(server_live.state, state) == _same(binding_live.state, binding_built[construction]), construction
    assert _same(server_live.state, server_built["incremental"])  # live's own operations, token by token


def test_a_saved_and_restored_boundary_continues_as_the_live_slot(engines):
    server, _ = engines
    cache = server.empty_cache()
    stage, _, _ = server.generate(cache, PROMPT, 10, server.eos_ids)
    state = server.snapshot(cache)  # saved, parsed
    direct = server.generate(cache, [stage[-1]], 12, server.eos_ids)  # the live slot itself, never saved
    restored = continue_from(server, state, stage[-1], 12, server.eos_ids)  # written, restored, continued
    assert (list(restored.tokens), list(restored.margins), restored.stop) == tuple(direct)


def test_step_wise_decoding_is_the_one_request_decoding(engines):
    server, _ = engines
    whole = server.empty_cache()
    one = server.generate(whole, PROMPT, 10, server.eos_ids)
    one_state = server.snapshot(whole)
    stepped = server.empty_cache()
    # The byte vocabulary ends some tokens inside a multi-byte character (no probabilities come back for them):
    # those steps are run again on the rewound slot, which must leave the same cells.
    steps = server.generate(stepped, PROMPT, 10, server.eos_ids, stop_after=lambda tokens: False)
    assert steps[:2] == one[:2] and steps[2] == "budget" == one[2]
    assert _same(server.snapshot(stepped), one_state)


def test_margins_are_the_bindings_float32_margins(engines):
    server, binding = engines
    live = build_live(binding, PROMPT, StageBoundary(10), binding.eos_ids, binding.tokenizer)
    logits = {}
    for name, engine in (("server", server), ("binding", binding)):
        cache = engine.to_cache(live.state)
        logits[name] = engine.forward([live.prefix[-1]], cache)
    top_server, top_binding = torch.topk(logits["server"], 2), torch.topk(logits["binding"], 2)
    assert top_server.indices[0] == top_binding.indices[0]
    margin_server = float(top_server.values[0] - top_server.values[1])
    margin_binding = float(top_binding.values[0] - top_binding.values[1])
    assert abs(margin_server - margin_binding) <= MARGIN_TOLERANCE
    # The row is the logits less one constant: shift both to their maximum and compare where not underflowed.
    near = logits["binding"] > logits["binding"].max() - 50
    shifted = (logits["server"] - logits["server"].max()) - (logits["binding"] - logits["binding"].max())
    assert float(shifted[near].abs().max()) <= MARGIN_TOLERANCE
    suffixes = [continue_from(engine, live.state, live.prefix[-1], 12, engine.eos_ids) for engine in (server, binding)]
    assert suffixes[0].tokens == suffixes[1].tokens
    assert max(abs(a - b) for a, b in zip(suffixes[0].margins, suffixes[1].margins)) <= MARGIN_TOLERANCE


CHILD = """
import sys
from stagereplay.engines.llamaserver.engine import load_llamaserver
from stagereplay.engines.runtime import Runtime
engine = load_llamaserver(sys.argv[1], Runtime("fp16", "cpu", 1))
print(engine.server.pid, flush=True)
engine.generate(engine.empty_cache(), [72, 101], 4, engine.eos_ids)
"""  # ends without close(), as a job does


def test_the_jobs_server_is_gone_after_the_job(engines, tiny_gguf):
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    child = subprocess.run([sys.executable, "-c", CHILD, str(tiny_gguf)], capture_output=True, text=True, env=env)
    assert child.returncode == 0, child.stderr[-2000:]
    pid = int(child.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    server, _ = engines
    from stagereplay.engines.llamaserver.engine import load_llamaserver

    closing = load_llamaserver(tiny_gguf, Runtime("fp16", "cpu", 1))
    pid, slots = closing.server.pid, closing.slot_dir
    closing.close()
    assert not _alive(pid) and not slots.exists()


@pytest.mark.slow
def test_a_tiny_workflow_runs_on_the_server(built, tmp_path):
    ledger, config = server_config(
        tmp_path,
        matched={"precision": "fp16", "replicas": 2},
        fixed_prefix={"precisions": ["fp16"], "constructions": ["incremental", "prefill"]},
        transplant={"outcome_blind": {"checkpoint": None, "sample": 1, "seed": 0}, "cross_precision": None},
    )
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    assert {row["engine"] for row in rows} == {"llamaserver"}
    assert all("llama-server of llama-cpp-python" in row["engine_build"] for row in rows)
    assert all("-ub 2048" in row["engine_build"] and "--no-repack" in row["engine_build"] for row in rows)
    summary = json.loads((ledger / "summary.json").read_text())
    e1 = summary["E1"]["checkpoints"]["tiny-server"]
    for side in ("live", "prefill"):  # replicas are separate jobs, so separate server processes
        assert (e1["replicas_exact"][side]["count"], e1["replicas_exact"][side]["n"]) == (2, 2)
    bridge = summary["E3"]["checkpoints"]["tiny-server"]["precisions"]["fp16"]["bit_exact"]
    assert (bridge["count"], bridge["n"]) == (2, 2)  # token by token through the slot: the live cache, bit for bit


def test_the_spec_takes_the_bindings_precisions():
    from stagereplay.engines.registry import spec_named

    server, binding = spec_named("llamaserver"), spec_named("llamacpp")
    assert server.precisions == binding.precisions and server.record_kind == "gguf"
    assert set(server.factors) == {
        "threads",
        "flash_attn",
        "ubatch",
        "cache_type",
        "prefix_reuse",
        "batch",
        "kv_offset",
        "kv_unified",
    }  # tests/test_llamaserver_factors.py, tests/test_llamaserver_load.py, tests/test_llamaserver_placement.py
    # Each as the server runs it: a per-process option is a restart, batch and its kin are load on the server,
    # prefix reuse is its own kept slot (save and restore),
    # and a level the binding refuses the server refuses alike.
    assert {name: knob.mechanism for name, knob in server.factors.items()} == {
        "threads": "restart",
        "flash_attn": "restart",
        "ubatch": "restart",
        "cache_type": "restart",
        "prefix_reuse": "kept",
        "batch": "load",
        "kv_offset": "load",
        "kv_unified": "load",
    }
    refusal = server.factors["cache_type"].refusal("q5_1", "fp16", True)
    assert refusal and refusal == binding.factors["cache_type"].refusal("q5_1", "fp16", True)
    assert server.head_bytes("q8_0", "k", 64) == binding.head_bytes("q8_0", "k", 64)


def test_a_stage_marker_stops_both_engines_at_the_same_token(engines):
    server, binding = engines
    plain = build_live(binding, PROMPT, StageBoundary(10), binding.eos_ids, binding.tokenizer)
    # The marker is the sixth generated token's text: the stage must end there, decoded step-wise on the server.
    marker = binding.tokenizer.decode([plain.reasoning.tokens[5]], skip_special_tokens=False)
    boundary = StageBoundary(10, marker=marker)
    lives = [build_live(engine, PROMPT, boundary, engine.eos_ids, engine.tokenizer) for engine in (server, binding)]
    assert lives[0].prefix == lives[1].prefix and lives[0].reasoning.stop == lives[1].reasoning.stop == "marker"
    assert lives[0].marker_match == lives[1].marker_match
    assert _same(lives[0].state, lives[1].state)
    assert max(abs(a - b) for a, b in zip(lives[0].reasoning.margins, lives[1].reasoning.margins)) <= MARGIN_TOLERANCE


@pytest.mark.parametrize(("precision", "flash_attn"), [("q8_0-fp16", False), ("q8_0", True)])
def test_a_quantized_cache_is_the_bindings_blocks_with_the_rotation_from_the_server_log(
    built, tmp_path, precision, flash_attn
):
    from stagereplay.engines.llamaserver.engine import load_llamaserver

    # Heads of 64 values (hidden 256, 4 heads): whole q8_0 blocks, and llama.cpp rotates them.
    folder = build_random_qwen2(tmp_path / "model", seed=3, layers=2, hidden=256)
    wide = write_qwen2_gguf(folder, tmp_path / "wide.gguf")
    runtime = Runtime(precision, "cpu", 1, flash_attn=flash_attn)
    server, binding = load_llamaserver(wide, runtime), load_llamacpp(wide, runtime)
    try:
        assert server.formats == binding.formats and "h64" in server.formats[0]
        lives = [
            build_live(engine, PROMPT, StageBoundary(8), engine.eos_ids, engine.tokenizer)
            for engine in (server, binding)
        ]
        assert lives[0].prefix == lives[1].prefix and _same(lives[0].state, lives[1].state)
        suffixes = [continue_from(e, lives[1].state, lives[1].prefix[-1], 8, e.eos_ids) for e in (server, binding)]
        assert suffixes[0].tokens == suffixes[1].tokens
    finally:
        server.close()
        binding.close()
