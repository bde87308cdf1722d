"""E5 semantics on the tiny Qwen2: a transplanted cache carries the donor's continuation."""

import pytest
import torch

from stagereplay.design.names import SweepPlan, TransplantError, outcome_blind_sample
from stagereplay.experiments.constructions import StageBoundary, build_live
from stagereplay.experiments.decode import continue_from
from stagereplay.experiments.transplants import (
    TransplantSpec,
    left_both,
    outcome,
    select_divergent,
    sweep_specs,
    transplant,
)
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState

PROMPT = [257, 10, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 258, 10]


def perturbed(state: KVState, scale: float = 3.0) -> KVState:
    """A recipient whose cache differs from the donor's in every layer (seeded noise)."""
    generator = torch.Generator().manual_seed(1)
    noise = lambda t: t + scale * torch.randn(t.shape, generator=generator).to(t.dtype)  # noqa: E731
    return KVState(tuple(noise(k) for k in state.keys), tuple(noise(v) for v in state.values))


@pytest.fixture(scope="module")
def divergent_pair(tiny_fp32):
    live = build_live(tiny_fp32, PROMPT, StageBoundary(10), frozenset(), tiny_fp32.tokenizer)
    donor, recipient = live.state, perturbed(live.state)
    pending = live.prefix[-1]
    donor_suffix = continue_from(tiny_fp32, donor, pending, 12, frozenset()).tokens
    recipient_suffix = continue_from(tiny_fp32, recipient, pending, 12, frozenset()).tokens
    assert donor_suffix != recipient_suffix, "the perturbation must change the continuation"
    return donor, recipient, pending, list(donor_suffix), list(recipient_suffix)


def test_all_layer_transplant_follows_the_donor_both_ways(tiny_fp32, divergent_pair):
    donor, recipient, pending, donor_suffix, recipient_suffix = divergent_pair
    every = TransplantSpec(tuple(range(donor.num_layers)))
    forward = transplant(donor, recipient, every)
    assert fingerprint_cache(forward) == fingerprint_cache(donor)
    tokens = list(continue_from(tiny_fp32, forward, pending, 12, frozenset()).tokens)
    assert outcome(tokens, donor_suffix, recipient_suffix) == "follows_donor"
    backward = transplant(recipient, donor, every)
    tokens = list(continue_from(tiny_fp32, backward, pending, 12, frozenset()).tokens)
    assert outcome(tokens, recipient_suffix, donor_suffix) == "follows_donor"


def test_partial_transplants_replace_exactly_the_chosen_part(divergent_pair):
    donor, recipient, *_ = divergent_pair
    recipient_before = fingerprint_cache(recipient)
    keys_only = transplant(donor, recipient, TransplantSpec((1,), "k"))
    assert torch.equal(keys_only.keys[1], donor.keys[1]) and torch.equal(keys_only.values[1], recipient.values[1])
    assert torch.equal(keys_only.keys[0], recipient.keys[0])
    window = transplant(donor, recipient, TransplantSpec((0, 1), "kv", last_positions=3))
    assert torch.equal(window.keys[0][..., -3:, :], donor.keys[0][..., -3:, :])
    assert torch.equal(window.keys[0][..., :-3, :], recipient.keys[0][..., :-3, :])
    assert fingerprint_cache(recipient) == recipient_before  # the recipient itself is untouched


def as_bf16(state: KVState) -> KVState:
    return KVState(
        tuple(key.to(torch.bfloat16) for key in state.keys), tuple(v.to(torch.bfloat16) for v in state.values)
    )


def test_cross_precision_transplant_casts_to_the_recipient_dtype(divergent_pair):
    donor, recipient, *_ = divergent_pair
    bf16_donor = as_bf16(donor)
    result = transplant(bf16_donor, recipient, TransplantSpec((0,)))
    assert all(t.dtype == torch.float32 for t in result.keys + result.values)
    # The donor's bf16 rounding is carried into the fp32 state: equal to the rounded values, not the originals.
    rounded = donor.keys[0].to(torch.bfloat16).to(torch.float32)
    assert torch.equal(result.keys[0], rounded) and not torch.equal(result.keys[0], donor.keys[0])
    assert torch.equal(result.keys[1], recipient.keys[1])  # layer 1 stays the recipient's
    # The other way, an fp32 donor is rounded into a bf16 recipient.
    back = transplant(donor, as_bf16(recipient), TransplantSpec((0, 1)))
    assert all(t.dtype == torch.bfloat16 for t in back.keys + back.values)
    assert torch.equal(back.values[1].float(), donor.values[1].to(torch.bfloat16).float())
    assert not torch.equal(back.values[1].float(), donor.values[1])


@pytest.mark.parametrize(
    "spec,message",
    [
        (TransplantSpec(()), "empty layer set"),
        (TransplantSpec((2,)), "layer 2 out of range"),
        (TransplantSpec((-1,)), "out of range"),
        (TransplantSpec((0,), "q"), "unknown cache part"),
        (TransplantSpec((0,), "kv", 10_000), "does not fit"),
    ],
)
def test_bad_transplants_fail_with_one_line(divergent_pair, spec, message):
    donor, recipient, *_ = divergent_pair
    with pytest.raises(TransplantError, match=message):
        transplant(donor, recipient, spec)


def test_donor_of_another_shape_is_refused(divergent_pair):
    donor, recipient, *_ = divergent_pair
    shorter = KVState(tuple(k[..., :-1, :] for k in donor.keys), tuple(v[..., :-1, :] for v in donor.values))
    with pytest.raises(TransplantError, match="differ in layers or shapes"):
        transplant(shorter, recipient, TransplantSpec((0,)))


def test_sweep_specs_cover_the_design():
    labels = [spec.label() for spec in sweep_specs(4, SweepPlan("all", (2,), True, (3,)))]
    assert labels[0] == "layers=0-3 kv=kv positions=all"
    assert "layers=2 kv=kv positions=all" in labels
    assert "layers=0-1 kv=kv positions=all" in labels and "layers=2-3 kv=kv positions=all" in labels
    assert "layers=0-3 kv=k positions=all" in labels and "layers=0-3 kv=v positions=all" in labels
    assert "layers=0-3 kv=kv positions=last3" in labels
    assert len(labels) == len(set(labels)) == 1 + 4 + 2 + 2 + 1
    assert [s.label() for s in sweep_specs(4, SweepPlan("none"))] == [
        "layers=0-3 kv=kv positions=all",
        "layers=0-3 kv=k positions=all",
        "layers=0-3 kv=v positions=all",
    ]


def test_outcomes_and_early_stop():
    assert outcome([1, 2], [1, 2], [1, 3]) == "follows_donor"
    assert outcome([1, 3], [1, 2], [1, 3]) == "follows_recipient"
    assert outcome([1, 4], [1, 2], [1, 3]) == "neither"
    stop = left_both([1, 2, 5], [1, 3, 5])
    assert not stop([1]) and not stop([1, 2]) and stop([1, 4])


def test_outcome_blind_sample_is_seeded_and_bounded():
    ids = [f"arith-{i:03d}" for i in range(20)]
    first = outcome_blind_sample(ids, 5, seed=3)
    assert first == outcome_blind_sample(list(reversed(ids)), 5, seed=3)
    assert len(set(first)) == 5 and set(first) <= set(ids)
    assert first != outcome_blind_sample(ids, 5, seed=4)
    with pytest.raises(ValueError, match="larger than"):
        outcome_blind_sample(ids, 21, seed=0)


def test_select_divergent_takes_the_first_k_by_id():
    live = [{"item_id": i, "suffix_object": s} for i, s in (("c", "1"), ("a", "2"), ("b", "3"), ("d", "4"))]
    prefill = [{"item_id": i, "suffix_object": s} for i, s in (("a", "x"), ("b", "3"), ("c", "y"), ("d", "z"))]
    assert select_divergent(live, prefill, None) == ["a", "c", "d"]
    assert select_divergent(live, prefill, 2) == ["a", "c"]
