import pytest
import torch

from stagereplay import cache as kv
from stagereplay.constructions import StageBoundary, build_boundary_state, build_live
from stagereplay.decode import continue_from
from stagereplay.plan import ConstructionError, parse_construction
from stagereplay.shards import eos_ids

PROMPT = [257, 10, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 258, 10]


def text_of(loaded):
    return lambda tokens: loaded.tokenizer.decode(list(tokens), skip_special_tokens=True)


def live_run(loaded, max_new_tokens=16, marker=None):
    return build_live(loaded.model, PROMPT, StageBoundary(max_new_tokens, marker), frozenset(), loaded.tokenizer)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_live_and_prefill_give_identical_shapes_over_identical_tokens(precision, request):
    loaded = request.getfixturevalue(f"tiny_{precision}")
    live = live_run(loaded)
    prefill = build_boundary_state(loaded.model, list(live.prefix), "prefill", len(PROMPT))
    assert live.reasoning.stop == "budget" and len(live.reasoning.tokens) == 16
    # The boundary cache covers the prefix less its pending last token.
    assert live.state.num_positions == prefill.num_positions == len(live.prefix) - 1
    assert live.state.num_layers == prefill.num_layers == 2
    for a, b in zip(live.state.keys + live.state.values, prefill.keys + prefill.values):
        assert a.shape == b.shape and a.dtype == b.dtype == loaded.model.dtype


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_incremental_is_bit_exact_with_live(precision, request):
    loaded = request.getfixturevalue(f"tiny_{precision}")
    live = live_run(loaded)
    incremental = build_boundary_state(loaded.model, list(live.prefix), "incremental", len(PROMPT))
    assert kv.fingerprint_cache(incremental) == kv.fingerprint_cache(live.state)


def test_prefill_cache_is_close_to_live_but_chunked_1_equals_incremental(tiny_fp32):
    live = live_run(tiny_fp32)
    prefill = build_boundary_state(tiny_fp32.model, list(live.prefix), "prefill", len(PROMPT))
    for a, b in zip(live.state.keys, prefill.keys):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    whole = build_boundary_state(tiny_fp32.model, list(live.prefix), "chunked:1000", len(PROMPT))
    assert kv.fingerprint_cache(whole) == kv.fingerprint_cache(prefill)


def test_continuation_leaves_the_boundary_state_intact(tiny_fp32):
    live = live_run(tiny_fp32)
    before = kv.fingerprint_cache(live.state)
    first = continue_from(tiny_fp32.model, live.state, live.prefix[-1], 6, frozenset())
    second = continue_from(tiny_fp32.model, live.state, live.prefix[-1], 6, frozenset())
    assert kv.fingerprint_cache(live.state) == before
    assert first == second and len(first.tokens) == 6 and first.stop == "budget"


def test_continuing_live_equals_uninterrupted_generation(tiny_fp32):
    """The suffix after the boundary is what the decoder would have produced had it never stopped."""
    long = live_run(tiny_fp32, max_new_tokens=20)
    short = live_run(tiny_fp32, max_new_tokens=12)
    suffix = continue_from(tiny_fp32.model, short.state, short.prefix[-1], 8, frozenset())
    assert short.prefix + suffix.tokens == long.prefix


def test_boundary_at_marker_ends_on_the_token_that_completes_it(tiny_fp32):
    free = live_run(tiny_fp32, max_new_tokens=16)
    generated = free.prefix[len(PROMPT):]
    text = text_of(tiny_fp32)
    # Choose as marker the text of tokens 5..6, so the stage must end at the 7th token at the latest.
    marker = text(generated[5:7])
    assume_earliest = next(n for n in range(1, 17) if marker in text(generated[:n]))
    stopped = live_run(tiny_fp32, max_new_tokens=16, marker=marker)
    assert stopped.reasoning.stop == "marker"
    assert stopped.prefix == free.prefix[: len(PROMPT) + assume_earliest]
    assert stopped.state.num_positions == len(stopped.prefix) - 1


def test_boundary_at_eos(tiny_fp32):
    free = live_run(tiny_fp32, max_new_tokens=8)
    third = free.prefix[len(PROMPT) + 2]
    stopped = build_live(tiny_fp32.model, PROMPT, StageBoundary(8), frozenset({third}), tiny_fp32.tokenizer)
    assert stopped.reasoning.stop == "eos"
    assert stopped.prefix[-1] == third and len(stopped.prefix) <= len(PROMPT) + 3


def test_eos_ids_include_the_tokenizer_eos(tiny_fp32):
    assert tiny_fp32.tokenizer.eos_token_id in eos_ids(tiny_fp32)


@pytest.mark.parametrize("name,expected", [
    ("live", ("live", None)), ("prefill", ("prefill", None)),
    ("incremental", ("incremental", None)), ("chunked:16", ("chunked", 16)),
])
def test_parse_construction(name, expected):
    assert parse_construction(name) == expected


@pytest.mark.parametrize("name", ["chunked:0", "chunked:x", "chunked:", "replay", "Prefill"])
def test_bad_construction_names_are_rejected(name):
    with pytest.raises(ConstructionError, match="chunked:N|chunk size 0"):
        parse_construction(name)
