"""Each item's prompt length before a model job has tokenized it: the run's own prompt table when it exists,
else an estimate from the items' text. What the plan's bytes and a job's memory are projected from. No torch."""

from __future__ import annotations

import math
from pathlib import Path

# Tokens of the instruction, option labels and chat template (with a default system prompt) around
# an item's own text (inputs.messages.prompt_text), and characters of item text per token: fitted to the
# measured prompts of the byte-level random Qwen2 and of SmolLM2-135M-Instruct on data/items.jsonl.
_PROMPT_OVERHEAD_TOKENS = {"byte": 198, "subword": 100}
_CHARS_PER_TOKEN = {"byte": 1.0, "subword": 4.0}


def estimate_prompt_tokens(items, byte_level: bool) -> list[int]:
    """Prompt lengths from the items' text, for a byte-level or a subword vocabulary."""
    kind = "byte" if byte_level else "subword"
    return [
        _PROMPT_OVERHEAD_TOKENS[kind]
        + math.ceil((len(item.question) + sum(len(choice) for choice in item.choices)) / _CHARS_PER_TOKEN[kind])
        for item in items
    ]


def measured_prompt_tokens(prompts_table: str | Path) -> list[int] | None:
    """The run's own prompt lengths, when its prompt tokens table exists."""
    if not Path(prompts_table).is_file():
        return None
    import pyarrow.parquet as pq

    return [len(tokens) for tokens in pq.read_table(prompts_table, columns=["prompt_tokens"]).column(0).to_pylist()]
