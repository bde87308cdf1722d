"""The storage plan: projected bytes against real objects and real ledgers, and the plan command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from workflow_helpers import REPO, check_storage_plan, stagereplay, write_config

from stagereplay.design.schema import load_config
from stagereplay.design.storage_plan import cache_object_bytes, project, token_object_bytes
from stagereplay.engines.shapes import ModelShapes, PlanError, job_memory_bytes, read_model_config
from stagereplay.ledger.kvstate import KVState
from stagereplay.ledger.store import ObjectStore


def test_published_shapes_give_the_published_parameter_counts():
    # The model cards: SmolLM2-135M 134.5M (135M), Qwen2.5-7B 7.61B, Qwen2.5-14B 14.7B parameters.
    counts = {
        name: read_model_config(name)[0].parameters()
        for name in ("smollm2-135m-instruct", "qwen2.5-7b-instruct", "qwen2.5-14b-instruct")
    }
    assert round(counts["smollm2-135m-instruct"] / 1e6, 1) == 134.5
    assert round(counts["qwen2.5-7b-instruct"] / 1e9, 2) == 7.62
    assert round(counts["qwen2.5-14b-instruct"] / 1e9, 1) == 14.8


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_object_bytes_equal_the_files_the_store_writes(tmp_path, precision, dtype):
    shapes = ModelShapes(
        layers=3, kv_heads=2, head_dim=8, hidden=32, heads=4, intermediate=64, vocab=259, tied=True, qkv_bias=True
    )
    positions = 37
    tensors = {
        f"layer.{layer:03d}.{kind}": torch.randn(1, 2, positions, 8).to(dtype)
        for layer in range(3)
        for kind in ("k", "v")
    }
    store = ObjectStore(tmp_path)
    meta = {"model_fingerprint": "f" * 32, "precision": precision}
    cache = store.put(tensors, {"kind": "kv_cache", "positions": f"0:{positions}", **meta})
    tokens = store.put_tokens(range(41))
    assert store.path_for(cache).stat().st_size == cache_object_bytes(shapes, precision, positions)
    assert store.path_for(tokens).stat().st_size == token_object_bytes(41)


# ggml's blocks, written out here so the plan's sizes are checked against figures it did not compute.
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


@pytest.mark.parametrize(
    "model, precision, rotation, k_name, v_name",
    [
        # SmolLM2-135M (the embedded model): head dim 64, K and V rotated by 64.
        ("smollm2-135m-instruct", "q8_0", True, "layer.000.k.q8_0-h64", "layer.000.v.q8_0-h64"),
        ("smollm2-135m-instruct", "q4_0", True, "layer.000.k.q4_0-h64", "layer.000.v.q4_0-h64"),
        ("smollm2-135m-instruct", "q8_0-fp16", True, "layer.000.k.q8_0-h64", "layer.000.v"),
        # Head dim 128: K rotated by 128, V by 64; unrotated parts carry the bare block type.
        ("qwen2.5-7b-instruct", "q4_0", True, "layer.000.k.q4_0-h128", "layer.000.v.q4_0-h64"),
        ("qwen2.5-7b-instruct", "q8_0", False, "layer.000.k.q8_0", "layer.000.v.q8_0"),
    ],
)
def test_quantized_object_bytes_equal_the_files_the_store_writes(tmp_path, model, precision, rotation, k_name, v_name):
    shapes = read_model_config(model)[0]
    positions = 37

    def part(name):
        block_format = name.split(".", 3)[3] if name.count(".") == 3 else ""
        if block_format:  # raw ggml blocks
            width = shapes.head_dim // 32 * BLOCK_BYTES[block_format.split("-")[0]]
            return torch.randint(0, 256, (1, shapes.kv_heads, positions, width), dtype=torch.uint8)
        return torch.randn(1, shapes.kv_heads, positions, shapes.head_dim).to(torch.float16)

    tensors = {
        name.replace(".000.", f".{layer:03d}."): part(name)
        for layer in range(shapes.layers)
        for name in (k_name, v_name)
    }
    # The names are the ones a KVState of these parts stores under.
    assert list(KVState.from_named_tensors(tensors).named_tensors()) == list(tensors)
    store = ObjectStore(tmp_path)
    meta = {"model_fingerprint": "f" * 32, "precision": precision}
    cache = store.put(tensors, {"kind": "kv_cache", "positions": f"0:{positions}", **meta})
    assert store.path_for(cache).stat().st_size == cache_object_bytes(shapes, precision, positions, rotation=rotation)


def test_a_mixed_cache_type_lies_between_its_two_types():
    shapes = read_model_config("smollm2-135m-instruct")[0]  # 30 layers, 3 KV heads, head dim 64
    per_position = {p: shapes.kv_bytes_per_position(p) for p in ("q4_0", "q8_0", "q8_0-fp16", "fp16")}
    assert per_position == {
        "q4_0": 30 * 3 * 2 * 36,
        "q8_0": 30 * 3 * 2 * 68,
        "q8_0-fp16": 30 * 3 * (68 + 128),
        "fp16": 30 * 3 * 2 * 128,
    }
    q4_0, q8_0, mixed, fp16 = (cache_object_bytes(shapes, p, 400) for p in per_position)
    assert q4_0 < q8_0 < mixed < fp16


def test_a_name_no_cache_holds_is_one_plan_error():
    shapes = read_model_config("smollm2-135m-instruct")[0]
    with pytest.raises(PlanError, match="^precision 'q5_0' is not a llama.cpp cache type — use one of"):
        cache_object_bytes(shapes, "q5_0", 10)
    odd = ModelShapes(
        layers=2, kv_heads=2, head_dim=48, hidden=96, heads=2, intermediate=64, vocab=259, tied=True, qkv_bias=True
    )
    with pytest.raises(PlanError, match="^precision q8_0: a head of 48 values is not whole 32-value blocks"):
        cache_object_bytes(odd, "q8_0", 10)


def test_a_llamacpp_config_at_q8_0_plans_smaller_caches_than_at_fp16(tmp_path):
    shapes = read_model_config("smollm2-135m-instruct")[0]
    projections = {}
    for precision in ("fp16", "q8_0"):
        config = write_config(
            tmp_path / f"{precision}.yaml",
            base="config/llamacpp.yaml",
            runtime={"flash_attn": True},  # a quantized V cache needs it
            matched={"precision": precision},
            fixed_prefix={"precisions": [precision]},
            transplant={"cross_precision": None},
        )
        projections[precision] = project(load_config(config), shapes, [120] * 8, prompt_measured=False)
    fp16, q8_0 = projections["fp16"], projections["q8_0"]
    assert q8_0.caches_per_item == fp16.caches_per_item
    assert 0 < q8_0.cache_bytes["all"] < fp16.cache_bytes["all"]
    assert q8_0.cache_bytes["selected"] < fp16.cache_bytes["selected"]
    # Only the caches differ: tokens, tables and documents do not depend on the cache type.
    assert fp16.ledger_bytes("none") == q8_0.ledger_bytes("none")
    # A job's memory changes by its caches only (the weights are the GGUF's, whatever the cache type).
    positions = 400
    saved = 4 * (shapes.kv_bytes_per_position("fp16") - shapes.kv_bytes_per_position("q8_0")) * positions
    assert job_memory_bytes(shapes, "fp16", positions) - job_memory_bytes(shapes, "q8_0", positions) == saved
    # The plan command prints the quantized figure: 30 layers x 3 KV heads x (K + V) x 68 bytes.
    result = stagereplay("plan", "--configfile", tmp_path / "q8_0.yaml")
    assert result.returncode == 0, result.stderr
    assert "KV per position: q8_0 12.2 kB" in result.stdout


def test_selected_and_none_store_fewer_caches_and_the_same_tokens():
    config = load_config(REPO / "config/paper.yaml")
    shapes = read_model_config("qwen2.5-14b-instruct")[0]
    projection = project(config, shapes, [120] * 200, prompt_measured=False)
    assert projection.cache_items == {"all": 200, "selected": 24 + 43, "none": 0}
    assert projection.cache_bytes["none"] == 0
    # Of 200 items of equal length, the 24 selected keep the caches their transplants read (E1 live and
    # prefill in bf16, the fp32 incremental and prefill recipients), the 43 outcome-blind ones E1's pair.
    positions = 120 + config["stage"]["max_new_tokens"] - 1
    bf16, fp32 = (cache_object_bytes(shapes, precision, positions) for precision in ("bf16", "fp32"))
    assert projection.cache_bytes["selected"] == 24 * (2 * bf16 + 2 * fp32) + 43 * 2 * bf16
    assert projection.ledger_bytes("all") - projection.ledger_bytes("none") == projection.cache_bytes["all"]


def test_a_gguf_checkpoint_not_yet_converted_needs_the_model_config(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    config = write_config(
        tmp_path / "config.yaml", ledger_dir=str(tmp_path / "ledger"), checkpoints={"mine": {"gguf": str(gguf)}}
    )
    result = stagereplay("plan", "--configfile", config)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "stagereplay: error: checkpoint 'mine' is a GGUF not converted yet: its shapes are unknown — give --model-config path/to/config.json"
    ]
    named = stagereplay("plan", "--configfile", config, "--model-config", "qwen2.5-7b-instruct")
    assert named.returncode == 0, named.stderr
    assert "28 layers, 4 KV heads, head dim 128" in named.stdout


def test_the_plan_command_prints_every_policy_for_a_model_config_file(tmp_path):
    model_config = tmp_path / "config.json"
    model_config.write_text(
        json.dumps(json.loads((REPO / "src/stagereplay/resources/model_configs/qwen2.5-14b-instruct.json").read_text()))
    )
    result = stagereplay("plan", "--configfile", REPO / "config/paper.yaml", "--model-config", model_config)
    assert result.returncode == 0, result.stderr
    rows = [
        line for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| store_caches")
    ]
    assert [row.split("|")[1].strip() for row in rows] == ["all", "selected", "none"]
    assert "KV per position: bf16 196.6 kB, fp32 393.2 kB" in result.stdout


def test_device_memory_of_a_job_grows_with_precision_and_positions():
    shapes = read_model_config("qwen2.5-14b-instruct")[0]
    bf16, fp32 = job_memory_bytes(shapes, "bf16", 1200), job_memory_bytes(shapes, "fp32", 1200)
    assert fp32 - bf16 > shapes.parameters() * 2  # the weights alone double
    assert job_memory_bytes(shapes, "bf16", 2400) > bf16


@pytest.mark.slow
def test_projection_matches_the_test_configs_ledger(test_run):
    _, ledger, config = test_run
    check_storage_plan(ledger, config)


def test_a_model_that_cannot_fit_stops_at_load_with_one_line(tiny_qwen2_folder):
    from stagereplay.engines.transformers.engine import ModelError, Runtime, load_model

    shapes = ModelShapes.from_config(json.loads((tiny_qwen2_folder / "config.json").read_text()))
    needed = job_memory_bytes(shapes, "fp32", 400)
    runtime = Runtime(precision="fp32", device="cpu", threads=1, max_positions=400, device_memory_gb=needed / 2e9)
    with pytest.raises(ModelError) as refused:
        load_model(tiny_qwen2_folder, runtime)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"the model needs {needed / 1e9:.2f} GB on cpu at fp32 (400 positions)")
    assert f"but {needed / 2e9:.2f} GB are available (runtime.device_memory_gb)" in message
    # With the memory it needs, the same model loads.
    fits = Runtime(precision="fp32", device="cpu", threads=1, max_positions=400, device_memory_gb=needed * 1.01 / 1e9)
    assert load_model(tiny_qwen2_folder, fits).model.config.num_hidden_layers == shapes.layers


def test_the_plan_imports_no_torch():
    # It runs when snakemake parses the workflow and before any model is at hand.
    code = (
        "import sys; from stagereplay.design.storage_plan import project_run; from stagereplay.design.schema import load_config;"
        " from stagereplay.design.run_plan import plan_run;"
        " project_run(plan_run(load_config('config/paper.yaml'), '.'), 'qwen2.5-14b-instruct');"
        " print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
