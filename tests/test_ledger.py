import os
import stat

import pyarrow as pa
import pytest
import torch
from safetensors import safe_open

from stagereplay.ledger.fingerprint import fingerprint_cache, fingerprint_tensors
from stagereplay.ledger.kvstate import KVState
from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, LedgerError, concat_tables, read_table, write_table


def kv_state(seed=0, layers=3):
    generator = torch.Generator().manual_seed(seed)
    keys = tuple(torch.randn(1, 2, 5, 4, generator=generator).to(torch.bfloat16) for _ in range(layers))
    values = tuple(torch.randn(1, 2, 5, 4, generator=generator).to(torch.bfloat16) for _ in range(layers))
    return KVState(keys, values)


def test_cache_round_trips_through_the_store_bit_for_bit(tmp_path):
    store = ObjectStore(tmp_path / "objects")
    state = kv_state()
    fingerprint = fingerprint_cache(state)
    object_id = store.put(state.named_tensors(), {"kind": "kv_cache", "precision": "bf16"})
    assert object_id == fingerprint.digest
    path = store.path_for(object_id)
    assert path == tmp_path / "objects" / object_id[:2] / f"{object_id}.safetensors"
    loaded = KVState.from_named_tensors(store.get(object_id))
    assert fingerprint_cache(loaded) == fingerprint
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata()["precision"] == "bf16"
    # Permissions follow the umask (ledgers are shared), not mkstemp's 0600.
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask


def test_identical_content_is_stored_once(tmp_path):
    store = ObjectStore(tmp_path / "objects")
    first = store.put(kv_state(1).named_tensors(), {"kind": "kv_cache"})
    second = store.put(kv_state(1).named_tensors(), {"kind": "kv_cache"})
    third = store.put(kv_state(2).named_tensors(), {"kind": "kv_cache"})
    assert first == second != third
    files = sorted(p.name for p in (tmp_path / "objects").rglob("*") if p.is_file())
    assert files == sorted([f"{first}.safetensors", f"{third}.safetensors"])


def test_layer_fingerprints_locate_the_changed_layer():
    state = kv_state()
    changed_values = list(state.values)
    changed_values[1] = changed_values[1].clone()
    changed_values[1][0, 0, 0, 0] += 1
    other = KVState(state.keys, tuple(changed_values))
    a, b = fingerprint_cache(state), fingerprint_cache(other)
    assert a.keys == b.keys
    assert [i for i, (x, y) in enumerate(zip(a.values, b.values)) if x != y] == [1]
    assert a.digest != b.digest


def test_tokens_round_trip(tmp_path):
    store = ObjectStore(tmp_path)
    object_id = store.put_tokens([5, 4, 3])
    assert store.get_tokens(object_id) == [5, 4, 3]
    assert object_id == fingerprint_tensors({"tokens": torch.tensor([5, 4, 3])})


def test_missing_and_malformed_object_ids_fail_clearly(tmp_path):
    store = ObjectStore(tmp_path)
    with pytest.raises(LedgerError, match="missing"):
        store.get("0" * 32)
    with pytest.raises(LedgerError, match="malformed object id"):
        store.get("../../etc/passwd")


def trajectory_row(item_id="arith-000"):
    return {
        "checkpoint": "c",
        "precision": "bf16",
        "construction": "live",
        "replica": 0,
        "prefix_precision": "bf16",
        "item_id": item_id,
        "model_fingerprint": "m",
        "prompt_length": 3,
        "prefix_length": 5,
        "boundary_reason": "budget",
        "marker_match": None,
        "reasoning_text": "ab",
        "prefix_object": "p",
        "cache_object": "c",
        "cache_positions": 4,
        "layer_k": ["k0"],
        "layer_v": ["v0"],
        "suffix_object": "s",
        "suffix_tokens": [1, 2],
        "suffix_margins": [0.5, 0.25],
        "suffix_stop": "eos",
        "suffix_text": "x",
        "answer": None,
        "parsed": False,
        "correct": False,
        "readout_answer": "A",
        "readout_correct": False,
        "readout_margin": 0.5,
        "device": "cpu",
        "device_name": "Intel Xeon",
        "cpu_capability": "AVX512",
        "threads": 1,
        "attn_implementation": "sdpa",
        "tf32": False,
        "bf16_reduced_precision_reduction": True,
        "fp16_reduced_precision_reduction": True,
        "sdpa_backends": "flash,mem_efficient,math,cudnn",
        "float32_matmul_precision": "highest",
        "deterministic": False,
        "torch_version": "t",
        "transformers_version": "tr",
        "engine": "transformers",
        "engine_version": "tr",
        "engine_build": "",
        "model_seconds": 1.5,
    }


def test_table_round_trip_keeps_schema_and_values(tmp_path):
    rows = [trajectory_row("a"), trajectory_row("b")]
    path = write_table(rows, TRAJECTORY_SCHEMA, tmp_path / "t.parquet")
    table = read_table(path, TRAJECTORY_SCHEMA)
    assert table.schema.equals(TRAJECTORY_SCHEMA)
    assert table.to_pylist() == rows
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]  # no temporary left behind
    both = concat_tables([path, path], TRAJECTORY_SCHEMA)
    assert both.num_rows == 4


def test_table_with_the_wrong_schema_is_refused(tmp_path):
    path = write_table([{"x": 1}], pa.schema([("x", pa.int64())]), tmp_path / "t.parquet")
    with pytest.raises(LedgerError, match="expected schema"):
        read_table(path, TRAJECTORY_SCHEMA)
    with pytest.raises(LedgerError, match="not found"):
        read_table(tmp_path / "missing.parquet")
