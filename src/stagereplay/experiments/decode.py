"""Greedy decoding at batch size 1, one token per forward, with the margin of every choice;
and the forced-choice readout from the state a continuation ends in.

The margin (top-1 minus top-2 logit, in float32) is kept for each step so that
a divergence can later be traced to the near-tie that flipped it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

import torch

from stagereplay.engines.base import Engine
from stagereplay.ledger.kvstate import KVState


@dataclass(frozen=True)
class ReadoutCue:
    """What the readout feeds and scores: the cue's token ids and each choice letter's token id."""

    tokens: tuple[int, ...]
    letters: tuple[str, ...]
    letter_ids: tuple[int, ...]


@dataclass(frozen=True)
class Readout:
    answer: str  # the choice letter with the highest logit after the cue
    margin: float  # its logit minus the runner-up letter's


@dataclass(frozen=True)
class Decoded:
    tokens: tuple[int, ...]
    margins: tuple[float, ...]  # top1 - top2 logit at each emitted token
    stop: (
        str  # "eos", "budget", or the caller's stop_reason: "marker" (the stage), "left_both" (a transplant), "stopped"
    )
    readout: Readout | None = None  # when the caller asked for one
    # The logits the first token was chosen from (float32, on the host): E6 compares a cell's first read of
    # the boundary cache with the reference's. None where nothing was decoded.
    first_logits: torch.Tensor | None = field(default=None, compare=False, repr=False)
    top_logits: tuple[float, ...] = ()  # the top-1 logit at each emitted token (one bf16 step is set by its binade)
    note: str = ""  # what else ran while it was read, in words (E6: a read under concurrent load records its load)


def greedy_choice(logits: torch.Tensor) -> tuple[int, float]:
    """argmax (lowest index on exact ties, as torch defines it) and its margin over the runner-up."""
    token, margin, _ = greedy_step(logits)
    return token, margin


def greedy_step(logits: torch.Tensor) -> tuple[int, float, float]:
    """``greedy_choice`` and the top-1 logit itself."""
    top = torch.topk(logits, k=2)
    return int(torch.argmax(logits)), float(top.values[0] - top.values[1]), float(top.values[0])


def decode_greedy(
    engine: Engine,
    cache,
    logits: torch.Tensor,
    max_new_tokens: int,
    eos_ids: Collection[int],
    *,
    stop_after: Callable[[list[int]], bool] | None = None,
    stop_reason: str = "marker",
    on_token: Callable[[], None] | None = None,
    feed: Callable[[int], torch.Tensor] | None = None,
) -> Decoded:
    """Choose from ``logits``, feed the choice, repeat: until EOS, the budget or ``stop_after``
    (which ends decoding with ``stop_reason``).

    The last emitted token is never fed, so on return ``cache`` covers every
    input before it: exactly the boundary state when decoding ends a stage.
    ``feed`` replaces feeding ``cache`` one token (a batch feeds its other rows too): it takes the
    chosen token and returns the next logits.
    The options are keyword-only (here and in ``continue_from``): ``stop_after``, ``on_token`` and ``feed``
    are all callables, so one passed in another's place would run without an error.
    """
    if feed is None:

        def feed(token: int) -> torch.Tensor:
            return engine.forward([token], cache)

    tokens: list[int] = []
    margins: list[float] = []
    tops: list[float] = []
    # A copy: a batch's row is a view of its batch's logits, and an engine may reuse its logits buffer.
    first_logits = logits.detach().to("cpu", torch.float32).clone()

    def decoded(stop: str) -> Decoded:
        return Decoded(tuple(tokens), tuple(margins), stop, first_logits=first_logits, top_logits=tuple(tops))

    with torch.inference_mode():
        while True:
            token, margin, top = greedy_step(logits)
            tokens.append(token)
            margins.append(margin)
            tops.append(top)
            if on_token is not None:
                on_token()
            if token in eos_ids:
                return decoded("eos")
            if stop_after is not None and stop_after(tokens):
                return decoded(stop_reason)
            if len(tokens) >= max_new_tokens:
                return decoded("budget")
            logits = feed(token)


def generate_greedy(
    engine: Engine,
    cache,
    tokens: list[int],
    max_new_tokens: int,
    eos_ids: Collection[int],
    *,
    stop_after: Callable[[list[int]], bool] | None = None,
    stop_reason: str = "marker",
    on_token: Callable[[], None] | None = None,
) -> Decoded:
    """Feed ``tokens`` into ``cache``, then ``decode_greedy``: in one call of the engine's own loop where it has
    one (``Engine.generate``: a server's single request; no first logits nor top-1 logits come back then),
    else a forward and a forward per token."""
    generated = engine.generate(cache, tokens, max_new_tokens, eos_ids, stop_after=stop_after)
    if generated is None:
        with torch.inference_mode():
            logits = engine.forward(tokens, cache)
        return decode_greedy(
            engine,
            cache,
            logits,
            max_new_tokens,
            eos_ids,
            stop_after=stop_after,
            stop_reason=stop_reason,
            on_token=on_token,
        )
    chosen, margins, stop = generated
    for _ in chosen:
        if on_token is not None:
            on_token()
    return Decoded(tuple(chosen), tuple(margins), stop_reason if stop == "stopped" else stop)


def read_out(engine: Engine, cache, pending: int, cue: ReadoutCue) -> Readout:
    """Feed the unfed last token and the cue in one forward; the choice letter with the highest logit.

    Only the letters' logits are compared (ties go to the earlier letter, as argmax breaks them), so
    every continuation gets a label, whatever it wrote. Appends to ``cache``.
    """
    with torch.inference_mode():
        logits = engine.forward([pending, *cue.tokens], cache)
    letter_logits = logits[list(cue.letter_ids)]
    best, margin = greedy_choice(letter_logits)
    return Readout(cue.letters[best], margin)


def read_out_state(engine: Engine, state: KVState, pending: int, cue: ReadoutCue) -> Readout:
    """The readout from a boundary state (a copy of it), for a stage that ended the answer itself."""
    return read_out(engine, engine.to_cache(state), pending, cue)


def continue_from(
    engine: Engine,
    state: KVState,
    pending: int,
    max_new_tokens: int,
    eos_ids: Collection[int],
    *,
    stop_after: Callable[[list[int]], bool] | None = None,
    stop_reason: str = "stopped",
    on_token: Callable[[], None] | None = None,
    readout: ReadoutCue | None = None,
) -> Decoded:
    """The suffix: feed the pending token on a copy of the boundary cache, then decode greedily;
    with ``readout``, read the forced choice from the state the suffix ends in."""
    cache = engine.to_cache(state)
    decoded = generate_greedy(
        engine,
        cache,
        [pending],
        max_new_tokens,
        eos_ids,
        stop_after=stop_after,
        on_token=on_token,
        stop_reason=stop_reason,
    )
    if readout is None:
        return decoded
    # decode_greedy never feeds its last token: the cache covers everything before it.
    return replace(decoded, readout=read_out(engine, cache, decoded.tokens[-1], readout))
