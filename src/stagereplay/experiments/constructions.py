"""Constructions of the boundary state from the same integer tokens.

The boundary state is the K/V cache over the prefix *without its last token*,
plus that last token as the pending input; every continuation starts by
feeding the pending token. The cache is then the only carried state, so two
constructions differ only where their caches differ, and a cache can be
transplanted from one to the other.

- ``live``: prefill the prompt, decode greedily to the stage boundary; the
  cache as it stood when generation reached the boundary.
- ``prefill``: one forward over the whole prefix (less the pending token).
- ``incremental``: prefill the prompt, then feed the saved prefix tokens one
  at a time — the operation sequence of ``live``.
- ``chunked:N``: prefill the prefix in chunks of N tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from stagereplay.design.names import ConstructionError, parse_construction
from stagereplay.engines.base import Engine
from stagereplay.experiments.decode import Decoded, generate_greedy
from stagereplay.ledger.kvstate import KVState
from stagereplay.ledger.text import text_of


@dataclass(frozen=True)
class StageBoundary:
    """Where the reasoning stage ends: a marker string and/or a token budget, whichever comes first."""

    max_new_tokens: int
    marker: str | None = None


@dataclass(frozen=True)
class MarkerMatcher:
    """Does the generated text end with the stage marker?

    Two ways, because a marker is either one vocabulary entry or running text:
    ``token_ids`` — the generated tokens end with the tokenizer's own encoding of
    the marker (the only way to see an added special token such as ``</think>``,
    which a decode that skips special tokens drops); ``text`` — the marker appears
    in the decoded tail, special tokens kept, for a marker the model spelled with
    other tokens.
    """

    marker: str
    token_ids: tuple[int, ...]
    decode: Callable[[list[int]], str]  # ledger.text.text_of: special tokens kept
    window: int  # generated tokens decoded per step

    @classmethod
    def for_tokenizer(cls, marker: str, tokenizer) -> MarkerMatcher:
        token_ids = tuple(tokenizer.encode(marker, add_special_tokens=False))
        # Every token carries at least one byte of text, so the last len(bytes) tokens hold any
        # occurrence ending in the newest token; the margin covers a character cut in half or a
        # leading space dropped at the window's start. Decoding the whole stage each step would
        # make a long stage quadratic.
        window = len(marker.encode("utf-8")) + 4
        return cls(marker, token_ids, lambda tokens: text_of(tokenizer, tokens), window)

    def match(self, tokens: list[int]) -> str | None:
        """ "token_ids", "text" or None: how the marker ends ``tokens``, checked after each new token."""
        if self.token_ids and tuple(tokens[-len(self.token_ids) :]) == self.token_ids:
            return "token_ids"
        if self.marker in self.decode(list(tokens[-self.window :])):
            return "text"
        return None


@dataclass(frozen=True)
class LiveRun:
    state: KVState  # cache at the boundary
    prefix: tuple[int, ...]  # prompt + generated stage tokens; the last one is pending
    reasoning: Decoded  # the generated stage tokens and why the stage ended
    marker_match: str | None = None  # "token_ids" or "text" when the stage ended at the marker


def build_live(
    engine: Engine,
    prompt: list[int],
    boundary: StageBoundary,
    eos_ids: Collection[int],
    tokenizer,
    on_token: Callable[[], None] | None = None,
) -> LiveRun:
    """Generate from the prompt to the stage boundary, keeping the live cache."""
    cache = engine.empty_cache()
    matcher = MarkerMatcher.for_tokenizer(boundary.marker, tokenizer) if boundary.marker else None
    stop_at_marker = (lambda tokens: matcher.match(tokens) is not None) if matcher else None
    reasoning = generate_greedy(
        engine, cache, prompt, boundary.max_new_tokens, eos_ids, stop_after=stop_at_marker, on_token=on_token
    )
    # Asked again rather than remembered from the loop: match is a pure function of the tokens.
    marker_match = matcher.match(list(reasoning.tokens)) if reasoning.stop == "marker" else None
    # The last generated token was chosen but never fed: it is the pending input,
    # and the cache covers exactly the prompt and the generated tokens before it.
    return LiveRun(
        state=engine.snapshot(cache),
        prefix=(*prompt, *reasoning.tokens),
        reasoning=reasoning,
        marker_match=marker_match,
    )


def build_boundary_state(engine: Engine, prefix: list[int], construction: str, prompt_length: int) -> KVState:
    """The boundary cache over ``prefix[:-1]`` built by ``construction`` (not ``live``)."""
    return build_boundary(engine, prefix, construction, prompt_length)[1]


def build_boundary(engine: Engine, prefix: list[int], construction: str, prompt_length: int) -> tuple[object, KVState]:
    """``build_boundary_state``, with the engine's cache it was built in (still live: a request may go on from it)."""
    kind, chunk = parse_construction(construction)
    if kind == "live":
        raise ConstructionError("the live construction is generated, not rebuilt — use build_live")
    if not 0 < prompt_length < len(prefix):
        raise ConstructionError(f"prompt length {prompt_length} must lie inside the prefix of {len(prefix)} tokens")
    context = list(prefix[:-1])
    if kind == "prefill":
        pieces = [context]
    elif kind == "incremental":
        pieces = [context[:prompt_length]] + [[token] for token in context[prompt_length:]]
    else:
        pieces = [context[start : start + chunk] for start in range(0, len(context), chunk)]
    cache = engine.empty_cache()
    with torch.inference_mode():
        for piece in pieces:
            engine.feed(piece, cache)
    return cache, engine.snapshot(cache)
