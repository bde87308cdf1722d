"""The llama.cpp engine on a tiny random Qwen2 GGUF written by the test: state format, constructions, transplants.

Without the llama_cpp binding these tests skip with the reason; with
STAGEREPLAY_REQUIRE_LLAMACPP=1 (set by .ci/run) a missing binding fails them instead.
"""

from __future__ import annotations

import struct

import pytest
import torch
from workflow_helpers import skip_unless_required

from stagereplay.engines.llamacpp.state import LlamaStateError, parse_seq_state, write_seq_state
from stagereplay.experiments.constructions import StageBoundary, build_boundary_state, build_live
from stagereplay.experiments.decode import continue_from
from stagereplay.experiments.transplants import TransplantSpec, transplant
from stagereplay.inputs.tiny_gguf import write_qwen2_gguf
from stagereplay.ledger.fingerprint import fingerprint_cache


def _binding_problem() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama_cpp not importable ({error}); install it with pip install -e .[llamacpp]"
    return None


@pytest.fixture(scope="module", autouse=True)
def _binding():
    skip_unless_required(_binding_problem(), "STAGEREPLAY_REQUIRE_LLAMACPP")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_qwen2_folder, tmp_path_factory):
    return write_qwen2_gguf(tiny_qwen2_folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _engine(path, cache_type: str):
    from stagereplay.engines.llamacpp.engine import EngineSettings, LlamaCppEngine

    return LlamaCppEngine(path, EngineSettings(cache_type=cache_type, n_threads=1, n_threads_batch=1, n_ctx=256))


@pytest.fixture(scope="module", params=["fp16", "fp32"])
def engine(request, tiny_gguf):
    engine = _engine(tiny_gguf, request.param)
    yield engine
    engine.close()


PROMPT_TEXT = "Question: which letter comes after B? Think, then answer."


def _live(engine, tokens: int = 12):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}])
    return prompt, build_live(engine, prompt, StageBoundary(tokens), frozenset(), engine.tokenizer)


def _decoded_state(engine):
    prompt, _ = _live(engine)
    cache = engine.empty_cache()
    engine.forward(prompt, cache)
    for token in (5, 17, 40):
        engine.forward([token], cache)
    return cache, len(prompt) + 3


def test_state_parses_and_rewrites_to_identical_bytes(engine):
    cache, positions = _decoded_state(engine)
    raw = engine.state_bytes(cache)
    parsed = parse_seq_state(raw, engine.geometry)
    assert parsed.kv.num_layers == engine.geometry.n_layer
    assert parsed.kv.keys[0].shape == (1, engine.geometry.n_head_kv, positions, engine.geometry.head_dim_k)
    assert parsed.kv.keys[0].dtype == {"fp16": torch.float16, "fp32": torch.float32}[engine.settings.cache_type]
    assert parsed.v_trans  # flash attention is off: llama.cpp stores V transposed
    assert write_seq_state(parsed) == raw


def test_rewritten_state_continues_bit_identically(engine):
    cache, _ = _decoded_state(engine)
    raw = engine.state_bytes(cache)
    original = [engine.forward([token], cache) for token in (7, 9, 11)]
    fresh = engine.empty_cache()
    engine.write_state(write_seq_state(parse_seq_state(raw, engine.geometry)), fresh)
    again = [engine.forward([token], fresh) for token in (7, 9, 11)]
    for first, second in zip(original, again):
        assert torch.equal(first, second)


def test_parsed_cache_is_transformers_cache_in_fp32(tiny_gguf, tiny_fp32):
    """Same weights, fp32 cache: llama.cpp's K and V per head and position match transformers' to float rounding,
    so the parser's head, position and (transposed) V layout are right."""
    engine = _engine(tiny_gguf, "fp32")
    prompt, _ = _live(engine)
    cache = engine.empty_cache()
    engine.forward(prompt, cache)
    ours = engine.snapshot(cache)
    hf_cache = tiny_fp32.empty_cache()
    with torch.inference_mode():
        tiny_fp32.forward(prompt, hf_cache)
    theirs = tiny_fp32.snapshot(hf_cache)
    for mine, reference in zip(ours.keys + ours.values, theirs.keys + theirs.values):
        assert mine.shape == reference.shape
        torch.testing.assert_close(mine, reference, atol=2e-4, rtol=1e-3)
    engine.close()


def test_unparseable_states_are_refused_naming_the_version(engine):
    cache, _ = _decoded_state(engine)
    raw = engine.state_bytes(cache)
    magic, seq, streams, cells = struct.unpack_from("<IiII", raw)
    # The first layer's K type sits after the header, the cells and the v_trans and layer-count words.
    k_type_offset = 16 + cells * 12 + 8
    broken = {
        "truncated": raw[:-3],
        "trailing bytes": raw + b"\0\0\0\0",
        "bad magic": b"\0\0\0\0" + raw[4:],
        "quantized cache type": raw[:k_type_offset] + struct.pack("<i", 8) + raw[k_type_offset + 4 :],
        "two streams": raw[:8] + struct.pack("<I", 2) + raw[12:],
    }
    for name, data in broken.items():
        with pytest.raises(LlamaStateError, match="llama-cpp-python 0.3.36") as error:
            parse_seq_state(data, engine.geometry)
        assert "\n" not in str(error.value), name


def test_constructions_follow_llama_cpp_operations(engine):
    prompt, live = _live(engine)
    assert live.state.num_positions == len(live.prefix) - 1
    incremental = build_boundary_state(engine, list(live.prefix), "incremental", len(prompt))
    # The same decode calls in the same order: bit-exact to the live cache.
    assert fingerprint_cache(incremental) == fingerprint_cache(live.state)
    for construction in ("prefill", "chunked:5"):
        state = build_boundary_state(engine, list(live.prefix), construction, len(prompt))
        assert state.num_positions == live.state.num_positions
        for mine, reference in zip(state.keys, live.state.keys):
            torch.testing.assert_close(mine.float(), reference.float(), atol=1e-2, rtol=1e-2)


def test_continuation_is_greedy_from_the_pending_token(engine):
    _, live = _live(engine, tokens=6)
    suffix = continue_from(engine, live.state, live.prefix[-1], 5, frozenset())
    # Decoding the whole prefix plus the suffix in one live run chooses the same tokens.
    _, longer = _live(engine, tokens=6 + 5)
    assert longer.reasoning.tokens[6:] == suffix.tokens


def test_transplant_into_llama_cpp_cache(engine):
    prompt, live = _live(engine)
    prefill = build_boundary_state(engine, list(live.prefix), "prefill", len(prompt))
    every = tuple(range(engine.geometry.n_layer))
    whole = transplant(prefill, live.state, TransplantSpec(every))
    assert fingerprint_cache(whole) == fingerprint_cache(prefill)
    # A transplant written into llama.cpp continues exactly as the donor's own cache does.
    donor = continue_from(engine, prefill, live.prefix[-1], 6, frozenset())
    moved = continue_from(engine, whole, live.prefix[-1], 6, frozenset())
    assert moved == donor
    partial = transplant(prefill, live.state, TransplantSpec((0,), "k"))
    read_back = engine.snapshot(engine.to_cache(partial))
    assert fingerprint_cache(read_back) == fingerprint_cache(partial)


def test_stale_cache_is_refused(engine):
    from stagereplay.engines.llamacpp.binding import LlamaCppError

    first = engine.empty_cache()
    engine.empty_cache()
    with pytest.raises(LlamaCppError, match="another sequence"):
        engine.forward([1], first)


def test_reconfigure_to_its_own_settings_opens_a_new_context(engine):
    """E6's llama.cpp controls reconfigure to the run's own settings: that is still a new context, as a test
    level gets, never a silent no-op."""
    from stagereplay.engines.llamacpp.binding import LlamaCppError

    cache = engine.empty_cache()
    old, settings = engine.context, engine.settings
    engine.reconfigure()
    assert engine.context is not old and engine.settings == settings
    with pytest.raises(LlamaCppError, match="another sequence"):
        engine.forward([1], cache)


# factor -> the engine calls its control level must make (the test machinery) and must not make.
CONTROL_MACHINERY = {
    "flash_attn": ({"reconfigure"}, set()),
    "cache_type": ({"reconfigure", "converted"}, set()),
    "ubatch": ({"reconfigure"}, set()),
    "batch": ({"reconfigure", "batch_forward", "batch_row", "batch_of"}, {"forward"}),
    "threads": ({"use_threads"}, set()),
    "chunk": ({"forward"}, set()),
    "prefix_reuse": ({"truncate"}, set()),
}


@pytest.mark.parametrize("factor", sorted(CONTROL_MACHINERY))
def test_controls_reproduce_the_reference_through_their_machinery(engine, factor, tmp_path, monkeypatch):
    """Each llama.cpp factor's control level, run by its setting as a test level is, builds the reference's
    bytes and continues like it, and goes through the factor's machinery to do so."""
    from stagereplay.design.factors import FACTOR_OBJECTS, Level
    from stagereplay.engines.runtime import Runtime
    from stagereplay.experiments import batch_settings, factor_settings  # noqa: F401 - every setting registered
    from stagereplay.experiments.level_job import LevelJob, Prefix
    from stagereplay.experiments.setting import Setting, level_setting
    from stagereplay.ledger.store import ObjectStore

    runtime = Runtime(precision=engine.settings.cache_type, device="cpu", threads=1)
    prefix = Prefix("item-0", tuple(range(5, 40)), 12, False)
    companion = Prefix("item-1", tuple(range(9, 30)), 8, False)
    reference = Setting(engine, 6, frozenset())
    built = reference.build(prefix)
    expected = reference.read(prefix, built.state, None)
    seen = []
    must, must_not = CONTROL_MACHINERY[factor]
    for name in sorted(must | must_not):
        method = getattr(engine, name)

        def spy(*args, _name=name, _method=method, **kwargs):
            seen.append(_name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(engine, name, spy)
    prefixes = {p.item_id: p for p in (prefix, companion)}
    job = LevelJob(engine, runtime, 6, frozenset(), prefixes, ObjectStore(tmp_path), {"fingerprint": "f"})
    control = FACTOR_OBJECTS[factor].control({"threads": 1, "precision": runtime.precision, "flash_attn": False})
    test = level_setting(Level(factor, control, control=True), job)
    test_built = test.build(prefix)
    state = test.for_reference(test_built.state)
    if factor not in ("ubatch", "chunk", "prefix_reuse"):  # build-only factors read as the reference does
        assert test.read(prefix, test.for_test(built.state), test_built).tokens == expected.tokens
    assert must <= set(seen) and not must_not & set(seen), seen
    assert fingerprint_cache(state).digest == fingerprint_cache(built.state).digest
    assert reference.read(prefix, state, None).tokens == expected.tokens
