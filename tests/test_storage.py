"""store_caches: caches not stored are rebuilt from the saved tokens, checked against the ledger's fingerprints."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer
from workflow_helpers import copy_run, fingerprints, snakemake, stagereplay, write_config

from stagereplay.design.jobs import trajectory_label
from stagereplay.design.storage import StorageError, read_policy
from stagereplay.engines.transformers.engine import Runtime
from stagereplay.experiments.constructions import StageBoundary
from stagereplay.experiments.job import JobContext, ShardSpec
from stagereplay.experiments.prompts import readout_tokens
from stagereplay.experiments.recompute import CacheMismatch, CacheSource, ModelPool
from stagereplay.experiments.shards import run_construction_shard, run_live_shard
from stagereplay.inputs.checkpoints import write_model_record
from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import PROMPT_SCHEMA, TRAJECTORY_SCHEMA, LedgerError, read_table, write_table

PROMPT = [9, 8, 7, 6, 5]


@pytest.fixture(scope="module")
def shards(tiny_qwen2_folder, tmp_path_factory):
    """A live shard and its incremental and chunked:2 rebuilds, in bf16, with (stored/) and without (bare/) caches."""
    root = tmp_path_factory.mktemp("storage")
    record = root / "model.json"
    write_model_record(record, tiny_qwen2_folder, "test")
    items = root / "items.jsonl"
    items.write_text(
        "".join(
            json.dumps({"id": f"q{n}", "question": f"{n}+1?", "choices": ["1", "2", "3", "4"], "answer": "B"}) + "\n"
            for n in (1, 2)
        )
    )
    cue, letters = readout_tokens(AutoTokenizer.from_pretrained(tiny_qwen2_folder))
    prompts = write_table(
        [
            {
                "item_id": f"q{n}",
                "prompt_tokens": PROMPT[n:],
                "prompt_fingerprint": "-",
                "readout_cue_tokens": cue,
                "readout_letter_tokens": letters,
            }
            for n in (1, 2)
        ],
        PROMPT_SCHEMA,
        root / "prompts.parquet",
    )
    spec = ShardSpec("tiny", "bf16", replica=0, shard=0, shard_size=2)
    runtime = Runtime(precision="bf16", device="cpu", threads=1)
    tables = {}
    for name, policy in (("stored", "all"), ("bare", "none")):
        store = root / name / "objects"

        def context(out, store=store, policy=policy):
            return JobContext.read(
                record,
                runtime=runtime,
                shard_spec=spec,
                items_path=items,
                suffix_tokens=3,
                store_root=store,
                out_path=out,
                prompts_path=prompts,
                store_caches=policy,
            )

        live = run_live_shard(context(root / name / "live.parquet"), StageBoundary(6))
        rows = read_table(live, TRAJECTORY_SCHEMA).to_pylist()
        for construction in ("incremental", "chunked:2"):
            out = root / name / f"{construction.replace(':', '-')}.parquet"
            run_construction_shard(context(out), live, construction)
            rows += read_table(out, TRAJECTORY_SCHEMA).to_pylist()
        tables[name] = (ObjectStore(store), rows)
    return record, runtime, tables


def _pool(record, runtime):
    return ModelPool({"tiny": record}, runtime)


def test_without_caches_the_rows_are_the_same_and_no_cache_is_stored(shards):
    _, _, tables = shards
    (stored, stored_rows), (bare, bare_rows) = tables["stored"], tables["bare"]
    drop = lambda row: {k: v for k, v in row.items() if k != "model_seconds"}  # noqa: E731
    assert [drop(row) for row in bare_rows] == [drop(row) for row in stored_rows]
    caches = {row["cache_object"] for row in stored_rows}
    assert caches <= set(stored.object_ids())
    assert not caches & set(bare.object_ids())
    # Tokens are kept at every setting.
    assert {row["prefix_object"] for row in bare_rows} <= set(bare.object_ids())


def test_rebuilt_caches_equal_the_stored_ones_for_every_construction(shards):
    record, runtime, tables = shards
    (stored, _), (bare, rows) = tables["stored"], tables["bare"]
    source = CacheSource([bare], _pool(record, runtime))
    for row in rows:  # live (teacher-forced), incremental and chunked:2
        rebuilt = source.state(row)
        assert rebuilt.named_tensors().keys() == stored.get(row["cache_object"]).keys()
        for name, tensor in stored.get(row["cache_object"]).items():
            assert rebuilt.named_tensors()[name].equal(tensor)
    assert source.rebuilt == len(rows) == 6


def test_a_stored_cache_is_read_not_rebuilt(shards):
    _, _, tables = shards
    stored, rows = tables["stored"]
    source = CacheSource([stored])  # no model: it could not rebuild
    source.state(rows[0])
    assert source.rebuilt == 0


def test_selected_keeps_what_it_rebuilt(shards, tmp_path):
    record, runtime, tables = shards
    bare, rows = tables["bare"]
    keep = ObjectStore(tmp_path / "kept")
    CacheSource([bare], _pool(record, runtime), keep).state(rows[0])
    assert keep.object_ids() == [rows[0]["cache_object"]]


def test_a_rebuilt_cache_that_differs_from_the_ledger_stops_with_one_line(shards):
    record, runtime, tables = shards
    bare, rows = tables["bare"]
    row = dict(rows[0])
    row["layer_v"] = [*row["layer_v"][:1], "0" * 32, *row["layer_v"][2:]]
    with pytest.raises(CacheMismatch) as caught:
        CacheSource([bare], _pool(record, runtime)).state(row)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"item {row['item_id']} live/bf16/rep0 (checkpoint tiny):")
    assert "at layer 1 V" in message and "store_caches: all" in message


def test_a_cache_neither_stored_nor_rebuildable_is_named(shards):
    _, _, tables = shards
    bare, rows = tables["bare"]
    with pytest.raises(LedgerError, match=f"cache object {rows[0]['cache_object']} is not stored"):
        CacheSource([bare]).state(rows[0])


def test_storage_json_names_the_policy(tmp_path):
    assert read_policy(tmp_path / "storage.json") == "all"
    (tmp_path / "storage.json").write_text('{"store_caches": "most"}')
    with pytest.raises(StorageError, match="names no store_caches policy"):
        read_policy(tmp_path / "storage.json")


# --- the whole workflow at each policy: the same figures and fingerprints as at all ------------------


def _run(tmp_path_factory, policy: str, *targets: str):
    workdir = tmp_path_factory.mktemp(f"store-{policy}")
    ledger = workdir / "ledger"
    config = write_config(workdir / "config.yaml", ledger_dir=str(ledger), store_caches=policy)
    for target in targets or ("all",):
        # the audit is the default target under --config mode=audit
        result = snakemake(workdir, config, *(["--config", "mode=audit"] if target == "audit" else [target]))
        assert result.returncode == 0, result.stderr[-4000:]
    return workdir, ledger, config


@pytest.fixture(scope="module")
def run_none(tmp_path_factory):
    return _run(tmp_path_factory, "none", "all", "audit")


@pytest.fixture(scope="module")
def run_selected(tmp_path_factory):
    return _run(tmp_path_factory, "selected")


def _cache_objects(store: ObjectStore) -> set[str]:
    return {object_id for object_id in store.object_ids() if "tokens" not in store.get(object_id)}


def _transplanted_caches(ledger) -> set[str]:
    """The caches of every trajectory a transplant used as donor or recipient."""
    trajectories = {
        (row["checkpoint"], row["item_id"], trajectory_label(row)): row["cache_object"]
        for row in pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    }
    return {
        trajectories[(row["checkpoint"], row["item_id"], row[role])]
        for row in pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
        for role in ("donor", "recipient")
    }


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "selected"])
def test_a_policy_gives_the_figures_and_fingerprints_of_all(policy, test_run, run_none, run_selected):
    _, reference, _ = test_run
    _, ledger, _ = run_none if policy == "none" else run_selected
    # Figures, comparison rows (per-layer Δ included) and transplant rows: the same bytes; trajectory rows the
    # same fingerprints (their model_seconds is a time).
    for name in ("summary.json", "tables/comparisons.parquet", "tables/transplants.parquet"):
        assert (ledger / name).read_bytes() == (reference / name).read_bytes(), name
    assert fingerprints(ledger) == fingerprints(reference)
    assert json.loads((ledger / "storage.json").read_text())["store_caches"] == policy
    stored = _cache_objects(ObjectStore(ledger / "objects"))
    assert stored == (_transplanted_caches(ledger) if policy == "selected" else set())
    assert _cache_objects(ObjectStore(reference / "objects")) > stored
    result = stagereplay("verify", ledger)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_the_audit_passes_at_none_and_stores_no_recomputed_cache(run_none):
    _, ledger, _ = run_none
    e4 = json.loads((ledger / "audit" / "e4.json").read_text())
    assert e4["status"] == "reproduced" and e4["mismatches"] == [], e4["mismatches"][:3]
    assert e4["artifacts"]["layer_k"]["n"] == pq.read_table(ledger / "tables" / "trajectories.parquet").num_rows
    assert e4["artifacts"]["comparison"]["reproduced"] == e4["artifacts"]["comparison"]["n"] > 0
    assert _cache_objects(ObjectStore(ledger / "audit" / "objects")) == set()


@pytest.mark.slow
def test_a_rebuilt_cache_unlike_the_ledger_stops_compare_with_one_line(run_none, tmp_path):
    """A row whose layer fingerprint was rewritten (every digest valid): its rebuilt cache cannot match it."""
    workdir, _, _ = run_none
    ledger, config = copy_run(workdir, tmp_path / "run")
    path = ledger / "tables" / "trajectories.parquet"
    rows = read_table(path, TRAJECTORY_SCHEMA).to_pylist()
    row = next(row for row in rows if row["construction"] == "prefill")
    row["layer_k"] = ["0" * 32, *row["layer_k"][1:]]
    write_table(rows, TRAJECTORY_SCHEMA, path)
    result = snakemake(tmp_path / "run", config, "--forcerun", "compare")
    assert result.returncode != 0
    line = (
        f"stagereplay: error: item {row['item_id']} {trajectory_label(row)} (checkpoint {row['checkpoint']}): the cache"
        " rebuilt from the saved tokens differs from the ledger's fingerprints at layer 0 K"
    )
    assert line in result.stderr, result.stderr[-3000:]


def test_the_pool_holds_one_model_besides_the_jobs_own(shards, tiny_bf16):
    record, runtime, tables = shards
    _, rows = tables["bare"]
    fp32_row = {**rows[0], "precision": "fp32"}
    pool = ModelPool({"tiny": record}, runtime, {("tiny", "bf16"): tiny_bf16})
    pool.model_for(fp32_row)
    pool.model_for({**rows[0], "precision": "fp16"})
    assert set(pool.loaded) == {("tiny", "bf16"), ("tiny", "fp16")}
    assert pool.model_for(rows[0]) is tiny_bf16


def _scheduled(result) -> set[str]:
    """The rules of a dry run's job table."""
    rows = re.findall(r"^([a-z_]+) +\d+$", result.stdout + result.stderr, flags=re.MULTILINE)
    return set(rows) - {"total"}


@pytest.mark.slow
def test_a_new_policy_on_a_finished_ledger_deletes_or_materialises_and_decodes_nothing(run_selected, test_run):
    """Last in this module: it changes run_selected's ledger in place (snakemake's metadata is the run's own)."""
    workdir, ledger, config = run_selected
    _, reference, _ = test_run
    tables = {name: (ledger / name).read_bytes() for name in ("tables/trajectories.parquet", "summary.json")}
    data = yaml.safe_load(config.read_text())
    for policy in ("none", "all"):
        config.write_text(yaml.safe_dump({**data, "store_caches": policy}))
        plan = snakemake(workdir, config, "--dry-run")
        assert plan.returncode == 0, plan.stderr[-3000:]
        # No model job: only the policy file, the design record and the storage operation.
        assert _scheduled(plan) == {"store_caches_policy", "provenance", "storage", "all"}
        result = snakemake(workdir, config)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"storage: store_caches {policy} — " in result.stdout + result.stderr
        assert stagereplay("verify", ledger).returncode == 0
        stored = _cache_objects(ObjectStore(ledger / "objects"))
        # none: every cache tensor gone; all: every one back, bit for bit (the names of the run at all).
        assert stored == (set() if policy == "none" else _cache_objects(ObjectStore(reference / "objects")))
    assert {name: (ledger / name).read_bytes() for name in tables} == tables
