"""How llama-server split a sequence's tokens into decode calls, read from its own log.

With ``LLAMA_BATCH_DEBUG=1`` and ``--verbose``, llama.cpp's batch allocator logs every micro-batch it hands to the
model (``llama_batch_allocr::ubatch_add``, "added ubatch to split"), one line per token with its position and the
sequences it belongs to (a slot's sequence id is the slot's id). Under concurrent load the server composes each
decode call from every busy slot's tokens, and how a prompt is cut depends on the cache: one unified cache splits
the batch into consecutive micro-batches of up to ``-ub`` tokens (``split_simple``), one stream per slot into
micro-batches of equal-length runs per sequence (``split_equal``). With ``LLAMA_KV_CACHE_DEBUG=1`` too, the KV
cache logs, for each micro-batch it places, where its search for free cells starts (``llama_kv_cache::find_slot``:
the cache's end ``n``, its used cells and its ``head``), from which the cell of a prompt's first position follows
wherever the cache has no free cell below its end. This module reads those calls back, so a row can say what the
server did rather than what the code suggests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The header of one micro-batch, the header of the whole batch before it is split (its token rows are not a
# call), and the end of one token row of either (llama-batch.cpp's ubatch_print at debug level 1). A row prints
# the token's text, so a token holding a newline breaks its row over two lines: the row's end is what is read.
_HEADER = "added ubatch to split:"
_INPUT = "input batch info:"
_TOKEN = re.compile(r"\), pos =\s*(-?\d+), n_seq_id =\s*\d+, seq_id = \[([^\]]*)\]")
# find_slot's line for each sequence of a micro-batch (llama-kv-cache.cpp at LLAMA_KV_CACHE_DEBUG=1), written once
# the batch is split, in the order of its micro-batches.
_SLOT = re.compile(r"find_slot: stream\[(\d+)\], n =\s*(\d+), used =\s*(\d+), head =\s*(\d+), size =\s*(\d+)")


@dataclass(frozen=True)
class CacheState:
    """One KV stream as find_slot found it before placing a micro-batch: its end (one past its last used cell),
    its used cells, where the search starts (``head``) and its size."""

    end: int
    used: int
    head: int
    size: int

    def first_free(self, tokens: int) -> int | None:
        """The cell the first of ``tokens`` tokens goes to (find_slot's search: from ``head``, or from cell 0 when
        ``head`` is more than twice ``tokens`` past the used cells, taking the first free cells), or None where the
        stream has free cells below its end, which the log does not locate."""
        if self.used != self.end:
            return None
        start = 0 if self.head > self.used + 2 * tokens else self.head
        first = max(start, self.end)
        return first if first + tokens <= self.size else None


@dataclass(frozen=True)
class DecodeCall:
    """One micro-batch as the model ran it: each token's (position, sequences)."""

    tokens: tuple[tuple[int, frozenset[int]], ...]
    # Each sequence of the call, its KV stream and the stream as find_slot found it (none without the KV lines).
    streams: tuple[tuple[int, int, CacheState], ...] = ()

    def positions_of(self, sequence: int) -> list[int]:
        return [position for position, sequences in self.tokens if sequence in sequences]

    def others(self, sequence: int) -> dict[int, int]:
        """The other sequences in this call and how many tokens each had in it."""
        counts: dict[int, int] = {}
        for _, sequences in self.tokens:
            for other in sequences - {sequence}:
                counts[other] = counts.get(other, 0) + 1
        return dict(sorted(counts.items()))

    def first_cell(self, sequence: int, position: int) -> int | None:
        """The cell ``sequence``'s ``position`` in this call went to, where the KV lines locate it: the call's tokens
        of one stream fill its free cells in the order of the call (in one unified cache, every sequence's)."""
        found = {logged: (stream, state) for logged, stream, state in self.streams}
        if sequence not in found:
            return None
        stream, state = found[sequence]
        sharing = {other for other, (its_stream, _) in found.items() if its_stream == stream}
        placed = [(at, sequences) for at, sequences in self.tokens if sequences & sharing]
        first = state.first_free(len(placed))
        index = next((i for i, (at, sequences) in enumerate(placed) if at == position and sequence in sequences), None)
        return None if first is None or index is None else first + index


def _sequences(mask: str) -> frozenset[int]:
    """ubatch_print's sequence mask: one character per sequence id, its last digit where the token is in it."""
    return frozenset(index for index, char in enumerate(mask) if char != ".")


def decode_calls(log: str) -> list[DecodeCall]:
    """Every micro-batch the log records, in order (none without LLAMA_BATCH_DEBUG and --verbose), with its
    sequences' KV streams where LLAMA_KV_CACHE_DEBUG logged them."""
    calls: list[list[tuple[int, frozenset[int]]]] = []
    streams: list[list[tuple[int, int, CacheState]]] = []
    current = None  # the token rows of the micro-batch being read; None inside an input batch's rows
    unplaced: list[int] = []  # the micro-batches of this batch whose find_slot lines are still to come
    for line in log.splitlines():
        if _HEADER in line:
            current = []
            calls.append(current)
            streams.append([])
            unplaced.append(len(calls) - 1)
        elif _INPUT in line:
            current = None
            unplaced = []
        elif current is not None and (match := _TOKEN.search(line)):
            current.append((int(match.group(1)), _sequences(match.group(2))))
        elif (match := _SLOT.search(line)) and unplaced:
            # One line per sequence of the micro-batch, in the order of its sequences (sorted ids).
            index = unplaced[0]
            sequences = sorted(set().union(*(sequences for _, sequences in calls[index])))
            placed = streams[index]
            stream, end, used, head, size = map(int, match.groups())
            if len(placed) < len(sequences):
                placed.append((sequences[len(placed)], stream, CacheState(end, used, head, size)))
            if len(placed) == len(sequences):
                unplaced.pop(0)
    return [DecodeCall(tuple(tokens), tuple(placed)) for tokens, placed in zip(calls, streams)]


def prompt_calls(calls: list[DecodeCall], sequence: int, positions: int, start: int = 0) -> list[DecodeCall]:
    """The calls that carried positions ``start`` .. ``positions`` - 1 of ``sequence``: how its prompt was cut (from
    ``start``: the positions before it were taken from the server's cache)."""
    return [call for call in calls if any(start <= position < positions for position in call.positions_of(sequence))]


def describe_split(calls: list[DecodeCall], sequence: int, positions: int, start: int = 0) -> str:
    """The prompt's decode calls in words: 'in 1 decode call: 297 positions of slot 0 with 1 token of slot 1', and
    where the KV lines locate it, ', from cell 37' (the cell of its first computed position)."""
    described = []
    for call in calls:
        own = sum(start <= position < positions for position in call.positions_of(sequence))
        others = call.others(sequence)
        company = (
            " with " + ", ".join(f"{count} token{'s' * (count != 1)} of slot {slot}" for slot, count in others.items())
            if others
            else " alone"
        )
        described.append(f"{own} positions of slot {sequence}{company}")
    count = len(calls)
    cell = calls[0].first_cell(sequence, start) if calls else None  # of the first computed position
    where = "" if cell is None else f", from cell {cell}"
    return f"the prompt in {count} decode call{'s' * (count != 1)}: " + "; ".join(described) + where


@dataclass(frozen=True)
class Company:
    """What the log says of one request's company: whether its prompt shared a decode call with another sequence
    (the prompts were prefilled in one step), whether any of its decode calls did (it ran while another did), and
    how its prompt was cut."""

    prompt_shared: bool
    any_shared: bool
    logged: int  # of the prompt's positions, those the log holds
    split: str


def company(calls: list[DecodeCall], sequence: int, positions: int, start: int = 0) -> Company:
    """``sequence``'s company in ``calls`` (those logged while its request ran), its prompt being positions 0 ..
    ``positions`` - 1, of which those from ``start`` were computed (the rest taken from the server's cache)."""
    prompt = prompt_calls(calls, sequence, positions, start)
    logged = {position for call in prompt for position in call.positions_of(sequence) if start <= position < positions}
    split = describe_split(prompt, sequence, positions, start)
    return Company(
        prompt_shared=any(call.others(sequence) for call in prompt),
        any_shared=any(call.others(sequence) for call in calls if call.positions_of(sequence)),
        logged=len(logged),
        split=split if not start else f"{split} (positions 0 to {start - 1} from the cache)",
    )
