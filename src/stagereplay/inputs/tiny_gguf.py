"""Write a Qwen2 model folder (the tiny random ones ``build_random_qwen2`` makes) as a GGUF for llama.cpp.

Tests and the llama.cpp test config need a GGUF that is small, built from a seed and
read by the real llama.cpp loader; no converter script ships with the ``gguf``
package, so this writes the handful of Qwen2 tensors and keys llama.cpp reads,
in float32 (the same weights the transformers engine runs). Only byte-level
tokenizers without merges (``build_byte_tokenizer``) are written: that is what
the random models carry.
"""

from __future__ import annotations

import json
from pathlib import Path

from stagereplay.ledger.atomic import atomic_write

# Hugging Face Qwen2 parameter name (after "model.layers.N.") -> GGUF tensor name (after "blk.N.").
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_qwen2_gguf(folder: str | Path, out_path: str | Path) -> Path:
    """The Qwen2 folder's weights, hyperparameters, byte-level vocabulary and chat template as one f32 GGUF."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "qwen2":
        raise ValueError(f"{folder} is a {config.get('model_type')!r} model — only Qwen2 folders are written as GGUF")
    weights: dict[str, np.ndarray] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    if tokenizer["model"].get("merges"):
        raise ValueError(f"{folder}'s tokenizer has merges — only byte-level tokenizers without merges are written")
    vocab = tokenizer["model"]["vocab"] | {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    special = {token["content"] for token in tokenizer["added_tokens"] if token.get("special")}
    template = tokenizer_config.get("chat_template") or (folder / "chat_template.jinja").read_text()

    def write(temporary: Path) -> None:
        writer = gguf.GGUFWriter(str(temporary), "qwen2")
        writer.add_name(folder.name)
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_block_count(config["num_hidden_layers"])
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(
            [gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens]
        )
        # llama.cpp refuses a BPE vocabulary without a merges key, and the writer drops an empty list: one
        # merge whose result is no token changes nothing (llama.cpp spells an unknown merge as its bytes).
        writer.add_token_merges([f"{tokens[0]} {tokens[0]}"])
        writer.add_eos_token_id(config["eos_token_id"])
        writer.add_bool("tokenizer.ggml.add_bos_token", False)
        writer.add_chat_template(template)
        writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
        writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
        if "lm_head.weight" in weights and not config.get("tie_word_embeddings"):
            writer.add_tensor("output.weight", weights["lm_head.weight"])
        for layer in range(config["num_hidden_layers"]):
            for name, gguf_name in LAYER_TENSORS.items():
                writer.add_tensor(f"blk.{layer}.{gguf_name}", weights[f"model.layers.{layer}.{name}"])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return atomic_write(out_path, write)
