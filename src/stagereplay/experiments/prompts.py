"""What the model is asked: each item's prompt text and chat messages, tokenized once per checkpoint.

Every prompt is checked to fit the context.

The prompt tokens are saved in the ledger: every later stage (and the audit)
starts from these integers, never from re-tokenized text.
"""

from __future__ import annotations

from pathlib import Path

from stagereplay.engines.base import ModelError
from stagereplay.engines.registry import checkpoint_tokenizer
from stagereplay.inputs import items as items_mod
from stagereplay.inputs.messages import build_messages, prompt_text
from stagereplay.ledger.fingerprint import fingerprint_tokens
from stagereplay.ledger.tables import PROMPT_SCHEMA, VOCAB_SCHEMA, write_table
from stagereplay.ledger.text import spelling


def encode_prompt(tokenizer, item: items_mod.Item, use_chat_template: bool) -> list[int]:
    if not use_chat_template:
        return list(tokenizer(prompt_text(item))["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            "the tokenizer has no chat template — set use_chat_template: false in the config for a base model"
        )
    encoded = tokenizer.apply_chat_template(build_messages(item), add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


# The forced-choice readout: after a continuation, this cue is fed and the highest-logit choice
# letter read off. It repeats the line the instruction asks for, so the letter is scored where the
# model was told to write it.
READOUT_CUE = "\nAnswer:"


def readout_tokens(tokenizer, letters: tuple[str, ...] = items_mod.LETTERS) -> tuple[list[int], list[int]]:
    """(cue token ids, one token id per choice letter), decided once per checkpoint's tokenizer.

    A letter is scored as the single token that spells it after the cue in "Answer: X". With or
    without its leading space is the tokenizer's call, so both are tried on the whole line: a
    tokenizer with " X" tokens (BPE vocabularies such as SmolLM2's and Qwen2's) scores " X" after
    "\nAnswer:"; one that spells the space apart (a byte-level tokenizer without merges) gets the
    space into the cue and scores "X". Reading "X" after "Answer:" from a BPE model would score a
    spelling it never produces there, so the first form that holds for every letter is used.
    """
    for cue_text, spacing in ((READOUT_CUE, " "), (READOUT_CUE + " ", "")):
        cue = list(tokenizer.encode(cue_text, add_special_tokens=False))
        ids = []
        for letter in letters:
            whole = list(tokenizer.encode(cue_text + spacing + letter, add_special_tokens=False))
            if whole[: len(cue)] != cue or len(whole) != len(cue) + 1:
                break
            ids.append(whole[-1])
        else:
            if len(set(ids)) == len(ids):
                return cue, ids
    raise ModelError(
        f"the tokenizer spells no choice letter as one token after {READOUT_CUE!r} — the forced-choice readout"
        " needs single-token letters; use a tokenizer with single-token A-D"
    )


def tokenize_prompts(
    model_record: dict,
    items_path: str | Path,
    max_new_tokens: int,
    suffix_tokens: int,
    out_path: str | Path,
    vocab_path: str | Path,
    use_chat_template: bool = True,
    trust_remote_code: bool = False,
) -> Path:
    tokenizer, context = checkpoint_tokenizer(model_record, trust_remote_code)
    write_vocabulary(tokenizer, vocab_path)
    cue, letter_ids = readout_tokens(tokenizer)
    rows = []
    for item in items_mod.load_items(items_path):
        tokens = encode_prompt(tokenizer, item, use_chat_template)
        needed = len(tokens) + max_new_tokens + suffix_tokens
        if context and needed > context:
            raise ModelError(
                f"item {item.item_id}: prompt of {len(tokens)} tokens + {max_new_tokens} stage + {suffix_tokens} suffix tokens exceeds the model's context of {context} — shorten the item or lower the token budgets"
            )
        rows.append(
            {
                "item_id": item.item_id,
                "prompt_tokens": tokens,
                "prompt_fingerprint": fingerprint_tokens(tokens),
                "readout_cue_tokens": cue,
                "readout_letter_tokens": letter_ids,
            }
        )
    return write_table(rows, PROMPT_SCHEMA, out_path)


def write_vocabulary(tokenizer, out_path: str | Path) -> Path:
    """Every token id's spelling, so the report reads tokens from the ledger instead of loading a tokenizer."""
    rows = [{"token_id": token, "text": spelling(tokenizer, token)} for token in range(len(tokenizer))]
    return write_table(rows, VOCAB_SCHEMA, out_path)
