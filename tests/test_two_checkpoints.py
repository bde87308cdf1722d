"""Two checkpoints of different depths through snakemake, the audit and the report: never pooled.

The outcome-blind replication runs on a second checkpoint, which has only the E1 live and
prefill sides of replica 0. Every comparison, figure and plot stays within one checkpoint.
The same run covers settings the test config leaves out: one replica per side (nothing
to claim determinism from) and a chunked:N construction in E2.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from workflow_helpers import snakemake, stagereplay, write_config

pytestmark = pytest.mark.slow

CHECKPOINTS = {
    "tiny-deep": {"random_qwen2": {"seed": 2, "layers": 4, "hidden": 64, "near_ties": True}},
    "tiny-shallow": {"random_qwen2": {"seed": 1, "layers": 2, "hidden": 64, "near_ties": True}},
}


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("two")
    ledger = workdir / "ledger"
    config = write_config(
        workdir / "config.yaml",
        ledger_dir=str(ledger),
        checkpoints=CHECKPOINTS,
        transplant={"outcome_blind": {"checkpoint": "tiny-shallow", "sample": 2, "seed": 0}},
        matched={"precision": "bf16", "replicas": 1},
        fixed_prefix={"precisions": ["bf16", "fp32"], "constructions": ["incremental", "prefill", "chunked:5"]},
    )
    result = snakemake(workdir, config)
    assert result.returncode == 0, result.stderr[-4000:]
    audit = snakemake(workdir, config, "--config", "mode=audit")
    assert audit.returncode == 0, audit.stderr[-4000:]
    report = snakemake(workdir, config)  # redraws the card with E4
    assert report.returncode == 0, report.stderr[-4000:]
    return ledger


def test_comparisons_stay_within_one_checkpoint(two_checkpoints):
    ledger = two_checkpoints
    rows = pq.read_table(ledger / "tables" / "comparisons.parquet").to_pylist()
    depth = {"tiny-deep": 4, "tiny-shallow": 2}
    for row in rows:
        assert len(row["k_max_abs"]) == len(row["v_fraction_differ"]) == depth[row["checkpoint"]]
    shallow = [row for row in rows if row["checkpoint"] == "tiny-shallow"]
    # The replication checkpoint has only E1 live vs prefill of replica 0: one row per item.
    assert [(row["experiment"], row["relation"], row["a"], row["b"]) for row in shallow] == [
        ("E1", "construction", "live/bf16/rep0", "prefill/bf16/rep0<-bf16")
    ] * 4
    deep = [row["experiment"] for row in rows if row["checkpoint"] == "tiny-deep"]
    # One replica: no replica pairs. E2: prefill and chunked:5 against incremental, per precision.
    assert (deep.count("E1"), deep.count("E2"), deep.count("E3")) == (4, 16, 8)


def test_summary_reports_each_checkpoint_apart(two_checkpoints):
    ledger = two_checkpoints
    summary = json.loads((ledger / "summary.json").read_text())
    assert summary["checkpoints"] == ["tiny-deep", "tiny-shallow"]
    rows = pq.read_table(ledger / "tables" / "comparisons.parquet").to_pylist()
    for name in ("tiny-deep", "tiny-shallow"):
        e1 = summary["E1"]["checkpoints"][name]
        own = [
            row
            for row in rows
            if row["checkpoint"] == name and row["experiment"] == "E1" and row["relation"] == "construction"
        ]
        assert e1["items"] == len(own) == 4
        assert e1["suffixes_differ"]["count"] == sum(row["suffix_differs"] for row in own)
    for name in ("tiny-deep", "tiny-shallow"):
        assert summary["E1"]["checkpoints"][name]["replicas_exact"]["live"]["measured"] is False
    arms = summary["E2"]["checkpoints"]["tiny-deep"]["precisions"]["fp32"]
    assert set(arms) == {"incremental_vs_prefill", "incremental_vs_chunked:5"}
    chunked = [row for row in rows if row["experiment"] == "E2" and row["b"] == "chunked:5/fp32/rep0<-bf16"]
    assert arms["incremental_vs_chunked:5"]["caches_differ"]["count"] == sum(not row["cache_exact"] for row in chunked)
    assert set(summary["E2"]["checkpoints"]) == set(summary["E3"]["checkpoints"]) == {"tiny-deep"}
    e5 = summary["E5"]
    assert e5["outcome_blind_checkpoint"] == "outcome-blind replication on checkpoint 'tiny-shallow'"
    transplants = pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
    blind = [row for row in transplants if row["selection"] == "outcome_blind"]
    assert blind and {row["checkpoint"] for row in blind} == {"tiny-shallow"}
    assert {row["subset"] for row in blind} == {"layers=0-1 kv=kv positions=all"}
    divergent = [row for row in blind if row["divergent"]]
    # All layers of the shallow model count as all layers (not judged against the deeper model).
    counted = e5["all_layers"].get("outcome_blind/tiny-shallow", {"follows_donor": {"n": 0}})["follows_donor"]["n"]
    assert counted == len(divergent)


def test_card_audit_and_verify_cover_both_checkpoints(two_checkpoints):
    ledger = two_checkpoints
    card = (ledger / "results.md").read_text()
    # Redrawn by the plain run after the audit (e4.json's digest is a parameter of the report rule).
    assert "E4 audit: not run" not in card and "| E4 audit | trajectories reproduced from the saved ledger |" in card
    assert "| E1 matched (bf16, tiny-deep) | suffixes that differ, live vs prefill |" in card
    assert "| E1 matched (bf16, tiny-shallow) | suffixes that differ, live vs prefill |" in card
    for name in ("tiny-deep", "tiny-shallow"):
        assert f"| E1 matched (bf16, {name}) | exact replicas, live | 0/0 | not measured |" in card
    assert "Every replica reproduced its side exactly" not in card
    assert "E2 fixed_prefix (bf16, tiny-deep)" in card and "tiny-shallow) | decoded" not in card
    assert "E4" not in json.loads((ledger / "summary.json").read_text())  # the audit writes its own file
    e4 = json.loads((ledger / "audit" / "e4.json").read_text())
    assert e4["status"] == "reproduced", e4["mismatches"][:3]
    audit = pq.read_table(ledger / "tables" / "audit.parquet").to_pylist()
    assert {row["checkpoint"] for row in audit if row["kind"] == "trajectory"} == {"tiny-deep", "tiny-shallow"}
    assert all(row["reproduced"] for row in audit)
    result = stagereplay("verify", ledger)
    assert result.returncode == 0, result.stderr
