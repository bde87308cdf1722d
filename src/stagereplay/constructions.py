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

from . import cache as kv
from .decode import Decoded, decode_greedy
from .plan import ConstructionError, parse_construction


@dataclass(frozen=True)
class StageBoundary:
    """Where the reasoning stage ends: a marker string and/or a token budget, whichever comes first."""

    max_new_tokens: int
    marker: str | None = None


@dataclass(frozen=True)
class LiveRun:
    state: kv.KVState  # cache at the boundary
    prefix: tuple[int, ...]  # prompt + generated stage tokens; the last one is pending
    reasoning: Decoded  # the generated stage tokens and why the stage ended


def build_live(
    model,
    prompt: list[int],
    boundary: StageBoundary,
    eos_ids: Collection[int],
    decode_text: Callable[[list[int]], str],
    on_token: Callable[[], None] | None = None,
) -> LiveRun:
    """Generate from the prompt to the stage boundary, keeping the live cache."""
    device = next(model.parameters()).device
    cache = kv.empty_cache(model)
    with torch.inference_mode():
        logits = kv.forward(model, torch.tensor([prompt], device=device), cache)
    stop_at_marker = None
    if boundary.marker:
        marker = boundary.marker
        stop_at_marker = lambda tokens: marker in decode_text(tokens)  # noqa: E731
    reasoning = decode_greedy(
        model, cache, logits, boundary.max_new_tokens, eos_ids, stop_after=stop_at_marker, on_token=on_token
    )
    # The last generated token was chosen but never fed: it is the pending input,
    # and the cache covers exactly the prompt and the generated tokens before it.
    return LiveRun(state=kv.snapshot(cache), prefix=(*prompt, *reasoning.tokens), reasoning=reasoning)


def build_boundary_state(model, prefix: list[int], construction: str, prompt_length: int) -> kv.KVState:
    """The boundary cache over ``prefix[:-1]`` built by ``construction`` (not ``live``)."""
    kind, chunk = parse_construction(construction)
    if kind == "live":
        raise ConstructionError("the live construction is generated, not rebuilt — use build_live")
    if not 0 < prompt_length < len(prefix):
        raise ConstructionError(f"prompt length {prompt_length} must lie inside the prefix of {len(prefix)} tokens")
    device = next(model.parameters()).device
    context = list(prefix[:-1])
    if kind == "prefill":
        pieces = [context]
    elif kind == "incremental":
        pieces = [context[:prompt_length]] + [[token] for token in context[prompt_length:]]
    else:
        pieces = [context[start:start + chunk] for start in range(0, len(context), chunk)]
    cache = kv.empty_cache(model)
    with torch.inference_mode():
        for piece in pieces:
            kv.forward(model, torch.tensor([piece], device=device), cache)
    return kv.snapshot(cache)
