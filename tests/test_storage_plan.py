"""The storage plan: projected bytes against real objects and real ledgers, and the plan command."""

from __future__ import annotations

import json

import pytest
import torch
from workflow_helpers import REPO, measured_storage, shared_prefix_items, stagereplay, write_config

from stagereplay.ledger import ObjectStore
from stagereplay.storage_plan import (
    ModelShapes,
    cache_object_bytes,
    job_memory_bytes,
    load_config,
    project,
    project_config,
    read_model_config,
    token_object_bytes,
)

TOLERANCE = 0.05


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
    tokens = store.put_tokens(range(41), {"role": "suffix", **meta})
    assert store.path_for(cache).stat().st_size == cache_object_bytes(shapes, precision, positions)
    assert store.path_for(tokens).stat().st_size == token_object_bytes(41)


def test_selected_and_none_store_fewer_caches_and_the_same_tokens():
    config = load_config(REPO / "config/paper.yaml")
    shapes = read_model_config("qwen2.5-14b-instruct")[0]
    projection = project(config, shapes, [120] * 200, prompt_measured=False)
    assert projection.cache_items == {"all": 200, "selected": 24 + 43, "none": 0}
    assert projection.cache_bytes["none"] == 0
    # 67 of 200 items of equal length keep all their caches.
    assert projection.cache_bytes["selected"] * 200 == projection.cache_bytes["all"] * 67
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


def _check_against(ledger, config_path):
    config = load_config(config_path)
    projection, shapes, _ = project_config(config)
    assert projection.prompt_measured  # the run's own prompt lengths
    checkpoint = next(iter(config["checkpoints"]))
    shared = shared_prefix_items(ledger, checkpoint, config["matched"]["precision"])
    # The one outcome the plan cannot know: which items' other-precision live runs reproduce the E1 prefix.
    exact = project(
        config,
        shapes,
        projection.prompt_tokens,
        True,
        model_in_ledger=True,
        shared_prefix_items=shared,
    )
    measured = measured_storage(ledger)
    assert abs(exact.cache_bytes["all"] / measured["caches"] - 1) < TOLERANCE, (exact.cache_bytes, measured)
    assert abs(exact.ledger_bytes("all") / measured["ledger"] - 1) < TOLERANCE, (exact.parts("all"), measured)
    # Without that outcome the plan is an upper bound.
    assert projection.cache_bytes["all"] >= measured["caches"]


@pytest.mark.slow
def test_projection_matches_the_test_configs_ledger(test_run):
    _, ledger, config = test_run
    _check_against(ledger, config)
