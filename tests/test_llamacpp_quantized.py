"""Quantized llama.cpp KV caches (q8_0, q4_0, K and V set apart) on a tiny random Qwen2 GGUF whose heads are
64 values wide (so llama.cpp's Hadamard rotation applies): the state round trip bit for bit, the parsed
values, offline quantization, the rotation, and the one-line refusals.
"""

from __future__ import annotations

import pytest
import torch
from test_llamacpp import _binding_problem
from workflow_helpers import skip_unless_required

from stagereplay.engines.llamacpp.state import parse_seq_state, write_seq_state
from stagereplay.experiments.constructions import StageBoundary, build_boundary_state, build_live
from stagereplay.inputs.checkpoints import build_random_qwen2
from stagereplay.inputs.tiny_gguf import write_qwen2_gguf
from stagereplay.ledger.block_format import BlockFormat
from stagereplay.ledger.blocks import blocks_of, numeric, values_of
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState


@pytest.fixture(scope="module", autouse=True)
def _binding():
    skip_unless_required(_binding_problem(), "STAGEREPLAY_REQUIRE_LLAMACPP")


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory):
    """Heads of 64 values (hidden 256, 4 heads): whole q8_0/q4_0 blocks, and llama.cpp rotates them."""
    folder = build_random_qwen2(tmp_path_factory.mktemp("wide") / "model", seed=3, layers=2, hidden=256)
    return write_qwen2_gguf(folder, tmp_path_factory.mktemp("gguf") / "wide.gguf")


def _engine(path, cache_type: str, flash_attn: bool = True, rotation: bool = True):
    from stagereplay.engines.llamacpp.engine import EngineSettings, LlamaCppEngine

    settings = EngineSettings(cache_type, 1, 1, 256, flash_attn=flash_attn, rotation=rotation)
    return LlamaCppEngine(path, settings)


def _prefill(engine, tokens=24):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Which letter follows B? Think."}])
    live = build_live(engine, prompt, StageBoundary(tokens), frozenset(), engine.tokenizer)
    cache = engine.empty_cache()
    engine.forward(list(live.prefix[:-1]), cache)
    return live, cache, len(prompt)


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0", "q8_0-fp16", "fp16-q4_0"])
def test_quantized_state_round_trips_bit_for_bit(wide_gguf, cache_type):
    engine = _engine(wide_gguf, cache_type)
    try:
        _, cache, _ = _prefill(engine)
        raw = engine.state_bytes(cache)
        parsed = engine.read_state(cache)
        assert parsed.cache_type == cache_type
        assert write_seq_state(parsed) == raw
        # Written into the context and read back, llama.cpp holds exactly the same bytes.
        restored = engine.to_cache(parsed.kv)
        assert engine.state_bytes(restored) == raw
        k_type, _, v_type = cache_type.partition("-")
        expected = {"q8_0": "q8_0-h64", "q4_0": "q4_0-h64", "fp16": ""}
        assert parsed.kv.formats == (expected[k_type], expected[v_type or k_type])
        if parsed.kv.key_format:
            assert parsed.kv.keys[0].dtype == torch.uint8
            assert parsed.kv.keys[0].shape[-1] == BlockFormat.parse(parsed.kv.key_format).block_bytes(64)
    finally:
        engine.close()


def test_parsed_values_are_unrotated_and_close_to_the_fp16_cache(wide_gguf):
    reference, quantized = _engine(wide_gguf, "fp16"), _engine(wide_gguf, "q8_0")
    try:
        live, cache, _ = _prefill(reference)
        values = reference.snapshot(cache)
        q_cache = quantized.empty_cache()
        quantized.forward(list(live.prefix[:-1]), q_cache)
        dequantized = numeric(quantized.snapshot(q_cache))
        # Layer 0 sees the same inputs under both caches: only the 8-bit rounding of rotated values
        # separates them (a block's step is its largest magnitude / 127).
        for ours, theirs in ((dequantized.keys[0], values.keys[0]), (dequantized.values[0], values.values[0])):
            step = theirs.float().abs().amax() / 127
            assert float((ours - theirs.float()).abs().max()) <= float(step)
            # Left rotated, the values would sit in another basis, far from the fp16 cache's.
            raw = quantized.snapshot(q_cache)
            assert raw.key_format == "q8_0-h64"
    finally:
        reference.close()
        quantized.close()


def test_rotation_off_stores_the_plain_basis(wide_gguf):
    rotated, plain = _engine(wide_gguf, "q8_0"), _engine(wide_gguf, "q8_0", rotation=False)
    try:
        live, cache, _ = _prefill(rotated)
        plain_cache = plain.empty_cache()
        plain.forward(list(live.prefix[:-1]), plain_cache)
        with_rotation, without = rotated.snapshot(cache), plain.snapshot(plain_cache)
        assert (rotated.rotation, plain.rotation) == ((64, 64), (0, 0))
        assert without.formats == ("q8_0", "q8_0")
        assert not torch.equal(with_rotation.keys[0], without.keys[0])
        # Un-rotated, both hold layer 0's keys up to 8-bit rounding.
        step = float(numeric(without).keys[0].abs().amax()) / 127
        assert float((numeric(with_rotation).keys[0] - numeric(without).keys[0]).abs().max()) <= 2 * step
        # Unconverted, a rotated cache does not go into a context that does not rotate.
        from stagereplay.engines.llamacpp.binding import LlamaCppError

        with pytest.raises(LlamaCppError, match="unconverted"):
            plain.to_cache(with_rotation)
    finally:
        rotated.close()
        plain.close()


def test_offline_quantization_reproduces_stored_blocks_from_their_values(wide_gguf):
    """gguf's quantizer applied to the values a block holds gives that block back: parse and quantize agree
    with llama.cpp's layout and scales, so an offline-quantized cache is comparable byte for byte."""
    engine = _engine(wide_gguf, "q8_0", rotation=False)
    try:
        _, cache, _ = _prefill(engine)
        state = engine.snapshot(cache)
        block_format = BlockFormat.parse(state.key_format)
        for raw in state.keys + state.values:
            assert torch.equal(blocks_of(values_of(raw, block_format), block_format), raw)
    finally:
        engine.close()


def test_quantized_cache_stores_and_fingerprints_its_bytes(wide_gguf, tmp_path):
    from stagereplay.ledger.store import ObjectStore, store_cache

    engine = _engine(wide_gguf, "q4_0")
    try:
        _, cache, _ = _prefill(engine)
        state, raw = engine.snapshot(cache), engine.state_bytes(cache)
        fingerprint = fingerprint_cache(state)
        store = ObjectStore(tmp_path / "objects")
        store_cache(store, state, fingerprint.digest, "model", "q4_0")
        loaded = KVState.from_named_tensors(store.get(fingerprint.digest))
        assert loaded.formats == state.formats
        assert fingerprint_cache(loaded) == fingerprint
        assert engine.state_bytes(engine.to_cache(loaded)) == raw
    finally:
        engine.close()


def test_q8_0_constructions_run_and_the_bridge_is_compared_by_bytes(wide_gguf):
    engine = _engine(wide_gguf, "q8_0")
    try:
        live, _, prompt_length = _prefill(engine)
        prefix = list(live.prefix)
        incremental = build_boundary_state(engine, prefix, "incremental", prompt_length)
        again = build_boundary_state(engine, prefix, "incremental", prompt_length)
        assert fingerprint_cache(incremental) == fingerprint_cache(again)  # exact replicas
        assert incremental.formats == live.state.formats == ("q8_0-h64", "q8_0-h64")
        # The bridge: the live cache and its incremental rebuild, compared as the bytes llama.cpp stored.
        assert fingerprint_cache(incremental) == fingerprint_cache(live.state)
        prefill = build_boundary_state(engine, prefix, "prefill", prompt_length)
        assert prefill.num_positions == incremental.num_positions == len(prefix) - 1
    finally:
        engine.close()


def test_quantized_v_without_flash_attention_is_refused_in_one_line(wide_gguf):
    from stagereplay.engines.llamacpp.binding import LlamaCppError

    with pytest.raises(LlamaCppError, match=r"q8_0 V cache only with flash attention — set runtime.flash_attn: true"):
        _engine(wide_gguf, "q8_0", flash_attn=False)
    # K alone may be quantized without it.
    engine = _engine(wide_gguf, "q8_0-fp16", flash_attn=False)
    engine.close()


def test_state_of_another_type_is_refused(wide_gguf):
    from stagereplay.engines.llamacpp.binding import LlamaCppError

    fp16, q8 = _engine(wide_gguf, "fp16", flash_attn=False), _engine(wide_gguf, "q8_0")
    try:
        _, cache, _ = _prefill(q8)
        state = q8.snapshot(cache)
        with pytest.raises(LlamaCppError, match="unconverted"):
            fp16.to_cache(state)
        raw = q8.state_bytes(cache)
        assert parse_seq_state(raw, q8.geometry, q8.rotation).kv.formats == state.formats
    finally:
        fp16.close()
        q8.close()


def test_a_head_of_no_whole_blocks_is_refused(tiny_qwen2_folder, tmp_path):
    """The tiny test model's heads are 16 values: not one 32-value block, so no quantized cache."""
    from stagereplay.engines.llamacpp.binding import LlamaCppError

    narrow = write_qwen2_gguf(tiny_qwen2_folder, tmp_path / "narrow.gguf")
    with pytest.raises(LlamaCppError, match="a head of 16 values is not whole 32-value blocks — use fp16 or fp32"):
        _engine(narrow, "q8_0")
