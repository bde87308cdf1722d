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
a deployed server picks one as it does for any client. ``at_once`` sends several requests at the same instant: copies
of one prompt (one server, several slots, one prompt: upstream llama.cpp issue #7052's situation), or the item's with
other prompts. Where the server keeps a batch log (``batches``), each answer amid others says whether its pattern's
trigger happened (``trigger``): its prompt prefilled in one step with another (at once), or its decode calls shared
with another client's (amid others); never taken from the schedule.

No torch here.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from stagereplay.engines.llamaserver.batches import company, decode_calls
from stagereplay.engines.llamaserver.build import LlamaServerError
from stagereplay.engines.llamaserver.client import (
    GREEDY_SAMPLING,
    Sampling,
    ServerClient,
    greedy_margin,
    sampled_margin,
)


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
    slot: int | None = None  # the slot that served it (the answer's id_slot)
    # Whether the traffic pattern's trigger happened, from the server's batch log ("met: ...", "not met: ...",
    # "not proven: ..."); "" for a request alone.
    trigger: str = ""


# The proof of a trigger reads the server's own log, written by a thread of its own: read again for up to this long
# until it holds every position of the prompt.
LOG_WAIT_SECONDS = 5.0
NO_BATCH_LOG = "not proven: the server keeps no batch log here (attached, or started without one)"


def trigger(server: ServerClient, mark: int | None, answer: Answer, positions: int, prompt_step: bool) -> str:
    """Whether the request of ``answer`` (a prompt of ``positions`` tokens) had company, from the batch log written
    since ``mark``: ``prompt_step``, its prompt shared a decode call with another prompt (they were prefilled in one
    step); else any of its decode calls held another sequence's tokens (it ran while another did)."""
    if mark is None or answer.slot is None:
        return NO_BATCH_LOG
    # The positions the server took from its cache (a default client's prompt reuse) were not computed: the prompt's
    # step is the rest of it.
    start = min(answer.reused, positions)
    computed = positions - start
    deadline = time.monotonic() + LOG_WAIT_SECONDS
    while True:
        found = company(decode_calls(server.batch_log_since(mark)), answer.slot, positions, start)
        if found.logged == computed or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if found.logged < computed:
        return f"not proven: the batch log holds {found.logged} of the {computed} prompt positions the server computed"
    met = found.prompt_shared if prompt_step else found.any_shared
    return f"{'met' if met else 'not met'}: {found.split}"


def ask(
    server: ServerClient,
    prompt: list[int],
    budget: int,
    cache_prompt: bool,
    slot: int | None = None,
    sampling: Sampling = GREEDY_SAMPLING,
) -> Answer:
    """One request of up to ``budget`` tokens, greedy unless ``sampling`` says otherwise, ending at an
    end-of-generation token as a client's does (with end-of-generation ignored the server masks it after the
    log-probabilities are taken, so the token it returns would not be the highest logit where the model would have
    ended)."""
    start = time.monotonic()
    payload = {
        "prompt": list(prompt),
        "n_predict": budget,
        "cache_prompt": cache_prompt,
        "n_probs": 2,
        "post_sampling_probs": False,
        "return_tokens": True,
        **sampling.fields(),
    }
    if slot is not None:
        payload["id_slot"] = server.checked_slot(slot)
    answer = server.request("/completion", payload)
    seconds = time.monotonic() - start
    steps = answer.get("completion_probabilities") or []
    timings = answer.get("timings", {})
    return _answer(answer.get("tokens", []), steps, seconds, timings, answer.get("id_slot"), sampling)


def _answer(tokens, steps: list[dict], seconds: float, timings: dict, served_on, sampling: Sampling) -> Answer:
    """An answer from the server's token ids, its log-probabilities at each step (``steps``), its timings and the slot
    that served it. The server drops the log-probabilities of a token that ends inside a multi-byte character: a
    greedy answer needs all (one line where one is missing, or where its token is not the step's highest); a sampled
    one, which draws such tokens freely, gets NaN at those steps, its steps matched to its tokens by id."""
    tokens = [int(token) for token in tokens]
    if sampling.greedy:
        if len(steps) != len(tokens):
            raise LlamaServerError(
                f"llama-server returned log-probabilities for {len(steps)} of {len(tokens)} tokens — margins need all"
            )
        margins = [greedy_margin(token, step) for token, step in zip(tokens, steps)]
    else:
        listed = iter(steps)
        step = next(listed, None)
        margins = []
        for token in tokens:
            if step is not None and int(step["id"]) == token:
                margins.append(sampled_margin(token, step))
                step = next(listed, None)
            else:
                margins.append(math.nan)
    return Answer(
        tokens,
        margins,
        seconds,
        int(timings.get("cache_n", 0)),
        int(timings.get("prompt_n", 0)),
        slot=int(served_on) if served_on is not None else None,
    )


def ask_chat(server: ServerClient, messages: list[dict], budget: int, sampling: Sampling = GREEDY_SAMPLING) -> Answer:
    """One request as an OpenAI-compatible client sends it: chat messages on ``/v1/chat/completions`` with
    temperature 0 (or ``sampling``'s), the server's prompt cache as it defaults, no slot; its top two
    log-probabilities asked for, so its margins are read as a pinned request's. The token ids and the slot that
    served it are read where the server says them (a server started with ``--verbose`` adds its own answer,
    ``__verbose``; ``return_tokens`` only asks it to list the ids there), else the ids from the log-probabilities."""
    start = time.monotonic()
    payload = {
        "messages": messages,
        "max_tokens": budget,
        **({"temperature": 0} if sampling.greedy else sampling.fields()),
        "logprobs": True,
        "top_logprobs": 2,
        "return_tokens": True,
    }
    answer = server.request("/v1/chat/completions", payload)
    seconds = time.monotonic() - start
    steps = ((answer.get("choices") or [{}])[0].get("logprobs") or {}).get("content") or []
    own = answer.get("__verbose") or {}
    tokens = own.get("tokens") or [step["id"] for step in steps]
    return _answer(tokens, steps, seconds, answer.get("timings", {}), own.get("id_slot"), sampling)


# How a client sends one prompt: (server, the prompt's tokens, budget, slot or None) -> its answer.
Send = Callable[[ServerClient, list[int], int, "int | None"], Answer]


class PinnedClient:
    """This project's client: the prompt's token ids on ``/completion``, prompt reuse off, on ``slot`` if given."""

    def __init__(self, sampling: Sampling = GREEDY_SAMPLING):
        self.sampling = sampling

    def __call__(self, server: ServerClient, prompt: list[int], budget: int, slot: int | None = None) -> Answer:
        return ask(server, prompt, budget, cache_prompt=False, slot=slot, sampling=self.sampling)


# The pinned client, greedy.
pinned = PinnedClient()


class DefaultClient:
    """An OpenAI-compatible client as people run one (``ask_chat``): it sends each prompt's chat messages, found by
    the prompt's tokens (``messages``: tokens -> messages), and names no slot."""

    def __init__(self, messages: dict[tuple[int, ...], list[dict]], sampling: Sampling = GREEDY_SAMPLING):
        self.messages = messages
        self.sampling = sampling

    def __call__(self, server: ServerClient, prompt: list[int], budget: int, slot: int | None = None) -> Answer:
        return ask_chat(server, self.messages[tuple(prompt)], budget, self.sampling)


def at_once(
    server: ServerClient,
    prompts: list[list[int]],
    budget: int,
    slots: tuple[int, ...] | None = None,
    send: Send = pinned,
) -> list[Answer]:
    """Each of ``prompts`` sent at the same instant, each by a client of its own (released together by a barrier), in
    the order sent; each answer says whether its prompt was prefilled in one step with another (``trigger``).
    ``slots`` (a guest's): request i on slot i modulo their count; None: the server places each, as it places any
    client's."""
    barrier = threading.Barrier(len(prompts))
    mark = server.batch_log_mark()

    def client(index: int) -> Answer:
        barrier.wait()
        return send(server, prompts[index], budget, slots[index % len(slots)] if slots else None)

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        sent = [pool.submit(client, index) for index in range(len(prompts))]
    answers = [future.result() for future in sent]
    for prompt, answer in zip(prompts, answers):
        answer.trigger = trigger(server, mark, answer, len(prompt), prompt_step=True)
    return answers


def amid_clients(
    server: ServerClient,
    prompt: list[int],
    others: dict[str, list[int]],
    budget: int,
    latency: float,
    rng: random.Random,
    slots: tuple[int, ...] | None = None,
    send: Send = pinned,
) -> Answer:
    """The item's request with each of ``others`` sent by its own client on a seeded schedule around its arrival.
    ``slots`` (a guest's): the item on the first, the others on the rest in turn."""
    names = list(others)
    offsets = [rng.uniform(-latency, latency) for _ in names]
    mark = server.batch_log_mark()
    start = time.monotonic() - min([0.0, *offsets])  # the earliest arrival at time 0

    def client(tokens: list[int], at: float, slot: int | None, name: str | None = None) -> Answer:
        time.sleep(max(0.0, start + at - time.monotonic()))
        try:
            return send(server, tokens, budget, slot)
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
    answer.trigger = trigger(server, mark, answer, len(prompt), prompt_step=False)
    return answer
