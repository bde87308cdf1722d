import pyarrow as pa
import pytest
import torch
from conftest import REPO

from stagereplay.design.divergence import first_divergence
from stagereplay.design.jobs import comparisons, job_list, replication_comparisons
from stagereplay.design.schema import load_config
from stagereplay.experiments.compare import compare_pair, comparison_table
from stagereplay.experiments.difference import cache_difference, tensor_difference
from stagereplay.ledger.kvstate import KVState
from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, LedgerError


def test_tensor_difference_measures_max_mean_and_fraction():
    a = torch.zeros(1, 2, 4, 2, dtype=torch.bfloat16)
    b = a.clone()
    b[0, 0, 0, 0] = 0.5
    b[0, 1, 3, 1] = -0.25
    diff = tensor_difference(a, b)
    assert diff.max_abs == 0.5
    assert diff.mean_abs == pytest.approx(0.75 / 16)
    assert diff.fraction_differ == 2 / 16
    assert tensor_difference(a, a.clone()).fraction_differ == 0.0


def test_signed_zero_counts_as_a_bit_difference():
    a = torch.zeros(4)
    b = -torch.zeros(4)
    diff = tensor_difference(a, b)
    assert diff.max_abs == 0.0 and diff.fraction_differ == 1.0


def test_cache_difference_is_per_layer_and_refuses_mismatched_shapes():
    keys = (torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    values = (torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    other_values = (values[0], values[1] + 1)
    k_diff, v_diff = cache_difference(KVState(keys, values), KVState(keys, other_values))
    assert [d.max_abs for d in k_diff] == [0.0, 0.0]
    assert [d.max_abs for d in v_diff] == [0.0, 1.0]
    with pytest.raises(ValueError, match="cannot compare"):
        tensor_difference(torch.ones(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="cannot compare"):
        tensor_difference(torch.ones(2), torch.ones(2, dtype=torch.bfloat16))


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_comparisons_follow_the_design():
    specs = comparisons("m", "bf16", 2, ["bf16", "fp32"], ["incremental", "prefill", "chunked:8"])
    assert {s.a.checkpoint for s in specs} == {s.b.checkpoint for s in specs} == {"m"}
    labels = {(s.experiment, s.relation, s.a.label(), s.b.label()) for s in specs}
    assert ("E1", "construction", "live/bf16/rep0", "prefill/bf16/rep0<-bf16") in labels
    assert ("E1", "replica", "live/bf16/rep0", "live/bf16/rep1") in labels
    assert ("E1", "replica", "prefill/bf16/rep0<-bf16", "prefill/bf16/rep1<-bf16") in labels
    # E2 holds the bf16 live prefix fixed at every precision.
    assert ("E2", "construction", "incremental/fp32/rep0<-bf16", "prefill/fp32/rep0<-bf16") in labels
    assert ("E2", "construction", "incremental/fp32/rep0<-bf16", "chunked:8/fp32/rep0<-bf16") in labels
    # E3 compares each precision's own live run with incremental over that run's prefix.
    assert ("E3", "construction", "live/fp32/rep0", "incremental/fp32/rep0<-fp32") in labels
    assert len(specs) == 1 + 2 + 4 + 2


def test_the_job_list_compares_only_trajectories_it_schedules():
    """The comparisons are planned with the trajectories (one job list): every side of every pair is a
    trajectory the workflow runs, and every scheduled trajectory is compared (the outcome-blind
    replication on another checkpoint too)."""
    config = load_config(REPO / "config" / "test.yaml")
    config["transplant"]["outcome_blind"]["checkpoint"] = "other"
    config["checkpoints"]["other"] = {"embedded": True}
    jobs = job_list(config)
    sides = {side for pair in jobs.comparisons for side in (pair.a, pair.b)}
    assert sides <= set(jobs.trajectories)
    assert {t.checkpoint for t in jobs.trajectories} - {t.checkpoint for t in sides} == set()
    assert [pair.a.checkpoint for pair in jobs.comparisons][-1] == "other"


def _trajectory(checkpoint: str, construction: str, prefix_object: str, item_id: str = "q1") -> dict:
    return {
        "checkpoint": checkpoint,
        "construction": construction,
        "precision": "bf16",
        "prefix_precision": "bf16",
        "replica": 0,
        "item_id": item_id,
        "prefix_object": prefix_object,
        "cache_object": "0" * 32,
        "suffix_object": "1" * 32,
        "suffix_tokens": [1, 2],
        "suffix_margins": [0.5, 0.5],
        "boundary_reason": "budget",
        "prefix_length": 5,
        "correct": False,
        "parsed": False,
        "readout_correct": False,
        "layer_k": [],
        "layer_v": [],
    }


def test_unequal_prefixes_are_recorded_not_diffed(tmp_path):
    """The audit's live side may regenerate another prefix: the row says so instead of diffing two states."""
    spec = replication_comparisons("m", "bf16")[0]
    row = compare_pair(
        ObjectStore(tmp_path), spec, _trajectory("m", "live", "a" * 32), _trajectory("m", "prefill", "b" * 32)
    )
    assert row["prefix_equal"] is False and row["cache_exact"] is False
    assert row["layers_differ"] is None and row["k_max_abs"] == [] and row["v_fraction_differ"] == []


def test_pairs_are_taken_per_checkpoint_and_must_all_exist(tmp_path):
    rows = [_trajectory("primary", "live", "a" * 32), _trajectory("other", "live", "a" * 32)]
    table = pa.Table.from_pylist(
        [{name: row.get(name) for name in TRAJECTORY_SCHEMA.names} for row in rows], schema=TRAJECTORY_SCHEMA
    )
    specs = replication_comparisons("primary", "bf16") + replication_comparisons("other", "bf16")
    # No prefill side exists: the first checkpoint's is named, not skipped.
    with pytest.raises(LedgerError, match="prefill/bf16/rep0<-bf16 of checkpoint primary is missing"):
        comparison_table(table, ObjectStore(tmp_path), specs)
    with pytest.raises(LedgerError, match="checkpoint other are not part of this run's design"):
        comparison_table(table, ObjectStore(tmp_path), replication_comparisons("primary", "bf16"))
