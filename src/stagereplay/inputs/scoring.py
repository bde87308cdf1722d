"""Reading the model's answer: the letter of its last "Answer: X", and whether it is correct."""

from __future__ import annotations

import re

from stagereplay.inputs.items import Item

# Keyword is case-insensitive, letter is not: "answer: a" is more often prose than a choice.
# Optional markdown bold around the keyword/colon and brackets around the letter.
# "The answer is X" is accepted too: small chat models write it far more often
# than the requested "Answer: X", and counting it unparsable would hide real labels.
_ANSWER_RE = re.compile(r"\b(?i:answer)(?:\s*\**\s*:|\s+is)\s*\**\s*[(\[]?\s*([A-D])\b")


def extract_answer(text: str) -> str | None:
    """The letter of the last "Answer: X" (or "answer is X") in text, or None."""
    matches = _ANSWER_RE.findall(text)
    return matches[-1] if matches else None


def score(item: Item, generated_text: str) -> tuple[str | None, bool]:
    """(parsed letter or None, correct); an unparseable answer counts as wrong."""
    letter = extract_answer(generated_text)
    return letter, letter is not None and letter == item.answer
