"""Greedy decoding at batch size 1, one token per forward, with the margin of every choice.

The margin (top-1 minus top-2 logit, in float32) is kept for each step so that
a divergence can later be traced to the near-tie that flipped it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from . import cache as kv


@dataclass(frozen=True)
class Decoded:
    tokens: tuple[int, ...]
    margins: tuple[float, ...]  # top1 - top2 logit at each emitted token
    stop: (
        str  # "eos", "budget", or the caller's stop_reason: "marker" (the stage), "left_both" (a transplant), "stopped"
    )


def greedy_choice(logits: torch.Tensor) -> tuple[int, float]:
    """argmax (lowest index on exact ties, as torch defines it) and its margin over the runner-up."""
    top = torch.topk(logits, k=2)
    return int(torch.argmax(logits)), float(top.values[0] - top.values[1])


def decode_greedy(
    model,
    cache,
    logits: torch.Tensor,
    max_new_tokens: int,
    eos_ids: Collection[int],
    stop_after: Callable[[list[int]], bool] | None = None,
    on_token: Callable[[], None] | None = None,
    stop_reason: str = "marker",
) -> Decoded:
    """Choose from ``logits``, feed the choice, repeat: until EOS, the budget or ``stop_after``
    (which ends decoding with ``stop_reason``).

    The last emitted token is never fed, so on return ``cache`` covers every
    input before it: exactly the boundary state when decoding ends a stage.
    """
    tokens: list[int] = []
    margins: list[float] = []
    device = next(model.parameters()).device
    with torch.inference_mode():
        while True:
            token, margin = greedy_choice(logits)
            tokens.append(token)
            margins.append(margin)
            if on_token is not None:
                on_token()
            if token in eos_ids:
                return Decoded(tuple(tokens), tuple(margins), "eos")
            if stop_after is not None and stop_after(tokens):
                return Decoded(tuple(tokens), tuple(margins), stop_reason)
            if len(tokens) >= max_new_tokens:
                return Decoded(tuple(tokens), tuple(margins), "budget")
            logits = kv.forward(model, torch.tensor([[token]], device=device), cache)


def continue_from(
    model,
    state: kv.KVState,
    pending: int,
    max_new_tokens: int,
    eos_ids: Collection[int],
    on_token: Callable[[], None] | None = None,
    stop_after: Callable[[list[int]], bool] | None = None,
    stop_reason: str = "stopped",
) -> Decoded:
    """The suffix: feed the pending token on a copy of the boundary cache, then decode greedily."""
    device = next(model.parameters()).device
    cache = kv.to_cache(state, model)
    with torch.inference_mode():
        logits = kv.forward(model, torch.tensor([[pending]], device=device), cache)
    return decode_greedy(
        model, cache, logits, max_new_tokens, eos_ids, stop_after=stop_after, on_token=on_token, stop_reason=stop_reason
    )
