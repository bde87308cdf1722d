"""A bounded load generator on loopback: other requests in flight on a llama-server while the engine's own
requests run on slot 0 (E6's ``batch`` on the llamaserver engine: concurrent load through continuous batching).

The server composes its own decode calls: each call takes one token from every slot that is generating, then
fills up with pending prompt tokens (``server-context.cpp``, ``update_slots``). There is no way to say "these
B sequences in this one call", so the generator makes the composition fixed instead: it sends one greedy
request per companion, pinned to slots 1..K, each allowed far more tokens than the engine's requests will
take and told to ignore end-of-generation tokens, and waits until every companion is generating (``GET
/slots``: processing, at least one token decoded). From then on, until they are cancelled, every decode call
the server makes carries one token of each companion beside whatever slot 0 asks: its prompt in the call
that builds it, its one token per step while it decodes.

On leaving, the generator checks that every companion was still generating (a companion that had finished
would have left the engine's requests to run with less load than recorded: one line, the job fails), then
cancels them by closing their connections: companions stream their tokens, so the server's next write to a
closed connection fails and it drops the task at once (a non-streamed request is dropped only if the server
notices the closed connection while it waits, which it did not reliably), waits until their slots are idle and
erases them, so the next block starts from the same state. What the load was is recorded (``Load.describe``): the companions' slots and the tokens each had
decoded when the block began and when it ended.
"""

from __future__ import annotations

import http.client
import json
import select
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from stagereplay.engines.llamaserver.build import LlamaServerError
from stagereplay.engines.llamaserver.client import GREEDY
from stagereplay.engines.llamaserver.process import ServerProcess

# Tokens each companion may generate: far more than an engine block decodes while they run (a build is one
# call, a read one per token of the suffix budget); a companion reaching it fails the block (``Load``).
COMPANION_TOKENS = 1536
# How often, and for how long at most, the generator polls the slots while waiting for companions.
POLL_SECONDS = 0.005
WAIT_SECONDS = 60.0
# The server's own line when a decode call did not fit the cache: it then halves the batch and drops idle
# slots' caches, which would change both the composition and the companions' state.
RETRY_LINE = "retrying with smaller batch size"


@dataclass
class Load:
    """The companions of one block: their slots, and the tokens each had decoded at its start and end."""

    slots: tuple[int, ...]
    started: list[int] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    cancelled: bool = False  # cancelled and erased before the block (the load path's control)

    def describe(self) -> str:
        if not self.slots:
            return "no other request in flight"

        def spread(values: list[int]) -> str:
            return f"{min(values)}" if min(values) == max(values) else f"{min(values)}–{max(values)}"

        slots = f"slot {self.slots[0]}" if len(self.slots) == 1 else f"slots {self.slots[0]}–{self.slots[-1]}"
        if self.cancelled:
            return (
                f"{len(self.slots)} other request{'s' if len(self.slots) != 1 else ''} started on {slots}, generating"
                f" (tokens decoded: {spread(self.started)}), then cancelled and erased before the block"
            )
        return (
            f"{len(self.slots)} other request{'s' if len(self.slots) != 1 else ''} generating on {slots}"
            f" (tokens decoded: {spread(self.started)} when the block began, {spread(self.ended)} when it ended)"
        )


@contextmanager
def companions_in_flight(
    server: ServerProcess, prompts: Sequence[Sequence[int]], *, cancelled: bool = False
) -> Iterator[Load]:
    """Greedy requests for ``prompts`` generating on slots 1..len(prompts) for the duration of the block. With
    ``cancelled`` (the control of the load path), they start, generate, and are cancelled and erased before the
    block: the block then runs alone on a server that went through everything load does to it."""
    slots = tuple(range(1, len(prompts) + 1))
    if slots and server.settings.parallel <= slots[-1]:
        raise LlamaServerError(
            f"{len(prompts)} companions need {len(prompts) + 1} slots; this server has {server.settings.parallel}"
        )
    load = Load(slots, cancelled=cancelled)
    log_before = len(server.log_text())
    connections = []
    try:
        for slot, prompt in zip(slots, prompts):
            connections.append(_send(server, slot, prompt))
        load.started = _decoded(server, slots, connections, waiting=True)
        if cancelled:
            _cancel(server, slots, connections)
            connections = []
        yield load
        if not cancelled:
            load.ended = _decoded(server, slots, [], waiting=False)
        if RETRY_LINE in server.log_text()[log_before:]:
            raise LlamaServerError(
                "llama-server ran out of cache cells under load and retried with a smaller batch — give it a larger"
                " context"
            )
    finally:
        if connections and server.process is not None and server.process.poll() is None:
            _cancel(server, slots, connections)
        else:
            for connection in connections:
                connection.close()


def _cancel(server: ServerProcess, slots: tuple[int, ...], connections: list) -> None:
    """Close the companions' streams (the server drops each at its next write), wait until their slots are idle,
    and erase them, so the next block starts from the same state."""
    for connection in connections:
        connection.close()
    _wait_idle(server, slots)
    for slot in slots:
        server.erase_slot(slot)


def _send(server: ServerProcess, slot: int, prompt: Sequence[int]) -> http.client.HTTPConnection:
    """One companion request sent, its answer not read: the connection is its handle."""
    payload = {
        "prompt": list(prompt),
        "n_predict": COMPANION_TOKENS,
        "id_slot": slot,
        "cache_prompt": False,
        "ignore_eos": True,
        "n_probs": 0,
        "stream": True,  # a closed connection then cancels it at the server's next write
        **GREEDY,
    }
    connection = server.connection()
    connection.request("POST", "/completion", json.dumps(payload).encode(), server.headers(json_body=True))
    return connection


def _decoded(server: ServerProcess, slots: tuple[int, ...], connections: list, *, waiting: bool) -> list[int]:
    """Tokens each companion has decoded; with ``waiting``, once every one has decoded at least one (a companion
    the server answered with an error is one line then: ``connections`` are checked for an early answer)."""
    deadline = time.monotonic() + WAIT_SECONDS
    checked: set[int] = set()
    while True:
        for slot, connection in zip(slots, connections):
            if slot not in checked and select.select([connection.sock], [], [], 0)[0]:
                _check_answer(slot, connection)
                checked.add(slot)
        states = _slot_states(server)
        counts = [_generated(states.get(slot)) for slot in slots]
        if all(count >= 1 for count in counts):
            return counts
        if not waiting:
            idle = [slot for slot, count in zip(slots, counts) if count < 1]
            raise LlamaServerError(
                f"the companions on slots {idle} were not generating when the block ended: they finished their"
                f" {COMPANION_TOKENS} tokens before it, so the load was not held throughout — keep the block shorter"
            )
        if time.monotonic() > deadline:
            raise LlamaServerError(
                f"the companions did not all start generating within {WAIT_SECONDS:g} s — the server is overloaded"
            )
        time.sleep(POLL_SECONDS)


def _check_answer(slot: int, connection: http.client.HTTPConnection) -> None:
    """A companion's answer has begun: its status line must be 200 (then its tokens stream on, unread)."""
    try:
        response = connection.getresponse()
    except (OSError, http.client.HTTPException) as error:
        raise LlamaServerError(f"the companion on slot {slot} lost its connection: {error!r}") from None
    if response.status != 200:
        body = response.read()[:200].decode(errors="replace")
        raise LlamaServerError(f"the companion on slot {slot} was refused: HTTP {response.status}: {body}")


def _slot_states(server: ServerProcess) -> dict[int, dict]:
    """``GET /slots``, each slot's state by its id."""
    return {state["id"]: state for state in server.request("/slots")}


def _generated(state: dict | None) -> int:
    """Tokens a processing slot has decoded for its task (0 while idle or still reading its prompt)."""
    if not state or not state.get("is_processing"):
        return 0
    return int(state.get("next_token", [{}])[0].get("n_decoded", 0))


def _wait_idle(server: ServerProcess, slots: tuple[int, ...]) -> None:
    """Until the server has dropped every cancelled companion (at its next write to the closed stream)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        states = _slot_states(server)
        if not any(states.get(slot, {}).get("is_processing") for slot in slots):
            return
        if time.monotonic() > deadline:
            raise LlamaServerError(
                f"llama-server kept the cancelled companions on slots {slots} for {WAIT_SECONDS:g} s"
            )
        time.sleep(POLL_SECONDS * 10)
