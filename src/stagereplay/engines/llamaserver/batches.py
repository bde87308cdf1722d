"""How llama-server split a sequence's tokens into decode calls, read from its own log.

With ``LLAMA_BATCH_DEBUG=1`` and ``--verbose``, llama.cpp's batch allocator logs every micro-batch it hands to the
model (``llama_batch_allocr::ubatch_add``, "added ubatch to split"), one line per token with its position and the
sequences it belongs to (a slot's sequence id is the slot's id). Under concurrent load the server composes each
decode call from every busy slot's tokens, and how a prompt is cut depends on the cache: one unified cache splits
the batch into consecutive micro-batches of up to ``-ub`` tokens (``split_simple``), one stream per slot into
micro-batches of equal-length runs per sequence (``split_equal``). This module reads those calls back, so a row can
say what the server did rather than what the code suggests.
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


@dataclass(frozen=True)
class DecodeCall:
    """One micro-batch as the model ran it: each token's (position, sequences)."""

    tokens: tuple[tuple[int, frozenset[int]], ...]

    def positions_of(self, sequence: int) -> list[int]:
        return [position for position, sequences in self.tokens if sequence in sequences]

    def others(self, sequence: int) -> dict[int, int]:
        """The other sequences in this call and how many tokens each had in it."""
        counts: dict[int, int] = {}
        for _, sequences in self.tokens:
            for other in sequences - {sequence}:
                counts[other] = counts.get(other, 0) + 1
        return dict(sorted(counts.items()))


def _sequences(mask: str) -> frozenset[int]:
    """ubatch_print's sequence mask: one character per sequence id, its last digit where the token is in it."""
    return frozenset(index for index, char in enumerate(mask) if char != ".")


def decode_calls(log: str) -> list[DecodeCall]:
    """Every micro-batch the log records, in order (none without LLAMA_BATCH_DEBUG and --verbose)."""
    calls: list[list[tuple[int, frozenset[int]]]] = []
    current = None  # the token rows of the micro-batch being read; None inside an input batch's rows
    for line in log.splitlines():
        if _HEADER in line:
            current = []
            calls.append(current)
        elif _INPUT in line:
            current = None
        elif current is not None and (match := _TOKEN.search(line)):
            current.append((int(match.group(1)), _sequences(match.group(2))))
    return [DecodeCall(tuple(tokens)) for tokens in calls]


def prompt_calls(calls: list[DecodeCall], sequence: int, positions: int, start: int = 0) -> list[DecodeCall]:
    """The calls that carried positions ``start`` .. ``positions`` - 1 of ``sequence``: how its prompt was cut (from
    ``start``: the positions before it were taken from the server's cache)."""
    return [call for call in calls if any(start <= position < positions for position in call.positions_of(sequence))]


def describe_split(calls: list[DecodeCall], sequence: int, positions: int, start: int = 0) -> str:
    """The prompt's decode calls in words: 'in 1 decode call: 297 positions of slot 0 with 1 token of slot 1'."""
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
    return f"the prompt in {count} decode call{'s' * (count != 1)}: " + "; ".join(described)


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
