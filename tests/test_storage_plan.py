"""The storage plan: projected bytes against real objects and real ledgers, and the plan command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from workflow_helpers import REPO, check_storage_plan, stagereplay, write_config

from stagereplay.design.projection import cache_object_bytes, project, token_object_bytes
from stagereplay.design.schema import load_config
from stagereplay.design.shapes import ModelShapes, job_memory_bytes, read_model_config
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
    model_config.write_text(json.dumps(json.loads((REPO / "data/model_configs/qwen2.5-14b-instruct.json").read_text())))
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
    from stagereplay.engines.transformers_engine import ModelError, Runtime, load_model

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
        "import sys; from stagereplay.design.projection import project_config; from stagereplay.design.schema import load_config;"
        " project_config(load_config('config/paper.yaml'), 'qwen2.5-14b-instruct');"
        " print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
