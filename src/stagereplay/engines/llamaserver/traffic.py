"""Whole greedy requests to a llama-server, alone or amid other clients' requests on a seeded schedule.

``ask`` sends one greedy request of token ids and keeps what an operator's client gets back: the tokens, the
top-1 minus top-2 log-probability at each step (pre-sampling: the difference of two log-probabilities of one
softmax is the difference of the two logits, so the margin is in logits), how many prompt positions the server
took from its cache (``timings.cache_n``) and the wall time. ``amid_clients`` sends the item's request with
``others`` each sent by a client of its own, their arrivals drawn from a seeded uniform schedule over
[-L, L] seconds around the item's arrival (L: the item's alone latency), so some are generating when it
arrives and some arrive while it runs; the item's answer keeps what each other client got back (its tokens' count and
wall time), so the server's throughput over the load (every client's tokens over the span from the first arrival to
the last answer) is had from one row. No request names a slot unless the server is a guest's (``slots``):
a deployed server picks one as it does for any client. ``at_once`` sends the same request several times at the same
instant (one server, several slots, one prompt: upstream llama.cpp issue #7052's situation).

No torch here.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from stagereplay.engines.llamaserver.build import LlamaServerError
from stagereplay.engines.llamaserver.client import GREEDY, ServerClient, greedy_margin


@dataclass
class Answer:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 log-probability at each step (logits)
    seconds: float
    reused: int  # prompt positions the server took from its cache (timings.cache_n)
    decoded: int  # prompt positions it computed (timings.prompt_n)
    others: list[str] = field(default_factory=list)  # the other clients' items, in order of arrival
    arrivals: list[float] = field(default_factory=list)  # their arrivals, seconds from the item's
    others_generated: list[int] = field(default_factory=list)  # the tokens each of them got back, by arrival
    others_seconds: list[float] = field(default_factory=list)  # each one's wall time, by arrival


def ask(server: ServerClient, prompt: list[int], budget: int, cache_prompt: bool, slot: int | None = None) -> Answer:
    """One greedy request of up to ``budget`` tokens, ending at an end-of-generation token as a client's does (with
    end-of-generation ignored the server masks it after the log-probabilities are taken, so the token it returns
    would not be the highest logit where the model would have ended)."""
    start = time.monotonic()
    payload = {
        "prompt": list(prompt),
        "n_predict": budget,
        "cache_prompt": cache_prompt,
        "n_probs": 2,
        "post_sampling_probs": False,
        "return_tokens": True,
        **GREEDY,
    }
    if slot is not None:
        payload["id_slot"] = server.checked_slot(slot)
    answer = server.request("/completion", payload)
    seconds = time.monotonic() - start
    tokens = list(answer.get("tokens", []))
    steps = answer.get("completion_probabilities") or []
    if len(steps) != len(tokens):
        raise LlamaServerError(
            f"llama-server returned log-probabilities for {len(steps)} of {len(tokens)} tokens — margins need all"
        )
    margins = [greedy_margin(token, step) for token, step in zip(tokens, steps)]
    timings = answer.get("timings", {})
    return Answer(tokens, margins, seconds, int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0)))


def at_once(
    server: ServerClient, prompt: list[int], budget: int, copies: int, slots: tuple[int, ...] | None = None
) -> list[Answer]:
    """The same greedy request sent ``copies`` times at the same instant, each by a client of its own (released
    together by a barrier), in the order sent. ``slots`` (a guest's): copy i on slot i modulo their count; None:
    the server places each, as it places any client's."""
    barrier = threading.Barrier(copies)

    def client(index: int) -> Answer:
        barrier.wait()
        return ask(server, prompt, budget, cache_prompt=False, slot=slots[index % len(slots)] if slots else None)

    with ThreadPoolExecutor(max_workers=copies) as pool:
        sent = [pool.submit(client, index) for index in range(copies)]
    return [future.result() for future in sent]


def amid_clients(
    server: ServerClient,
    prompt: list[int],
    others: dict[str, list[int]],
    budget: int,
    latency: float,
    rng: random.Random,
    slots: tuple[int, ...] | None = None,
) -> Answer:
    """The item's request with each of ``others`` sent by its own client on a seeded schedule around its arrival.
    ``slots`` (a guest's): the item on the first, the others on the rest in turn."""
    names = list(others)
    offsets = [rng.uniform(-latency, latency) for _ in names]
    start = time.monotonic() - min([0.0, *offsets])  # the earliest arrival at time 0

    def client(tokens: list[int], at: float, slot: int | None, name: str | None = None) -> Answer:
        time.sleep(max(0.0, start + at - time.monotonic()))
        try:
            return ask(server, tokens, budget, cache_prompt=False, slot=slot)
        except LlamaServerError as error:
            if name is None:
                raise
            raise LlamaServerError(f"another client's request (item {name}) amid the item's: {error}") from None

    def slot_of(index: int) -> int | None:
        if slots is None:
            return None
        return slots[0] if index < 0 else slots[1 + index % (len(slots) - 1)]

    with ThreadPoolExecutor(max_workers=len(names) + 1) as pool:
        sent = [
            pool.submit(client, others[name], offset, slot_of(index), name)
            for index, (name, offset) in enumerate(zip(names, offsets))
        ]
        sent.append(pool.submit(client, prompt, 0.0, slot_of(-1)))
    *theirs, answer = [future.result() for future in sent]  # the first client's failure is raised here
    arrival_order = sorted(zip(offsets, names, theirs), key=lambda entry: (entry[0], entry[1]))
    answer.others = [name for _, name, _ in arrival_order]
    answer.arrivals = [round(offset, 3) for offset, _, _ in arrival_order]
    answer.others_generated = [len(their.tokens) for _, _, their in arrival_order]
    answer.others_seconds = [their.seconds for _, _, their in arrival_order]
    return answer
