"""The parts of the CUDA path that can be checked without a GPU.

The TF32 switches exist in the CPU build of torch too, so turning TF32 off and
reading it back is tested here; the rest of the GPU path is bench/gpu_check.sh,
run on a GPU node (bench/gpu_device_run.sh on a lent machine).

States on the wrong device. On a GPU, a state read from the store is on CPU while
a state the engine built is on CUDA; an engine must move every state handed to it
onto its own device before mixing it with its tensors (E6's batch level once
stacked the two as they came and crashed in torch.cat). A CPU-only run cannot see
that: every tensor is on CPU. So the engine here runs on torch's ``meta`` device
(shapes and dtypes, no data): its tiny Qwen2 weights are moved there, so its
caches, masks and logits are meta tensors, while states from a CPU engine stand in
for stored ones. torch refuses to combine a meta tensor with a CPU one ("Tensor on
device meta is not on the expected device cpu!"), as CUDA refuses CPU, so any
entry point that uses a state without moving it first fails here. Meta tensors
cannot be read (no ``.item()``), so these tests only run the paths that never
read values, with eager attention (sdpa's mask shortcut reads the mask).
"""

from __future__ import annotations

import pytest
import torch

from stagereplay.engines.transformers.engine import (
    Runtime,
    TransformersEngine,
    _disable_tf32,
    load_model,
    tf32_enabled,
)
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState, to_host


@pytest.fixture
def restore_tf32():
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        saved = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        yield
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        return
    saved = (matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision)
    yield
    matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision = saved


def test_tf32_off_is_read_back_as_off(restore_tf32):
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32"  # as a library or a user might have set it before us
    else:
        matmul.allow_tf32 = True
    assert tf32_enabled()
    _disable_tf32()
    assert not tf32_enabled()
    if hasattr(matmul, "fp32_precision"):
        assert matmul.fp32_precision == "ieee"
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"


def test_a_convolution_left_on_tf32_counts_as_tf32(restore_tf32):
    _disable_tf32()
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    else:
        torch.backends.cudnn.allow_tf32 = True
    assert tf32_enabled()


@pytest.mark.parametrize("layers", [1, 12, 130])
def test_cache_digest_is_the_stored_object_id(layers):
    from stagereplay.ledger.fingerprint import fingerprint_cache, fingerprint_tensors
    from stagereplay.ledger.kvstate import KVState

    generator = torch.Generator().manual_seed(layers)
    keys = tuple(torch.randn(1, 2, 3, 4, generator=generator).to(torch.bfloat16) for _ in range(layers))
    values = tuple(torch.randn(1, 2, 3, 4, generator=generator).to(torch.bfloat16) for _ in range(layers))
    state = KVState(keys, values)
    # The digest is built from the layer digests; it must equal the id the store derives from the tensors.
    assert fingerprint_cache(state).digest == fingerprint_tensors(state.named_tensors())


# --- states handed to an engine on another device (see the module docstring) ---------------------


@pytest.fixture(scope="module")
def meta_engine(tiny_qwen2_folder) -> TransformersEngine:
    """The tiny Qwen2 on the meta device: a stand-in for an engine on CUDA, which a CPU state is not on."""
    loaded = load_model(tiny_qwen2_folder, Runtime(precision="fp32", device="cpu", threads=1))
    engine = TransformersEngine(loaded.model.to("meta"), loaded.tokenizer, loaded.environment)
    engine.use_attention("eager")
    assert engine.device.type == "meta"
    return engine


@pytest.fixture
def stored_state(tiny_fp32) -> KVState:
    """A boundary state as the store hands it back: built on CPU, read from named tensors."""
    cache = tiny_fp32.empty_cache()
    tiny_fp32.forward([11, 12, 13, 14, 15], cache)
    return KVState.from_named_tensors(to_host(tiny_fp32.snapshot(cache)).named_tensors())


def built_state(engine, tokens: list[int]) -> KVState:
    cache = engine.empty_cache()
    engine.forward(tokens, cache)
    return engine.snapshot(cache)


def on_device(tensors, device: torch.device) -> bool:
    return all(tensor.device == device for tensor in tensors)


def test_a_stored_state_batches_with_states_the_engine_built(meta_engine, stored_state):
    """E6's batch read: the item's stored state in row 0, companions from the engine's own batch."""
    companion = built_state(meta_engine, [21, 22, 23])
    assert companion.keys[0].device.type == "meta"
    batch = meta_engine.batch_of([stored_state, companion])
    batch, logits = meta_engine.batch_forward(batch, [[16], [24]])
    device = meta_engine.device
    assert logits.shape[0] == 2 and logits.device == device
    assert on_device([batch.mask], device)
    assert on_device([layer.keys for layer in batch.cache.layers], device)
    assert on_device([layer.values for layer in batch.cache.layers], device)


def test_stored_states_alone_batch_on_the_engine_device(meta_engine, stored_state):
    batch = meta_engine.batch_of([stored_state, stored_state])
    _, logits = meta_engine.batch_forward(batch, [[16], [16]])
    assert logits.device == meta_engine.device
    assert on_device([layer.keys for layer in batch.cache.layers], meta_engine.device)


def test_a_stored_state_continues_on_the_engine_device(meta_engine, stored_state):
    cache = meta_engine.to_cache(stored_state)
    logits = meta_engine.forward([16, 17], cache)
    after = meta_engine.snapshot(cache)
    assert logits.device == meta_engine.device
    assert on_device(after.keys + after.values, meta_engine.device)
    assert after.num_positions == stored_state.num_positions + 2


def test_placing_a_state_where_it_already_is_keeps_its_tensors(tiny_fp32, stored_state):
    """On the device they are on, states pass through untouched: no copy, no dtype change, same bytes."""
    placed = tiny_fp32.placed(stored_state)
    assert all(a is b for a, b in zip(placed.keys + placed.values, stored_state.keys + stored_state.values))
    assert fingerprint_cache(tiny_fp32.snapshot(tiny_fp32.to_cache(stored_state))) == fingerprint_cache(stored_state)
    batch = tiny_fp32.batch_of([stored_state, stored_state])
    assert fingerprint_cache(tiny_fp32.batch_row(batch, 1)) == fingerprint_cache(stored_state)
