"""What the model is asked about an item: the instruction, the question and its choices, as text and as the chat
messages a chat template (the prompts job's) or a server's chat endpoint (the served default client) turns into a
prompt. No torch."""

from __future__ import annotations

from stagereplay.inputs import items as items_mod

_INSTRUCTION = (
    "Answer the following multiple-choice question. Think step by step, "
    'then finish with a final line of the form "Answer: X" where X is one of A, B, C, D.'
)


def prompt_text(item: items_mod.Item) -> str:
    options = "\n".join(f"{letter}) {choice}" for letter, choice in zip(items_mod.LETTERS, item.choices))
    return f"{_INSTRUCTION}\n\nQuestion: {item.question}\n\n{options}"


def build_messages(item: items_mod.Item) -> list[dict]:
    """Chat messages for tokenizer.apply_chat_template."""
    return [{"role": "user", "content": prompt_text(item)}]
