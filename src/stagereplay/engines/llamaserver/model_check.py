"""Is an attached server's model the checkpoint's GGUF? Proven by its bytes where the file is readable here, else
checked against what the server says of it.

Requests carry the checkpoint's prompt token ids, so a server running another model answers other questions. Where
the server's model file is readable on this machine, its bytes are hashed and must be the checkpoint's GGUF. Where it
is not (another machine, another user's files), the weights cannot be proven; what the server reports is checked
instead, and the record says which:

- its parameter count, its tensors' size in bytes and its vocabulary size (``/v1/models``) against the checkpoint's
  GGUF, read here with ``gguf`` (no weights loaded);
- its spelling of every token id the prompts hold (``/detokenize``, one id at a time) against the checkpoint's
  (the prompts job's vocabulary table), so the items are tokenized as that server tokenizes them. A token holding
  part of a multi-byte character spells as no text alone and is not compared.

Two GGUFs of one architecture, size and tokenizer with other weights pass the second check: the record says the
weights were not hashed, and the card says so. No torch here.
"""

from __future__ import annotations

from pathlib import Path

from stagereplay.engines.llamaserver.attached import AttachedServer, ServerIdentity
from stagereplay.engines.llamaserver.build import LlamaServerError
from stagereplay.ledger.text import is_partial


def gguf_metadata(path: str | Path) -> dict[str, int]:
    """The figures llama-server reports of a model (``/v1/models`` meta), read from the GGUF's header and tensor
    table: its parameter count, its tensors' bytes and its vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    return {
        "n_params": sum(int(tensor.n_elements) for tensor in reader.tensors),
        "model_bytes": sum(int(tensor.n_bytes) for tensor in reader.tensors),
        "n_vocab": len(tokens.data) if tokens is not None else 0,
    }


def check_model(
    server: AttachedServer, identity: ServerIdentity, gguf_path: str | Path, spellings: dict[int, str], token_ids
) -> dict:
    """The record's model fields for ``server``: its model file's hash where readable here (it must be the checkpoint's
    GGUF), else the metadata and tokenizer checks above; one line naming the first thing that differs."""
    from stagereplay.ledger.fingerprint import file_digest

    model_file = Path(identity.model_path)
    if model_file.is_file():
        hashed = file_digest(model_file)
        if hashed != file_digest(gguf_path):
            raise LlamaServerError(
                f"the llama-server at {server.url} serves {model_file}, whose bytes are not the checkpoint's GGUF"
                f" ({gguf_path}) — serve it in a ledger of its own model"
            )
        return {"model_file_xxh3": hashed, "model_check": "the model file's bytes are the checkpoint's GGUF"}
    ours = gguf_metadata(gguf_path)
    for name, value in ours.items():
        theirs = getattr(identity, name)
        if theirs != value:
            raise LlamaServerError(
                f"the llama-server at {server.url} serves a model of {name} {theirs}, the checkpoint's GGUF has {value}"
                f" ({gguf_path}) — serve it in a ledger of its own model"
            )
    compared = 0
    for token in sorted(set(token_ids)):
        ours_text = spellings[token]
        if is_partial(ours_text):
            continue
        theirs_text = server.request("/detokenize", {"tokens": [token]}).get("content")
        if theirs_text != ours_text:
            raise LlamaServerError(
                f"the llama-server at {server.url} spells token {token} {theirs_text!r}, the checkpoint's GGUF"
                f" {ours_text!r} — its tokenizer is another model's: serve it in a ledger of its own model"
            )
        compared += 1
    return {
        "model_file_xxh3": None,
        "model_check": f"weights not hashed ({model_file} is not readable here); parameters, tensor bytes and"
        f" vocabulary size match the checkpoint's GGUF, and the server spells the {compared} token ids of the"
        " prompts as it does",
    }
