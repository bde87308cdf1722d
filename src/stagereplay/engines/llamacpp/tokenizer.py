"""llama.cpp's own tokenizer of a loaded GGUF model, behind the calls the shared code makes on a transformers
tokenizer (encode, decode, the chat template)."""

from __future__ import annotations

import ctypes

from stagereplay.engines.llamacpp.binding import LlamaCppError, binding


class LlamaCppTokenizer:
    """llama.cpp's own tokenizer behind the calls the shared code makes on a transformers tokenizer."""

    def __init__(self, model):
        """``model``: a loaded ``llama_model`` pointer, valid as long as the tokenizer is used."""
        self.llama_cpp = llama_cpp = binding()
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.eos_token_id = llama_cpp.llama_vocab_eos(self.vocab)
        template = llama_cpp.llama_model_chat_template(model, None)
        self.chat_template = template.decode() if template else None

    def __len__(self) -> int:
        return self.n_vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        llama_cpp = self.llama_cpp
        raw = text.encode("utf-8")
        capacity = len(raw) + 16
        buffer = (llama_cpp.llama_token * capacity)()
        # Special tokens written in the text are parsed as such, as llama.cpp's server does for a templated prompt.
        count = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buffer, capacity, add_special_tokens, True)
        if count < 0:
            raise LlamaCppError(f"llama.cpp could not tokenize {len(raw)} bytes (needs {-count} tokens)")
        return list(buffer[:count])

    def decode(self, tokens, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        """The tokens' text; llama.cpp cleans no spaces up, so ``clean_up_tokenization_spaces`` is accepted, not used."""
        llama_cpp = self.llama_cpp
        tokens = list(tokens)
        array = (llama_cpp.llama_token * max(len(tokens), 1))(*tokens)
        capacity = 64 + 64 * len(tokens)
        buffer = ctypes.create_string_buffer(capacity)
        count = llama_cpp.llama_detokenize(
            self.vocab, array, len(tokens), buffer, capacity, skip_special_tokens, not skip_special_tokens
        )
        if count < 0:
            raise LlamaCppError(f"llama.cpp could not detokenize {len(tokens)} tokens")
        return buffer.raw[:count].decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, token: int) -> str:
        """The vocabulary's own spelling of one token (the per-item view shows it for a partial byte sequence)."""
        return self.llama_cpp.llama_vocab_get_text(self.vocab, token).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True):
        """The GGUF's chat template as llama.cpp applies it (``llama_chat_apply_template``), then tokenized."""
        llama_cpp = self.llama_cpp
        if not self.chat_template:
            raise LlamaCppError("the GGUF has no chat template — set use_chat_template: false in the config")
        chat = (llama_cpp.llama_chat_message * len(messages))(
            *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages]
        )
        template = self.chat_template.encode()
        size = 256 + 2 * sum(len(m["content"].encode()) for m in messages)
        for _ in range(2):
            buffer = ctypes.create_string_buffer(size)
            needed = llama_cpp.llama_chat_apply_template(
                template, chat, len(messages), add_generation_prompt, buffer, size
            )
            if needed < 0:
                raise LlamaCppError(
                    "llama.cpp does not recognise the GGUF's chat template — set use_chat_template: false in the config"
                )
            if needed <= size:
                text = buffer.raw[:needed].decode("utf-8")
                return self.encode(text, add_special_tokens=True) if tokenize else text
            size = needed
        raise LlamaCppError("llama.cpp's chat template kept growing its output")

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens=True)}
