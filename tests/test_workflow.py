"""The whole workflow through real snakemake on config/test.yaml (tiny near-tie Qwen2, 4 items)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from workflow_helpers import job_counts, ledger_snapshot, snakemake, write_config

from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import COMPARISON_SCHEMA, TRAJECTORY_SCHEMA

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def completed(test_run):
    return test_run


def _e1_rows(ledger, relation="construction"):
    rows = pq.read_table(ledger / "tables" / "comparisons.parquet").to_pylist()
    return [row for row in rows if row["experiment"] == "E1" and row["relation"] == relation]


def test_summary_holds_e1_figures(completed):
    _, ledger, _ = completed
    summary = json.loads((ledger / "summary.json").read_text())
    assert summary["checkpoints"] == ["tiny-qwen2"]
    e1 = summary["E1"]["checkpoints"]["tiny-qwen2"]
    rows = _e1_rows(ledger)
    assert e1["items"] == len(rows) == 4 and e1["precision"] == "bf16"
    # Counted again here from the comparison rows, not trusted from the summary.
    assert e1["suffixes_differ"]["count"] == sum(row["suffix_differs"] for row in rows)
    assert e1["caches_differ"]["count"] == sum(not row["cache_exact"] for row in rows)
    assert e1["labels_differ"]["count"] == sum(row["a_correct"] != row["b_correct"] for row in rows)
    # The near-tie test model diverges in bf16 on some items and not on others.
    assert 0 < e1["suffixes_differ"]["count"] < 4
    replicas = _e1_rows(ledger, "replica")
    assert len(replicas) == 8 and all(row["trajectory_exact"] for row in replicas)
    for side in ("live", "prefill"):
        assert (e1["replicas_exact"][side]["count"], e1["replicas_exact"][side]["n"]) == (4, 4)
        assert e1["replicas_exact"][side]["measured"] is True
    live = [row["a_correct"] for row in sorted(rows, key=lambda row: row["item_id"])]
    prefill = [row["b_correct"] for row in sorted(rows, key=lambda row: row["item_id"])]
    assert e1["paired_difference"]["live_minus_prefill"] == pytest.approx((sum(live) - sum(prefill)) / 4)
    assert sum(e1["boundary_reasons"].values()) == 4


def test_every_trajectory_has_a_readout_label_and_the_summary_counts_both_labelings(completed):
    _, ledger, _ = completed
    answers = {
        item["id"]: item["answer"] for item in map(json.loads, (ledger / "items.jsonl").read_text().splitlines())
    }
    trajectories = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    # The readout labels every trajectory, parsable answer or not (the random test model writes none).
    assert all(row["readout_answer"] in "ABCD" and len(row["readout_answer"]) == 1 for row in trajectories)
    assert all(row["readout_correct"] == (row["readout_answer"] == answers[row["item_id"]]) for row in trajectories)
    assert all(row["readout_margin"] >= 0 for row in trajectories)
    # Replicas run in their own processes: the readout is deterministic, so theirs is the same.
    by_side = {}
    for row in trajectories:
        key = (row["item_id"], row["construction"], row["precision"], row["prefix_precision"])
        by_side.setdefault(key, set()).add((row["readout_answer"], row["readout_margin"]))
    assert all(len(readouts) == 1 for readouts in by_side.values())
    e1 = json.loads((ledger / "summary.json").read_text())["E1"]["checkpoints"]["tiny-qwen2"]
    rows = _e1_rows(ledger)
    assert set(e1["labelings"]) == {"parsed", "readout"}
    assert e1["labelings"]["parsed"]["accuracy"] == e1["accuracy"]
    for labeling, (a, b) in {
        "parsed": ("a_correct", "b_correct"),
        "readout": ("a_readout_correct", "b_readout_correct"),
    }.items():
        figures = e1["labelings"][labeling]
        assert figures["accuracy"]["live"]["count"] == sum(row[a] for row in rows)
        assert figures["accuracy"]["prefill"]["count"] == sum(row[b] for row in rows)
        assert figures["labels_differ"]["count"] == sum(row[a] != row[b] for row in rows)
        difference = (sum(row[a] for row in rows) - sum(row[b] for row in rows)) / len(rows)
        assert figures["paired_difference"]["live_minus_prefill"] == pytest.approx(difference)


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
    assert all(row["prefix_equal"] for row in comparisons.to_pylist() if row["relation"] == "construction")
    store = ObjectStore(ledger / "objects")
    for row in trajectories.to_pylist():
        for key in ("prefix_object", "cache_object", "suffix_object"):
            assert store.path_for(row[key]).is_file(), (row["item_id"], key)
        assert row["cache_positions"] == row["prefix_length"] - 1
        assert len(row["layer_k"]) == len(row["layer_v"]) == 4
        assert row["threads"] == 1 and row["attn_implementation"] == "sdpa"
    # Identical artifacts are stored once: exactly one cache object per distinct cache digest.
    caches = {row["cache_object"] for row in trajectories.to_pylist()}
    stored_caches = [path for path in (ledger / "objects").rglob("*.safetensors") if path.stem in caches]
    assert len(stored_caches) == len(caches)
    # Replicas are bit-exact, so the 36 rows name fewer distinct caches than rows.
    assert len(caches) < trajectories.num_rows


def test_e5_transplants_are_recorded(completed):
    _, ledger, _ = completed
    selection = json.loads((ledger / "transplants" / "selection.json").read_text())
    assert len(selection["outcome_blind"]["item_ids"]) == 2
    divergent = sorted(row["item_id"] for row in _e1_rows(ledger) if row["suffix_differs"])
    assert selection["selected"]["item_ids"] == divergent
    rows = pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
    blind = [row for row in rows if row["selection"] == "outcome_blind"]
    # 2 sampled items x both directions, all layers only.
    assert len(blind) == 4 and {row["subset"] for row in blind} == {"layers=0-3 kv=kv positions=all"}
    for row in blind:
        assert len(row["layer_k"]) == 4 and len(row["cache_digest"]) == 32
        if not row["divergent"]:  # donor and recipient agree, so the all-layer transplant follows both
            assert row["outcome"] == "follows_donor"
    selected = [row for row in rows if row["selection"] == "selected"]
    assert {row["item_id"] for row in selected} == set(divergent)
    e5 = json.loads((ledger / "summary.json").read_text())["E5"]
    assert "primary checkpoint" in e5["outcome_blind_checkpoint"]


def test_same_precision_all_layer_transplants_follow_the_donor(completed):
    """On divergent items the whole boundary cache carries the divergence: swap it and the continuation swaps."""
    _, ledger, _ = completed
    rows = pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
    all_layers = [
        row for row in rows if row["selection"] == "selected" and row["subset"] == "layers=0-3 kv=kv positions=all"
    ]
    assert all_layers and all(row["divergent"] for row in all_layers)
    assert {row["outcome"] for row in all_layers} == {"follows_donor"}
    assert {row["donor"] for row in all_layers} == {"live/bf16/rep0", "prefill/bf16/rep0<-bf16"}
    e5 = json.loads((ledger / "summary.json").read_text())["E5"]
    followed = e5["all_layers"]["selected/tiny-qwen2"]["follows_donor"]
    assert (followed["count"], followed["n"]) == (len(all_layers), len(all_layers))


def test_cross_precision_compares_the_two_cast_continuations(completed):
    """At each precision, the cast live and cast prefill caches are continued in full and compared."""
    _, ledger, _ = completed
    rows = [
        row
        for row in pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
        if row["selection"] == "cross_precision"
    ]
    selected = json.loads((ledger / "transplants" / "selection.json").read_text())["selected"]["item_ids"]
    cross = json.loads((ledger / "summary.json").read_text())["E5"]["cross_precision"]
    for precision, donors in (
        ("fp32", ("live/bf16/rep0", "prefill/bf16/rep0<-bf16")),
        ("bf16", ("incremental/fp32/rep0<-bf16", "prefill/fp32/rep0<-bf16")),
    ):
        at = {(row["item_id"], row["donor"]): row for row in rows if row["precision"] == precision}
        assert set(at) == {(item, donor) for item in selected for donor in donors}
        differ = sum(
            at[(item, donors[0])]["suffix_tokens"] != at[(item, donors[1])]["suffix_tokens"] for item in selected
        )
        survives = cross["divergence_survives_cast"][precision]
        assert (survives["count"], survives["n"]) == (differ, len(selected))
        # Never cut short at the first token that leaves both suffixes: decoded to the budget (8) or EOS.
        assert all(len(row["suffix_tokens"]) == 8 or row["suffix_stop"] == "eos" for row in at.values())
    assert set(cross["follows_donor"]) == {f"{row['donor']} -> {row['recipient']}" for row in rows if row["divergent"]}


def test_e2_and_e3_figures(completed):
    _, ledger, _ = completed
    summary = json.loads((ledger / "summary.json").read_text())
    rows = pq.read_table(ledger / "tables" / "comparisons.parquet").to_pylist()
    for precision in ("bf16", "fp32"):
        arm = summary["E2"]["checkpoints"]["tiny-qwen2"]["precisions"][precision]["incremental_vs_prefill"]
        e2 = [row for row in rows if row["experiment"] == "E2" and row["precision"] == precision]
        assert arm["decoded_disagreements"]["n"] == len(e2) == 4
        assert arm["decoded_disagreements"]["count"] == sum(row["suffix_differs"] for row in e2)
        # The bridge: token-by-token incremental reproduces the retained live cache bit for bit.
        bridge = summary["E3"]["checkpoints"]["tiny-qwen2"]["precisions"][precision]
        assert (bridge["bit_exact"]["count"], bridge["bit_exact"]["n"]) == (4, 4)
        assert bridge["not_exact"] == []
    # The near-tie model: bf16 prefill changes continuations, fp32 does not (its spread is far above fp32 rounding).
    e2 = summary["E2"]["checkpoints"]["tiny-qwen2"]["precisions"]
    assert e2["bf16"]["incremental_vs_prefill"]["decoded_disagreements"]["count"] > 0
    assert e2["fp32"]["incremental_vs_prefill"]["decoded_disagreements"]["count"] == 0
    e1 = [row for row in rows if row["experiment"] == "E1" and row["relation"] == "construction"]
    assert all(len(row["k_max_abs"]) == len(row["v_fraction_differ"]) == 4 for row in e1)
    for row in e1:
        assert row["cache_exact"] == (max(row["k_max_abs"] + row["v_max_abs"]) == 0)
        if row["suffix_differs"]:
            assert row["a_token_at_divergence"] != row["b_token_at_divergence"]


# The light jobs after any change of the shard tables: gather and compare them, settle the store, summarise,
# record the design, draw the card.
AFTER_THE_TABLES_CHANGE = {
    "gather": 1,
    "compare": 1,
    "storage": 1,
    "summary": 1,
    "provenance": 1,
    "report": 1,
    "all": 1,
}


def test_adding_a_precision_schedules_only_its_jobs(completed, tmp_path):
    workdir, ledger, _ = completed
    config = write_config(
        tmp_path / "fp16.yaml", ledger_dir=str(ledger), fixed_prefix={"precisions": ["bf16", "fp32", "fp16"]}
    )
    result = snakemake(workdir, config, "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    # fp16 only: E3 live; E2 incremental and prefill; E3 incremental over the fp16 live prefix; then the light
    # jobs: the tables gathered and compared, the store settled, the summary, the design recorded, the card.
    assert job_counts(result) == {"live": 1, "rebuild": 3, **AFTER_THE_TABLES_CHANGE}
    outputs = [
        line.split(":", 1)[1].strip() for line in result.stdout.splitlines() if line.strip().startswith("output:")
    ]
    run_tables = [path for path in outputs if "/runs/" in path]
    assert len(run_tables) == 4 and all("/fp16/" in path for path in run_tables)


def test_removing_a_precision_recomputes_only_the_gathering(completed, tmp_path):
    workdir, ledger, _ = completed
    before = set(ledger_snapshot(ledger))
    config = write_config(tmp_path / "bf16.yaml", ledger_dir=str(ledger), fixed_prefix={"precisions": ["bf16"]})
    result = snakemake(workdir, config, "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    assert job_counts(result) == AFTER_THE_TABLES_CHANGE
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
