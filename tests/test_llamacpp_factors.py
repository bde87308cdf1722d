"""E6 and quantized caches through the real workflow on llama.cpp: a tiny random Qwen2 GGUF with 64-value heads
(so q8_0/q4_0 blocks are whole and llama.cpp rotates them), every llama.cpp factor end to end, then the audit.

Skips with the reason when llama_cpp is not importable; STAGEREPLAY_REQUIRE_LLAMACPP=1 (.ci/run) fails instead.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from test_llamacpp import _binding_problem
from workflow_helpers import bench_script, skip_unless_required, snakemake, write_config

from stagereplay.design.factors import FactorError, check_levels
from stagereplay.engines.registry import SPECS, spec_named
from stagereplay.inputs.checkpoints import read_model_record
from stagereplay.ledger.kvstate import KVState
from stagereplay.ledger.store import ObjectStore

pytestmark = pytest.mark.slow

factor_costs = bench_script("factor_costs")

TINY = "tiny-gguf"
WIDE = {"engine": "llamacpp", "random_qwen2": {"seed": 2, "layers": 2, "hidden": 256}}
FACTORS = {
    "cache_type": ["q8_0", "q4_0-fp16"],
    "flash_attn": ["off", "on"],  # on is the reference's own: a known answer
    "ubatch": [7, 4096],  # 4096 holds every prefix in one micro-batch, as the reference does: a known answer
    "threads": [2],
    "batch": [1, 3],  # 1: one sequence, as the reference: a known answer
    "prefix_reuse": ["prompt", "block:4", "restore:prompt"],
    "chunk": [5],  # decode calls of 5 tokens, on llama.cpp as on transformers
    "kv_offset": [37],  # the item's cells behind 37 cells of a filler sequence
    "kv_unified": ["off:2"],  # a batch of 2 in one KV stream per sequence
}


@pytest.fixture(scope="module", autouse=True)
def _binding():
    skip_unless_required(_binding_problem(), "STAGEREPLAY_REQUIRE_LLAMACPP")


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    """fp16 reference with flash attention, E2 and the bridge also at q8_0, every llama.cpp factor, then the audit."""
    workdir = tmp_path_factory.mktemp("llamacpp-factors")
    ledger = workdir / "ledger"
    config = write_config(
        workdir / "config.yaml",
        ledger_dir=str(ledger),
        checkpoints={TINY: WIDE},
        runtime={"flash_attn": True},
        matched={"precision": "fp16"},
        fixed_prefix={"precisions": ["fp16", "q8_0"]},
        transplant={"enabled": False},
        factors=FACTORS,
    )
    result = snakemake(workdir, config)
    assert result.returncode == 0, result.stderr[-4000:]
    audit = snakemake(workdir, config, "--config", "mode=audit")
    assert audit.returncode == 0, audit.stderr[-4000:]
    rows = pq.read_table(ledger / "tables" / "factors.parquet").to_pylist()
    return ledger, rows


def _level(rows, factor, level):
    return [row for row in rows if (row["factor"], row["level"]) == (factor, level)]


def test_every_llamacpp_factor_runs_its_cells(fp16_run):
    _, rows = fp16_run
    for factor, levels in FACTORS.items():
        for level in levels:
            name = str(level).replace(":", "-")
            cells = {row["cell"] for row in _level(rows, factor, name)}
            build_only = factor in ("ubatch", "prefix_reuse", "chunk")
            expected = {"test-ref"} if build_only else {"test-ref", "ref-test", "test-test"}
            assert cells == expected, (factor, level)
    assert all(row["applicable"] and row["engine"] == "llamacpp" for row in rows)


def test_known_answers_are_bit_identical(fp16_run):
    """A level that is the reference's own setting builds the reference's bytes and continues like it."""
    _, rows = fp16_run
    for factor, level in (("flash_attn", "on"), ("ubatch", "4096"), ("batch", "1")):
        cells = _level(rows, factor, level)
        assert cells and not any(row["cache_differs"] for row in cells if row["build"] == "test"), (factor, level)
        assert all(row["suffix_object"] == row["reference_suffix"] for row in cells), (factor, level)
    # Flash attention changes the computation: its caches differ from the reference's.
    assert all(row["cache_differs"] for row in _level(rows, "flash_attn", "off") if row["build"] == "test")
    # engine_build is the reference context the job ran; setting, the test level's own context.
    for row in _level(rows, "ubatch", "7"):
        assert "n_ubatch=2048" in row["engine_build"] and "n_ubatch=7;" in row["setting"]


def test_cache_type_cells_read_converted_caches(fp16_run):
    ledger, rows = fp16_run
    store = ObjectStore(ledger / "objects")
    for row in _level(rows, "cache_type", "q8_0"):
        if row["cell"] == "test-test":
            assert row["converted_digest"] is None  # read as built
        else:
            # (t, r) read the q8_0 build dequantized to fp16; (r, t) the fp16 reference quantized offline.
            assert row["converted_digest"]
        if row["cell"] == "ref-test":
            assert isinstance(row["converted_equals_test"], bool)
            differs = row["converted_first_differing_layer"]
            assert row["converted_equals_test"] == (differs is None)
        if row["cell"] == "test-ref":
            # Every test-built q8_0 cache differs in bytes from fp16's, by no more than its quantization.
            reference = KVState.from_named_tensors(store.get(row["reference_cache"]))
            largest = max(float(t.abs().max()) for t in reference.keys + reference.values)
            assert row["cache_differs"] and row["first_differing_layer"] == 0
            assert 0 < row["layer_max_abs"][0] <= largest / 127 + 1e-3
    k_q4 = next(row for row in _level(rows, "cache_type", "q4_0-fp16") if row["cell"] == "test-test")
    assert "K stored as q4_0-h64, V as values" in k_q4["setting"]
    assert "K stored as values, V as values" in k_q4["engine_build"]  # the fp16 reference


def test_prefix_reuse_uses_llamacpp_mechanisms(fp16_run):
    ledger, rows = fp16_run
    prompts = {
        row["item_id"]: row["prompt_length"]
        for row in pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    }
    for row in _level(rows, "prefix_reuse", "prompt"):
        # The earlier request (the prompt and the token it generated) is kept up to the common prefix.
        assert prompts[row["item_id"]] <= row["reused_tokens"] <= prompts[row["item_id"]] + 1
        assert "kept in the context" in row["setting"]
    for row in _level(rows, "prefix_reuse", "restore-prompt"):
        assert row["reused_tokens"] == prompts[row["item_id"]]
        assert "restored from a" in row["setting"] and "slot file" in row["setting"]
    for row in _level(rows, "prefix_reuse", "block-4"):
        assert row["reused_tokens"] % 4 in (0, 1) and row["reused_tokens"] > 0


def test_batch_cache_is_the_items_sequence_of_one_decode_call(fp16_run):
    """The batch-3 cache of an item equals sequence 0 of a unified 3-sequence decode the test runs itself
    through the engine, with its companions as sequences 1 and 2, fed without padding."""
    from stagereplay.engines.llamacpp.engine import LLAMACPP_N_CTX, EngineSettings, LlamaCppEngine
    from stagereplay.ledger.fingerprint import fingerprint_cache

    ledger, rows = fp16_run
    record = read_model_record(ledger / "models" / TINY / "model.json")
    store = ObjectStore(ledger / "objects")
    prefill = {
        row["item_id"]: row
        for row in pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
        if (row["construction"], row["precision"], row["replica"]) == ("prefill", "fp16", 0)
    }
    row = next(row for row in _level(rows, "batch", "3") if row["cell"] == "test-ref")
    contexts = [store.get_tokens(prefill[item]["prefix_object"])[:-1] for item in (row["item_id"], *row["companions"])]
    engine = LlamaCppEngine(record["gguf"], EngineSettings("fp16", 1, 1, LLAMACPP_N_CTX, flash_attn=True))
    try:
        with engine.batch_context(3):
            before = engine.fed_positions
            batch, logits = engine.batch_forward(None, contexts)
            assert engine.fed_positions - before == sum(len(context) for context in contexts)  # no padding
            assert logits.shape[0] == 3
            state = engine.batch_row(batch, 0)
    finally:
        engine.close()
    assert fingerprint_cache(state).digest == row["cache_digest"]
    assert "n_seq_max=1" in row["engine_build"]  # the row's environment is the reference's context


def test_q8_0_bridge_and_audit(fp16_run):
    ledger, _ = fp16_run
    summary = json.loads((ledger / "summary.json").read_text())
    bridge = summary["E3"]["checkpoints"][TINY]["precisions"]["q8_0"]["bit_exact"]
    assert bridge["n"] == 4 and bridge["count"] == 4  # llama.cpp's token-by-token caches, byte for byte
    e4 = json.loads((ledger / "audit" / "e4.json").read_text())
    assert e4["status"] == "reproduced"
    for part in ("factor_cache", "factor_suffix"):
        assert e4["artifacts"][part]["reproduced"] == e4["artifacts"][part]["n"] > 0
    card = (ledger / "results.md").read_text()
    assert "E6 cache_type q8_0 (reference fp16)" in card


def _wall_seconds_per_item(folder: Path, items: int) -> float:
    """A job folder's benchmark files read directly: the last row's wall seconds, summed over shards, per item."""
    total = 0.0
    for path in sorted(folder.glob("shard-*.tsv")):
        with open(path, newline="") as handle:
            total += float(list(csv.DictReader(handle, delimiter="\t"))[-1]["s"])
    return total / items


def test_the_cost_table_times_the_run_or_its_audit(fp16_run):
    # bench/factor_costs.py: each level's wall time from the run's benchmark files, or with --timed-by audit from
    # the audit's recomputation of the same jobs (for a run that shared its cores and an audit that did not).
    ledger, rows = fp16_run
    items = len({row["item_id"] for row in _level(rows, "threads", "2")})
    level = Path("factor", TINY, "fp16", "threads", "2")
    run = {row["level"]: row for row in factor_costs.factor_costs(ledger)}
    audit = {row["level"]: row for row in factor_costs.factor_costs(ledger, "audit")}
    assert run.keys() == audit.keys() and "threads 2" in run
    assert run["threads 2"]["wall"] == pytest.approx(_wall_seconds_per_item(ledger / "benchmarks" / level, items))
    assert audit["threads 2"]["wall"] == pytest.approx(
        _wall_seconds_per_item(ledger / "benchmarks" / "audit" / level, items)
    )


def test_quantized_run_every_experiment_and_rotation(tmp_path):
    """A q8_0 cache for E1 (replicas), E2, the bridge and E5 transplants; rotation off as E6's level."""
    ledger = tmp_path / "ledger"
    config = write_config(
        tmp_path / "config.yaml",
        ledger_dir=str(ledger),
        checkpoints={TINY: WIDE},
        runtime={"flash_attn": True},
        matched={"precision": "q8_0"},
        fixed_prefix={"precisions": ["q8_0"]},
        transplant={"cross_precision": None},
        factors={"rotation": ["off"]},
    )
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((ledger / "summary.json").read_text())
    for side in ("live", "prefill"):
        exact = summary["E1"]["checkpoints"][TINY]["replicas_exact"][side]
        assert exact["count"] == exact["n"] == 4
    transplants = pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
    assert transplants and all(row["precision"] == "q8_0" for row in transplants)
    stored = ObjectStore(ledger / "objects")
    live = next(
        r for r in pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist() if r["construction"] == "live"
    )
    state = KVState.from_named_tensors(stored.get(live["cache_object"]))
    assert state.formats == ("q8_0-h64", "q8_0-h64") and state.keys[0].dtype == torch.uint8
    # The test level off (the run also holds rotation's control, on through a new context).
    rows = [row for row in pq.read_table(ledger / "tables" / "factors.parquet").to_pylist() if row["level"] == "off"]
    rotation = [row for row in rows if row["applicable"]]
    assert {row["cell"] for row in rotation} == {"test-test"}
    # Its one-sided cells would re-quantize a cache: recorded, not applicable, with the reason.
    unbuilt = [row for row in rows if not row["applicable"]]
    assert {row["cell"] for row in unbuilt} == {"test-ref", "ref-test"} and len(unbuilt) == 2 * len(rotation)
    assert all("would re-quantize it" in row["reason"] for row in unbuilt)
    level = next(level for level in summary["E6"]["levels"] if (level["factor"], level["level"]) == ("rotation", "off"))
    assert level["cells"] == ["test-test"] and level["applicable"]
    assert all("rotation=disabled" in row["setting"] and "K stored as q8_0," in row["setting"] for row in rotation)
    assert all("K stored as q8_0-h64" in row["engine_build"] for row in rotation)  # the reference rotates
    control = next(c for c in summary["E6"]["controls"]["levels"] if c["factor"] == "rotation")
    assert control["level"] == "on" and control["identical"]  # rotation on, through a new context
    assert all(row["cache_differs"] for row in rotation)  # another basis, other bytes


@pytest.mark.parametrize(
    ("factors", "precision", "flash", "message"),
    [
        ({"rotation": ["off"]}, "fp16", True, "llama.cpp rotates only a quantized cache"),
        ({"cache_type": ["q8_0"]}, "fp16", False, "q8_0 V cache only with flash attention"),
        ({"cache_type": ["q5_1"]}, "fp16", True, "is not a llama.cpp cache type"),
        ({"flash_attn": ["off"]}, "q8_0", True, "needs flash attention, so off cannot run"),
        ({"flash_attn": ["maybe"]}, "fp16", True, "use on or off"),
        ({"ubatch": [0]}, "fp16", True, "not a positive integer"),
        (
            {"attention": ["eager"]},
            "fp16",
            True,
            "not supported on the llamacpp engine — run it on a checkpoint of the transformers engine",
        ),
        ({"kv_offset": ["-3"]}, "fp16", True, r"kv_offset: level '-3' is not a positive integer — give a cell count"),
        ({"kv_unified": ["on"]}, "fp16", True, r"kv_unified: unknown level 'on' — use off:B"),
        ({"kv_unified": ["off:9"]}, "fp16", True, r"off:9 needs 9 items, the run has 4 — use at most off:4"),
    ],
)
def test_llamacpp_factor_config_errors(factors, precision, flash, message):
    with pytest.raises(FactorError, match=message):
        check_levels(factors, spec_named("llamacpp"), 4, 12, None, "cpu", precision, flash, engines=SPECS.values())


def test_restore_on_transformers_is_refused():
    with pytest.raises(FactorError, match="restores llama.cpp's saved sequence file"):
        check_levels({"prefix_reuse": ["restore:prompt"]}, spec_named("transformers"), 4, 12)


def test_every_control_reproduces_the_reference(fp16_run):
    """Each factor's control (its reference setting through its machinery: a new context with the run's own
    settings, n_ubatch = n_ctx, the run's cache type through the conversion path) gives the reference's bytes."""
    ledger, rows = fp16_run
    controls = json.loads((ledger / "summary.json").read_text())["E6"]["controls"]
    assert controls["paths"] == controls["identical"] == len(FACTORS) and controls["without_control"] == []
    assert {(c["factor"], c["level"]) for c in controls["levels"]} >= {
        ("cache_type", "fp16"),
        ("ubatch", "whole"),
        ("chunk", "whole"),
        ("prefix_reuse", "whole"),
        ("threads", "1"),
        ("kv_offset", "removed-100"),
        ("kv_unified", "off-1"),
    }
    assert all("n_ubatch=2048;" in row["setting"] for row in _level(rows, "ubatch", "whole"))


def test_the_placement_rule_is_scored_in_the_ledger_and_verified(fp16_run, tmp_path):
    """summary.json's E6.placement_rule, per placement level: kv_offset 37 is predicted to change the built cache of
    exactly the items whose one-call prefill reaches a key tile (37 is no multiple of 64), observed where the factor
    table says the cache differs, and every disagreement named; the card shows it, and verify catches an edit."""
    import shutil
    import subprocess
    import sys

    ledger, rows = fp16_run
    rule = json.loads((ledger / "summary.json").read_text())["E6"]["placement_rule"]
    offset = next(level for level in rule["levels"] if (level["factor"], level["level"]) == ("kv_offset", "37"))
    contexts = {
        row["item_id"]: row["prefix_length"] - 1
        for row in pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
        if (row["construction"], row["replica"], row["precision"]) == ("prefill", 0, "fp16")
    }
    built = {
        row["item_id"]: row["cache_differs"] for row in _level(rows, "kv_offset", "37") if row["cell"] == "test-ref"
    }
    assert offset["n"] == len(built) > 0 and offset["not_predicted"] == 0
    assert offset["predicted_differ"] == sum(contexts[item] >= 64 for item in built)
    assert offset["observed_differ"] == sum(built.values())
    missed = {entry.split(" ")[0] for entry in offset["missed"]}
    assert {item for item in built if built[item] != (contexts[item] >= 64)} <= missed
    assert "Where the item's cells lie: the placement rules" in (ledger / "results.md").read_text()

    copy = tmp_path / "ledger"
    shutil.copytree(ledger, copy)
    summary = json.loads((copy / "summary.json").read_text())
    summary["E6"]["placement_rule"]["levels"][0]["observed_differ"] += 1
    (copy / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    verify = subprocess.run([sys.executable, "-m", "stagereplay", "verify", str(copy)], capture_output=True, text=True)
    assert verify.returncode == 1
    assert "E6.placement_rule.levels[0].observed_differ is" in verify.stderr, verify.stderr[-2000:]
