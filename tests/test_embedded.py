"""One short run of the real workflow on the embedded default model (SmolLM2-135M-Instruct), 2 items."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from safetensors import safe_open
from workflow_helpers import check_storage_plan, snakemake, write_config

pytestmark = pytest.mark.slow


def test_embedded_default_runs_end_to_end(tmp_path):
    ledger = tmp_path / "ledger"
    config = write_config(
        tmp_path / "config.yaml",
        base="config/config.yaml",
        ledger_dir=str(ledger),
        items={"limit": 2},
        stage={"max_new_tokens": 12, "suffix_tokens": 12},
        shard_size=2,
        transplant={"outcome_blind": {"checkpoint": None, "sample": 2, "seed": 0}},
    )
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]

    record = json.loads((ledger / "models" / "smollm2-135m" / "model.json").read_text())
    assert record["source"] == "embedded"
    folder = ledger / "models" / "smollm2-135m" / "converted"
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.gguf"))  # safetensors only

    summary = json.loads((ledger / "summary.json").read_text())
    e1 = summary["E1"]["checkpoints"]["smollm2-135m"]
    assert e1["items"] == 2
    for side in ("live", "prefill"):
        assert (e1["replicas_exact"][side]["count"], e1["replicas_exact"][side]["n"]) == (2, 2)
    for precision in ("bf16", "fp32"):
        bridge = summary["E3"]["checkpoints"]["smollm2-135m"]["precisions"][precision]["bit_exact"]
        assert (bridge["count"], bridge["n"]) == (2, 2)
    transplants = pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
    assert {row["selection"] for row in transplants} >= {"outcome_blind"}

    rows = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    assert {row["model_fingerprint"] for row in rows} == {record["fingerprint"]}
    live = next(row for row in rows if row["construction"] == "live")
    assert live["prefix_length"] - live["prompt_length"] == 12 and live["boundary_reason"] == "budget"
    # SmolLM2 has 30 layers; the saved cache carries them all, with its provenance.
    cache_path = ledger / "objects" / live["cache_object"][:2] / f"{live['cache_object']}.safetensors"
    with safe_open(str(cache_path), framework="pt") as handle:
        assert len(handle.keys()) == 60
        assert handle.metadata()["model_fingerprint"] == record["fingerprint"]
        assert handle.metadata()["precision"] == "bf16"
        assert handle.get_tensor("layer.000.k").shape[-2] == live["cache_positions"]
    # The storage plan of this config matches the ledger it produced.
    check_storage_plan(ledger, config)
