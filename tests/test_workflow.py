"""The whole E1 workflow through real snakemake on config/test.yaml (tiny random Qwen2, 4 items)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from workflow_helpers import job_counts, ledger_snapshot, snakemake, write_config

from stagereplay.ledger import COMPARISON_SCHEMA, TRAJECTORY_SCHEMA, ObjectStore

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def completed(test_run):
    return test_run


def test_summary_holds_e1_figures(completed):
    _, ledger, _ = completed
    e1 = json.loads((ledger / "summary.json").read_text())["E1"]
    assert e1["items"] == 4
    assert e1["replicas_exact"] == {"live": {"exact": 4, "n": 4}, "prefill": {"exact": 4, "n": 4}}
    for key in ("suffixes_differ", "labels_differ", "caches_differ"):
        assert e1[key]["n"] == 4 and 0 <= e1[key]["count"] <= 4
    low, high = e1["paired_difference"]["ci95"]
    assert low <= e1["paired_difference"]["live_minus_prefill"] <= high
    assert e1["boundary_reasons"] and sum(e1["boundary_reasons"].values()) == 4


def test_ledger_tables_name_only_objects_that_exist(completed):
    _, ledger, _ = completed
    trajectories = pq.read_table(ledger / "tables" / "trajectories.parquet")
    comparisons = pq.read_table(ledger / "tables" / "comparisons.parquet")
    assert trajectories.schema.equals(TRAJECTORY_SCHEMA) and comparisons.schema.equals(COMPARISON_SCHEMA)
    # 4 items x 9 trajectories: E1 live and prefill x 2 replicas; E2 incremental (bf16, fp32) and
    # prefill (fp32; bf16 is E1's); E3 live fp32 and incremental over its prefix.
    assert trajectories.num_rows == 36
    # E1: live/prefill + 2 replica pairs; E2: one pair per precision; E3: one pair per precision.
    experiments = [row["experiment"] for row in comparisons.to_pylist()]
    assert (experiments.count("E1"), experiments.count("E2"), experiments.count("E3")) == (12, 8, 8)
    store = ObjectStore(ledger / "objects")
    for row in trajectories.to_pylist():
        for key in ("prefix_object", "cache_object", "suffix_object"):
            assert store.path_for(row[key]).is_file(), (row["item_id"], key)
        assert row["cache_positions"] == row["prefix_length"] - 1
        assert len(row["layer_k"]) == len(row["layer_v"]) == 2
        assert row["threads"] == 1 and row["attn_implementation"] == "sdpa"
    # Replicas are bit-exact, so each live cache is stored once for its two replicas.
    caches = {row["cache_object"] for row in trajectories.to_pylist()}
    assert len(list((ledger / "objects").rglob("*.safetensors"))) >= len(caches)
    assert len(caches) <= 28


def test_e5_transplants_are_recorded(completed):
    _, ledger, _ = completed
    selection = json.loads((ledger / "transplants" / "selection.json").read_text())
    assert len(selection["outcome_blind"]["item_ids"]) == 2
    rows = pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
    blind = [row for row in rows if row["selection"] == "outcome_blind"]
    # 2 sampled items x both directions, all layers only.
    assert len(blind) == 4 and {row["subset"] for row in blind} == {"layers=0-1 kv=kv positions=all"}
    for row in blind:
        assert row["outcome"] in ("follows_donor", "follows_recipient", "neither")
        assert len(row["layer_k"]) == 2 and len(row["cache_digest"]) == 32
        if not row["divergent"]:  # donor and recipient agree, so the all-layer transplant follows both
            assert row["outcome"] == "follows_donor"
    selected = [row for row in rows if row["selection"] == "selected"]
    assert {row["item_id"] for row in selected} == set(selection["selected"]["item_ids"])
    e5 = json.loads((ledger / "summary.json").read_text())["E5"]
    assert "primary checkpoint" in e5["outcome_blind_checkpoint"]


def test_e2_and_e3_figures(completed):
    _, ledger, _ = completed
    summary = json.loads((ledger / "summary.json").read_text())
    for precision in ("bf16", "fp32"):
        arm = summary["E2"]["precisions"][precision]["incremental_vs_prefill"]
        assert arm["decoded_disagreements"]["n"] == 4
        low, high = arm["decoded_disagreements"]["wilson95"]
        assert 0 <= low <= arm["decoded_disagreements"]["rate"] <= high <= 1
        # The bridge: token-by-token incremental reproduces the retained live cache bit for bit.
        assert summary["E3"]["precisions"][precision]["bit_exact"] == {"exact": 4, "n": 4}
        assert summary["E3"]["precisions"][precision]["not_exact"] == []
    rows = pq.read_table(ledger / "tables" / "comparisons.parquet").to_pylist()
    e1 = [row for row in rows if row["experiment"] == "E1" and row["relation"] == "construction"]
    assert all(len(row["k_max_abs"]) == len(row["v_fraction_differ"]) == 2 for row in e1)
    for row in e1:
        assert row["cache_exact"] == (max(row["k_max_abs"] + row["v_max_abs"]) == 0)
        if row["suffix_differs"]:
            assert row["a_token_at_divergence"] != row["b_token_at_divergence"]


def test_adding_a_precision_schedules_only_its_jobs(completed, tmp_path):
    workdir, ledger, _ = completed
    config = write_config(tmp_path / "fp16.yaml", ledger_dir=str(ledger),
                          fixed_prefix={"precisions": ["bf16", "fp32", "fp16"]})
    result = snakemake(workdir, config, "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    # fp16 only: E3 live; E2 incremental and prefill; E3 incremental over the fp16 live prefix.
    assert job_counts(result) == {"live": 1, "rebuild": 3, "gather": 1, "compare": 1, "summary": 1, "report": 1, "all": 1}
    outputs = [line.split(":", 1)[1].strip() for line in result.stdout.splitlines() if line.strip().startswith("output:")]
    run_tables = [path for path in outputs if "/runs/" in path]
    assert len(run_tables) == 4 and all("/fp16/" in path for path in run_tables)


def test_removing_a_precision_recomputes_only_the_gathering(completed, tmp_path):
    workdir, ledger, _ = completed
    before = set(ledger_snapshot(ledger))
    config = write_config(tmp_path / "bf16.yaml", ledger_dir=str(ledger), fixed_prefix={"precisions": ["bf16"]})
    result = snakemake(workdir, config, "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    assert job_counts(result) == {"gather": 1, "compare": 1, "summary": 1, "report": 1, "all": 1}
    assert set(ledger_snapshot(ledger)) == before  # nothing deleted


def test_a_second_run_schedules_nothing(completed):
    workdir, _, config = completed
    result = snakemake(workdir, config, "--dry-run")
    assert result.returncode == 0
    assert "Nothing to be done" in result.stdout + result.stderr


def test_ledger_dir_override_writes_elsewhere(completed, tmp_path):
    workdir, ledger, config = completed
    other = tmp_path / "other-ledger"
    result = snakemake(workdir, config, "--dry-run", "--config", f"ledger_dir={other}")
    assert result.returncode == 0
    assert str(other / "summary.json") in result.stdout
