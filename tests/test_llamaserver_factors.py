"""E6 on the llamaserver engine: the per-process factors (threads, flash_attn, ubatch, cache_type) run by the
binding's setting classes, each level a server restart; checked against the reference and the binding.

Real llama-server and the tiny GGUF as tests/test_llamaserver_engine.py makes them; skipped without the server
unless STAGEREPLAY_REQUIRE_LLAMASERVER=1.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pyarrow.parquet as pq
import pytest
from test_llamaserver_engine import _same, built, server_config, tiny_gguf  # noqa: F401 - fixtures
from test_llamaserver_process import PROMPT
from workflow_helpers import snakemake

from stagereplay.design.factors import Level, factor_named
from stagereplay.engines.llamacpp.engine import load_llamacpp
from stagereplay.engines.runtime import Runtime
from stagereplay.experiments import batch_settings, factor_settings  # noqa: F401 - every setting registered
from stagereplay.experiments.constructions import StageBoundary, build_live
from stagereplay.experiments.factor_settings import CacheType, HeldPrefix, Reconfigured, Threads
from stagereplay.experiments.level_job import Prefix
from stagereplay.experiments.setting import Setting
from stagereplay.ledger.store import ObjectStore

BUDGET = 8
RUNTIME = Runtime("fp16", "cpu", 1)  # flash attention off, one thread: the reference


@pytest.fixture(scope="module")
def engines(built, tiny_gguf):  # noqa: F811
    from stagereplay.engines.llamaserver.engine import load_llamaserver

    server, binding = load_llamaserver(tiny_gguf, RUNTIME), load_llamacpp(tiny_gguf, RUNTIME)
    yield server, binding
    server.close()
    binding.close()


@pytest.fixture(scope="module")
def prefix(engines):
    server, _ = engines
    live = build_live(server, PROMPT, StageBoundary(10), server.eos_ids, server.tokenizer)
    return Prefix("item", tuple(live.prefix), len(PROMPT), False)


def _setting(engine, factor: str, value, runtime: Runtime = RUNTIME):
    eos = engine.eos_ids
    if factor == "threads":
        return Threads(engine, BUDGET, eos, engine.use_threads, value, runtime.threads)
    kind = CacheType if factor == "cache_type" else Reconfigured
    reference = factor_named(factor).value(factor_named(factor).reference(dataclasses.asdict(runtime), None))
    return kind(engine, BUDGET, eos, factor, value, reference)


def _cells(engine, factor, value, prefix, runtime: Runtime = RUNTIME):
    """The reference build and read, and the level's three cells, as factor_job runs them."""
    reference, setting = Setting(engine, BUDGET, engine.eos_ids), _setting(engine, factor, value, runtime)
    ref_state = reference.build(prefix).state
    test_state = setting.build(prefix).state
    return {
        "ref": (ref_state, reference.read(prefix, ref_state, None)),
        "test-ref": (test_state, reference.read(prefix, setting.for_reference(test_state), None)),
        "ref-test": (ref_state, setting.read(prefix, setting.for_test(ref_state), None)),
        "test-test": (test_state, setting.read(prefix, test_state, None)),
    }


# The run's own value of each factor (the control) and a test level.
CONTROLS = {"threads": 1, "flash_attn": False, "ubatch": 0, "cache_type": "fp16"}
LEVELS = {"threads": 2, "flash_attn": True, "ubatch": 7, "cache_type": "fp32"}


@pytest.mark.parametrize("factor", sorted(CONTROLS))
def test_each_control_reproduces_the_reference_through_a_restart(engines, prefix, factor):
    server, _ = engines
    pid = server.server.pid
    cells = _cells(server, factor, CONTROLS[factor], prefix)
    assert server.server.pid != pid  # the control went through a restart, as a test level does
    ref_state, ref_read = cells["ref"]
    for cell, (state, read) in cells.items():
        assert _same(state, ref_state), cell
        assert (read.tokens, read.stop) == (ref_read.tokens, ref_read.stop), cell
    assert "-ub 2048" in server.build_description() and "-t 1 -tb 1" in server.build_description()


@pytest.mark.parametrize("factor", sorted(LEVELS))
def test_each_test_level_runs_its_cells_and_matches_the_binding(engines, prefix, factor):
    """The server's cells at a level are the binding's at the same level on the same item, byte for byte
    (caches) and token for token (suffixes)."""
    server, binding = engines
    served = _cells(server, factor, LEVELS[factor], prefix)
    bound = _cells(binding, factor, LEVELS[factor], prefix)
    for cell in served:
        assert _same(served[cell][0], bound[cell][0]), cell
        assert served[cell][1].tokens == bound[cell][1].tokens and served[cell][1].stop == bound[cell][1].stop, cell
    if factor in ("flash_attn", "cache_type"):
        assert not _same(served["test-test"][0], served["ref"][0])  # the level changes the cache
    # Back at the reference after each level: the reference's own options again.
    assert "-fa off" in server.build_description() and "cache=fp16" in server.build_description()


def test_reconfigure_refuses_what_a_restart_cannot_change(engines):
    server, _ = engines
    from stagereplay.engines.base import ModelError

    with pytest.raises(ModelError, match="cannot change n_seq_max"):
        server.reconfigure(n_seq_max=2)


def test_a_cache_from_before_a_restart_is_stale_and_its_state_restores(engines, prefix):
    from stagereplay.engines.llamaserver.build import LlamaServerError

    server, _ = engines
    cache = server.empty_cache()
    server.feed(list(prefix.context), cache)
    state = server.snapshot(cache)
    server.use_threads(1)
    with pytest.raises(LlamaServerError, match="after its engine started another one"):
        server.snapshot(cache)
    assert _same(server.snapshot(server.to_cache(state)), state)


def test_the_spec_lists_the_restart_factors_prefix_reuse_and_load_only():
    from stagereplay.design.factors import FactorError, check_levels
    from stagereplay.engines.registry import SPECS, spec_named

    server = spec_named("llamaserver")

    check_levels({"threads": [2], "flash_attn": ["on"], "ubatch": [7], "cache_type": ["fp32"]}, server, 8, 20)
    check_levels({"prefix_reuse": ["prompt", "block:4", "restore:prompt"]}, server, 8, 20)
    check_levels({"batch": [2, "same:4"]}, server, 8, 20)
    check_levels({"kv_offset": [37, 64, "removed:100"], "kv_unified": ["off:2"]}, server, 8, 20)
    for factor, levels in (("chunk", [4]), ("rotation", ["off"])):
        with pytest.raises(
            FactorError,
            match=rf"^factors.{factor}: not supported on the llamaserver engine — run it on a checkpoint of the .*llamacpp",
        ):
            check_levels({factor: levels}, server, 8, 20, engines=SPECS.values())


FACTORS = {
    "ubatch": [7],
    "flash_attn": ["on"],
    "threads": [2],
    "cache_type": ["fp32"],
    "prefix_reuse": ["prompt", "restore:prompt"],
    "batch": [2],
    "kv_offset": [37],
    "kv_unified": ["off:2"],
}


@pytest.mark.slow
def test_a_factor_workflow_on_the_server_has_identical_controls(built, tmp_path):  # noqa: F811
    ledger, config = server_config(
        tmp_path,
        matched={"precision": "fp16"},
        fixed_prefix={"precisions": ["fp16"]},
        transplant={"enabled": False},
        factors=FACTORS,
        load_runs=2,  # the mechanics of runs under load; the project's own configs run 3
    )
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = pq.read_table(ledger / "tables" / "factors.parquet").to_pylist()
    assert rows and all(row["applicable"] and row["engine"] == "llamaserver" for row in rows)
    for factor, levels in FACTORS.items():
        for level in levels:
            name = str(level).replace(":", "-")
            cells = {row["cell"] for row in rows if (row["factor"], row["level"]) == (factor, name)}
            build_only = factor in ("ubatch", "prefix_reuse")
            assert cells == ({"test-ref"} if build_only else {"test-ref", "ref-test", "test-test"}), (factor, level)
    reuse = [row for row in rows if row["factor"] == "prefix_reuse" and row["level"] != "whole"]
    assert reuse and all(0 < row["reused_tokens"] for row in reuse)
    assert all("-ub 7 " in row["setting"] for row in rows if row["factor"] == "ubatch" and row["level"] == "7")
    loaded = [row for row in rows if row["factor"] == "batch" and row["level"] == "2" and row["cell"] != "ref-test"]
    assert loaded and all(
        row["setting"].startswith(
            "built and served in one block: 2 slots, one unified cache; 1 other request generating on slot 1"
        )
        for row in loaded
    )
    read_side = [row for row in rows if row["factor"] == "batch" and row["level"] == "2" and row["cell"] == "ref-test"]
    assert read_side and all(
        row["setting"].startswith("the reference cache; read in a block of its own: 2 slots") for row in read_side
    )
    behind = [row for row in rows if row["factor"] == "kv_offset" and row["level"] == "37"]
    assert behind and all("--no-cache-idle-slots" in row["setting"] for row in behind if row["cell"] != "ref-test")
    assert all(len(row["companions"]) == 1 for row in loaded)
    # Reads decode in the server's own loop: no absolute logits, so no first-read nor top-1-logit columns.
    assert all(row["first_logits_identical"] is None and row["first_logits_max_abs"] is None for row in rows)
    assert all(row["reference_top_logit_at_divergence"] is None for row in rows)
    # Concurrent load (batch, kv_unified, and their controls) runs each item's cells twice, numbered; every other
    # level pins its input and runs once, unnumbered.
    under_load = {(row["factor"], row["level"]) for row in rows if row["run"] is not None}
    assert under_load == {("batch", "1"), ("batch", "2"), ("kv_unified", "off-1"), ("kv_unified", "off-2")}
    for factor, level in under_load:
        runs = Counter(row["run"] for row in rows if (row["factor"], row["level"]) == (factor, level))
        assert sorted(runs) == [0, 1] and runs[0] == runs[1], (factor, level, runs)
    summary = json.loads((ledger / "summary.json").read_text())["E6"]
    loads = {(level["factor"], level["level"]): level for level in summary["under_load"]}
    assert set(loads) == under_load
    for level in loads.values():
        assert level["runs"] == 2 and sum(level["served_differs_in"].values()) == level["items"] > 0
        assert level["every_run"]["count"] + level["unstable"]["count"] + level["no_run"]["count"] == level["items"]
    assert loads["batch", "1"]["no_run"]["count"] == loads["batch", "1"]["items"]  # the control, in every run
    labels = [level["label"] for level in summary["levels"] if level["factor"] == "batch"]
    assert labels == ["batch 1 run 1/2", "batch 1 run 2/2", "batch 2 run 1/2", "batch 2 run 2/2"]
    controls = summary["controls"]
    assert controls["paths"] == controls["identical"] == len(FACTORS) and controls["without_control"] == []


@pytest.mark.parametrize(("level", "flash_attn"), [("q8_0-fp16", False), ("q8_0", True)])
def test_a_quantized_cache_type_level_is_the_bindings_through_the_shared_conversion(built, tmp_path, level, flash_attn):  # noqa: F811
    """Heads of 64 values (whole q8_0 blocks, rotated): the fp16 reference quantized offline for the level
    (ref-test) and the level's cache dequantized for the reference (test-ref), on both engines alike."""
    from stagereplay.engines.llamaserver.engine import load_llamaserver
    from stagereplay.inputs.checkpoints import build_random_qwen2
    from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

    folder = build_random_qwen2(tmp_path / "model", seed=3, layers=2, hidden=256)
    wide = write_qwen2_gguf(folder, tmp_path / "wide.gguf")
    runtime = Runtime("fp16", "cpu", 1, flash_attn=flash_attn)
    server, binding = load_llamaserver(wide, runtime), load_llamacpp(wide, runtime)
    try:
        live = build_live(server, PROMPT, StageBoundary(8), server.eos_ids, server.tokenizer)
        prefix = Prefix("item", tuple(live.prefix), len(PROMPT), False)
        served = _cells(server, "cache_type", level, prefix, runtime)
        bound = _cells(binding, "cache_type", level, prefix, runtime)
        for cell in served:
            assert _same(served[cell][0], bound[cell][0]), cell
            assert served[cell][1].tokens == bound[cell][1].tokens, cell
        assert "q8_0-h64" in served["test-test"][0].formats[0]
        assert server.formats == ("", "")  # back at the fp16 reference
    finally:
        server.close()
        binding.close()


@pytest.mark.parametrize("level", ["whole", "prompt", "block-4", "restore-prompt", "restore-block-4"])
def test_prefix_reuse_through_the_slot_is_the_bindings(engines, prefix, tmp_path, level):
    """The slot's own prompt cache (prompt / block:N: the server keeps the common prefix of the slot's tokens and
    the new prompt) and its save and restore: the same kept length, reused cells and built cache as the
    binding's ``llama_memory_seq_rm`` and ``llama_state_seq_save_file``/``load_file``; whole (the control) is
    the reference's bytes."""
    server, binding = engines
    builds, reads = [], []
    for engine in (server, binding):
        (tmp_path / engine.__class__.__name__).mkdir()
        scratch = ObjectStore(tmp_path / engine.__class__.__name__)
        setting = HeldPrefix(
            engine, BUDGET, engine.eos_ids, Level("prefix_reuse", level), scratch, "model", RUNTIME.precision
        )
        builds.append(setting.build(prefix))
        reads.append(setting.read(prefix, builds[-1].state, None))
    served, bound = builds
    assert (served.reused_tokens, served.reused_digest) == (bound.reused_tokens, bound.reused_digest)
    assert _same(served.state, bound.state) and reads[0].tokens == reads[1].tokens
    assert served.note.split(" from a ")[0] == bound.note.split(" from a ")[0]  # slot files: other token headers
    if level.endswith("prompt"):  # the prompt alone, or with the earlier request's generated token
        assert len(PROMPT) <= served.reused_tokens <= len(PROMPT) + 1 < len(prefix.context)
    if level == "whole":
        reference = Setting(server, BUDGET, server.eos_ids).build(prefix)
        assert _same(served.state, reference.state)
