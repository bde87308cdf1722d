"""What text a token sequence spells: the one definition the ledger's writer, its vocabulary table, the labels
(answer parsing), verify, the card and ``stagereplay show`` share, on every engine.

A token's spelling is the text it adds where it stands in a longer text (``spelling``): decoded after a fixed
anchor, whose text is then cut off, so that

- **special tokens are kept**: an end-of-turn, end-of-text or tool token that a model emits mid-answer is part of
  what it generated;
- **nothing is cleaned up**: no spaces removed before punctuation (``clean_up_tokenization_spaces``);
- **nothing is stripped at the start**: a SentencePiece tokenizer drops the leading space of the first token of a
  text, but a generated span continues a prompt; it does not start one.

A token holding part of a multi-byte character has no text of its own: it is spelled by its tokenizer name in ‹ ›,
whose bytes are known (``<0xE2>`` for a byte-fallback token, GPT-2's byte-level alphabet otherwise).

A span's text is its tokens' spellings joined as bytes and read as UTF-8 (``joined``), U+FFFD for each maximal
invalid run; a generated span that ended at the model's stop token is spelled without it (``generated_text``): the
stop token ends the text, it is not in it. The vocabulary table holds every token's spelling, so verify rebuilds a
span's text from the ledger alone, exactly (``rebuilt_text``). Where a tokenizer's own decode would differ, only
the U+FFFD's do: Hugging Face's byte-fallback decoder writes one per byte of an invalid run.
"""

from __future__ import annotations

import functools
import re

# How the vocabulary spells a token that holds part of a multi-byte character (it decodes alone to no text): the
# tokenizer's own name for it between these marks.
PARTIAL_TOKEN_MARKS = ("‹", "›")

# Written before each span, then cut off: a plain letter every tokenizer encodes and spells back.
_ANCHOR = "a"

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decode(tokenizer, tokens: list[int]) -> str:
    # The only place a token sequence is decoded: llama.cpp's tokenizer implements the same keywords.
    return tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=16)
def _anchor(tokenizer) -> tuple[list[int], str]:
    tokens = tokenizer.encode(_ANCHOR, add_special_tokens=False)
    return tokens, _decode(tokenizer, tokens)


@functools.lru_cache(maxsize=1 << 18)
def spelling(tokenizer, token: int) -> str:
    """One token's text where it stands in a longer text, as the vocabulary table records it.

    A token holding part of a multi-byte character spells alone as U+FFFD, which would make two different tokens
    look the same: such a token is spelled as the tokenizer's own name for it, in ‹ ›.
    """
    anchor, anchor_text = _anchor(tokenizer)
    text = _decode(tokenizer, [*anchor, token])
    if not text.startswith(anchor_text):
        raise ValueError(
            f"the tokenizer spells {_ANCHOR!r} followed by token {token} as {text[:40]!r}, which does not start"
            f" with {anchor_text!r} — report this tokenizer to stagereplay"
        )
    text = text[len(anchor_text) :]
    opening, closing = PARTIAL_TOKEN_MARKS
    return f"{opening}{tokenizer.convert_ids_to_tokens(token)}{closing}" if "\ufffd" in text else text


def is_partial(piece: str) -> bool:
    opening, closing = PARTIAL_TOKEN_MARKS
    return len(piece) >= 2 and piece.startswith(opening) and piece.endswith(closing)


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {character: byte for byte, character in bytes_to_unicode().items()}


def piece_bytes(piece: str) -> bytes:
    """The bytes of one spelling: its text, or for a token spelled by its name in ‹ ›, the bytes the name stands
    for (U+FFFD's where the name is of no scheme known, as the token spells alone)."""
    if not is_partial(piece):
        return piece.encode("utf-8")
    name = piece[1:-1]
    byte = _BYTE_FALLBACK.fullmatch(name)
    if byte:
        return bytes([int(byte.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if name and all(character in alphabet for character in name):
        return bytes(alphabet[character] for character in name)
    return "\ufffd".encode()


def joined(pieces) -> str:
    """Spellings joined as bytes and read as UTF-8, U+FFFD for each maximal invalid run of bytes (Python's
    ``errors="replace"``, llama.cpp's detokenizer as stagereplay reads it, and the byte-level decoders')."""
    return b"".join(piece_bytes(piece) for piece in pieces).decode("utf-8", errors="replace")


def text_of(tokenizer, tokens) -> str:
    """The text ``tokens`` add where they stand in a longer text: their spellings joined."""
    return joined(spelling(tokenizer, token) for token in tokens)


def spelled_tokens(tokens, stopped: bool) -> list[int]:
    """The tokens a generated span's text spells: all of them, less the stop token that ended it (``stopped``)."""
    tokens = list(tokens)
    return tokens[:-1] if stopped and tokens else tokens


def generated_text(tokenizer, tokens, stopped: bool) -> str:
    """A generated span's text; ``stopped``: the span ended at the model's stop token, which is left out."""
    return text_of(tokenizer, spelled_tokens(tokens, stopped))


def rebuilt_text(tokens, vocabulary: dict[int, str], stopped: bool = False) -> str | None:
    """``generated_text`` rebuilt from the vocabulary table's spellings, or None where a token is not in it."""
    tokens = spelled_tokens(tokens, stopped)
    if any(token not in vocabulary for token in tokens):
        return None
    return joined(vocabulary[token] for token in tokens)
