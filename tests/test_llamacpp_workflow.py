"""The real workflow through the llama.cpp engine: a tiny random GGUF (every experiment, then the audit), and one
short run on the embedded GGUF as shipped.

Skips with the reason when llama_cpp is not importable; STAGEREPLAY_REQUIRE_LLAMACPP=1 (.ci/run) fails instead.
"""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
from safetensors import safe_open
from test_llamacpp import _binding_problem
from workflow_helpers import skip_unless_required, snakemake, write_config

pytestmark = pytest.mark.slow

TINY = "tiny-gguf"


@pytest.fixture(scope="module", autouse=True)
def _binding():
    skip_unless_required(_binding_problem(), "STAGEREPLAY_REQUIRE_LLAMACPP")


def _cache(ledger, object_id):
    return ledger / "objects" / object_id[:2] / f"{object_id}.safetensors"


def test_tiny_gguf_runs_every_experiment_and_the_audit_reproduces_it(tmp_path):
    ledger = tmp_path / "ledger"
    config = write_config(
        tmp_path / "config.yaml",
        ledger_dir=str(ledger),
        checkpoints={TINY: {"engine": "llamacpp", "random_qwen2": {"seed": 2, "layers": 4, "hidden": 64}}},
        matched={"precision": "fp16"},
        fixed_prefix={"precisions": ["fp16", "fp32"]},
        transplant={"cross_precision": "fp32"},
    )
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads((ledger / "models" / TINY / "model.json").read_text())
    assert record["engine"] == "llamacpp" and record["gguf"].endswith("random.gguf")
    assert not (ledger / "models" / TINY / "converted").exists()

    rows = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    assert {row["engine"] for row in rows} == {"llamacpp"}
    assert {row["engine_version"] for row in rows} == {"llama-cpp-python 0.3.36"}
    assert all("flash_attn=off" in row["engine_build"] for row in rows)
    live = next(row for row in rows if row["construction"] == "live" and row["precision"] == "fp16")
    with safe_open(str(_cache(ledger, live["cache_object"])), framework="pt") as handle:
        assert len(handle.keys()) == 8  # 4 layers, K and V
        assert str(handle.get_tensor("layer.000.k").dtype) == "torch.float16"  # the cache type is the precision

    summary = json.loads((ledger / "summary.json").read_text())
    e1 = summary["E1"]["checkpoints"][TINY]
    # Replicas are separate jobs, hence separate processes: each reproduced its side bit for bit.
    for side in ("live", "prefill"):
        assert (e1["replicas_exact"][side]["count"], e1["replicas_exact"][side]["n"]) == (4, 4)
    for precision in ("fp16", "fp32"):
        bridge = summary["E3"]["checkpoints"][TINY]["precisions"][precision]["bit_exact"]
        assert (bridge["count"], bridge["n"]) == (4, 4)  # llama.cpp's token-by-token caches are bit-exact
    assert {entry["engine"] for entry in summary["environment"]} == {"llamacpp"}
    card = (ledger / "results.md").read_text()
    assert "llama-cpp-python 0.3.36" in card

    audit = snakemake(tmp_path, config, "--config", "mode=audit")
    assert audit.returncode == 0, audit.stderr[-4000:]
    e4 = json.loads((ledger / "audit" / "e4.json").read_text())
    assert e4["status"] == "reproduced"
    assert e4["trajectories"]["reproduced"] == e4["trajectories"]["n"] > 0
    assert e4["artifacts"]["cache"]["reproduced"] == e4["artifacts"]["cache"]["n"] > 0
    # What the engine really ran, in its own words (not the transformers attention setting of the config).
    ran = e4["audit_runtime"][TINY]
    assert (ran["engine"], ran["attn_implementation"]) == ("llamacpp", "llamacpp:flash_attn=off")
    # `snakemake audit` ends with the card showing E4: no third, plain run needed.
    shown = re.search(
        r"\| E4 audit \| trajectories reproduced from the saved ledger \| (\d+)/(\d+) ",
        (ledger / "results.md").read_text(),
    )
    assert shown and shown.group(1) == shown.group(2) == str(e4["trajectories"]["n"])


def test_embedded_gguf_runs_as_shipped(tmp_path):
    ledger = tmp_path / "ledger"
    config = write_config(
        tmp_path / "config.yaml",
        base="config/llamacpp.yaml",
        ledger_dir=str(ledger),
        items={"limit": 2},
        stage={"max_new_tokens": 12, "suffix_tokens": 12},
        shard_size=2,
        transplant={"outcome_blind": {"checkpoint": None, "sample": 2, "seed": 0}},
    )
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    name = "smollm2-135m-llamacpp"
    record = json.loads((ledger / "models" / name / "model.json").read_text())
    assert record["engine"] == "llamacpp" and record["gguf"].endswith("embedded.gguf")
    assert not (ledger / "models" / name / "converted").exists()  # Q4_1 as shipped, never dequantized
    summary = json.loads((ledger / "summary.json").read_text())
    for side in ("live", "prefill"):
        exact = summary["E1"]["checkpoints"][name]["replicas_exact"][side]
        assert (exact["count"], exact["n"]) == (2, 2)
    rows = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    live = next(row for row in rows if row["construction"] == "live")
    with safe_open(str(_cache(ledger, live["cache_object"])), framework="pt") as handle:
        assert len(handle.keys()) == 60  # SmolLM2's 30 layers, K and V
        assert handle.get_tensor("layer.000.k").shape == (1, 3, live["cache_positions"], 64)
