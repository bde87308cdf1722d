"""The forced-choice readout: the cue's tokens, one letter per trajectory, deterministic and independent of the cache."""

from __future__ import annotations

import pytest
import torch

from stagereplay.engines.transformers.engine import ModelError
from stagereplay.experiments.decode import ReadoutCue, continue_from, read_out_state
from stagereplay.experiments.prompts import READOUT_CUE, readout_tokens
from stagereplay.inputs.checkpoints import build_byte_tokenizer
from stagereplay.inputs.items import LETTERS

PROMPT = [5, 17, 3, 42, 8, 99, 23]


def boundary(engine, tokens):
    """The boundary state over tokens[:-1], by one prefill."""
    cache = engine.empty_cache()
    with torch.inference_mode():
        engine.forward(tokens[:-1], cache)
    return engine.snapshot(cache)


def test_a_byte_tokenizer_spells_the_space_apart_so_it_goes_into_the_cue():
    tokenizer = build_byte_tokenizer()
    cue, letters = readout_tokens(tokenizer)
    assert tokenizer.decode(cue) == READOUT_CUE + " "
    assert [tokenizer.decode([token]) for token in letters] == list(LETTERS)


def bpe_tokenizer(merges: list[tuple[str, str]]):
    """A real byte-level BPE tokenizer with the given merges (as GPT-2-style vocabularies have " A" tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_a_tokenizer_with_spaced_letter_tokens_scores_them_after_the_bare_cue():
    tokenizer = bpe_tokenizer([("Ġ", letter) for letter in LETTERS])
    cue, letters = readout_tokens(tokenizer)
    assert tokenizer.decode(cue) == READOUT_CUE
    assert [tokenizer.decode([token]) for token in letters] == [f" {letter}" for letter in LETTERS]


def test_a_tokenizer_that_spells_a_letter_with_another_after_the_space_is_refused():
    # " A" merges, but "A" after a space-less cue never stands alone: neither form holds for every letter.
    tokenizer = bpe_tokenizer([("Ġ", "A"), (":", "Ġ")])
    with pytest.raises(ModelError, match="single-token letters"):
        readout_tokens(tokenizer)


def test_the_readout_is_the_highest_letter_logit_of_a_fresh_forward_over_the_whole_text(tiny_fp32):
    """The readout from the continuation's final cache equals the argmax over the letters of one forward over
    prompt + suffix + cue without any cache reuse, and it is the same on a second run."""
    engine, model = tiny_fp32, tiny_fp32.model
    cue = ReadoutCue((11, 12, 13), LETTERS, (30, 31, 32, 33))
    state = boundary(engine, PROMPT)
    first = continue_from(engine, state, PROMPT[-1], 6, eos_ids=(), readout=cue)
    second = continue_from(engine, state, PROMPT[-1], 6, eos_ids=(), readout=cue)
    assert first == second and first.readout is not None
    text = [*PROMPT, *first.tokens, *cue.tokens]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([text])).logits[0, -1].float()
    letter_logits = logits[list(cue.letter_ids)]
    best = int(torch.argmax(letter_logits))
    assert first.readout.answer == LETTERS[best]
    runner_up = torch.topk(letter_logits, 2).values[1]
    assert first.readout.margin == pytest.approx(float(letter_logits[best] - runner_up), abs=1e-4)


def test_a_stage_that_ended_the_answer_reads_out_from_its_boundary_state(tiny_fp32):
    engine, model = tiny_fp32, tiny_fp32.model
    cue = ReadoutCue((11, 12), LETTERS, (30, 31, 32, 33))
    readout = read_out_state(engine, boundary(engine, PROMPT), PROMPT[-1], cue)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[*PROMPT, *cue.tokens]])).logits[0, -1].float()
    assert readout.answer == LETTERS[int(torch.argmax(logits[list(cue.letter_ids)]))]
