"""The one text a token sequence spells (ledger.text): what the writer records is what verify rebuilds from the
vocabulary table, on the transformers tokenizers and on llama.cpp's, for token sequences drawn from the whole
vocabulary (special and byte tokens included); and a real run whose suffixes hold a special token that is not the
stop token passes verify and its storage rule."""

from __future__ import annotations

import random

import pyarrow.parquet as pq
import pytest
from workflow_helpers import REPO, skip_unless_required, snakemake, stagereplay, write_config

from stagereplay.experiments.prompts import write_vocabulary
from stagereplay.inputs.checkpoints import build_byte_tokenizer
from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, read_table, write_table
from stagereplay.ledger.text import generated_text, is_partial, rebuilt_text, text_of

BYTE_FALLBACK_PIECES = ["▁", "a", "b", "é", "t", "h", "e", "th", "▁a", "▁b", "ab", "▁ab", "▁é", "▁the", "the"]
BYTE_FALLBACK_MERGES = [
    ("▁", "a"),
    ("▁", "b"),
    ("a", "b"),
    ("▁a", "b"),
    ("▁", "é"),
    ("t", "h"),
    ("th", "e"),
    ("▁", "the"),
]


def byte_fallback_tokenizer():
    """A SentencePiece-style BPE as Llama 2 and Mistral ship it: ▁ for spaces, <0xNN> tokens for bytes it has no
    piece for, and a decoder that strips the first token's leading space."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{byte:02X}>" for byte in range(256)] + BYTE_FALLBACK_PIECES
    vocab = {piece: index for index, piece in enumerate(dict.fromkeys(pieces))}
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=BYTE_FALLBACK_MERGES, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken(special, special=True, normalized=False) for special in specials])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def random_sequences(vocabulary_size: int, count: int = 1500, seed: int = 0) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(vocabulary_size) for _ in range(generator.randrange(13))] for _ in range(count)]


def vocabulary_table(tokenizer, tmp_path) -> dict[int, str]:
    """The vocabulary table as the prompts job writes it, read back from its Parquet file."""
    path = write_vocabulary(tokenizer, tmp_path / "vocab.parquet")
    rows = pq.read_table(path).to_pydict()
    return dict(zip(rows["token_id"], rows["text"]))


def assert_writer_is_rebuilt(tokenizer, tmp_path, special_ids) -> None:
    vocabulary = vocabulary_table(tokenizer, tmp_path)
    sequences = random_sequences(len(tokenizer))
    drawn = {token for tokens in sequences for token in tokens}
    # The draw holds special tokens and tokens that are only part of a character (the vocabulary spells them by name).
    assert drawn & set(special_ids)
    assert any(is_partial(vocabulary[token]) for token in drawn)
    for tokens in sequences:
        for stopped in (False, True):
            assert generated_text(tokenizer, tokens, stopped) == rebuilt_text(tokens, vocabulary, stopped), tokens
    # The special tokens are in the text, spelled as the tokenizer spells them.
    special = sorted(special_ids)[0]
    assert tokenizer.convert_ids_to_tokens(special) in text_of(tokenizer, [special])


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_the_writers_text_is_verifys_rebuild_on_transformers_tokenizers(kind, tmp_path):
    tokenizer = build_byte_tokenizer() if kind == "byte_level" else byte_fallback_tokenizer()
    assert_writer_is_rebuilt(tokenizer, tmp_path, tokenizer.all_special_ids)


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_the_text_is_the_tokenizers_own_decode_where_that_is_whole_characters(kind):
    """The definition agrees with the tokenizer's decode (special tokens kept) wherever that decode holds only whole
    characters, but for the one leading space a SentencePiece decode strips at the start of a text."""
    tokenizer = build_byte_tokenizer() if kind == "byte_level" else byte_fallback_tokenizer()
    compared = 0
    for tokens in random_sequences(len(tokenizer)):
        decoded = tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if "\ufffd" in decoded:
            continue
        assert text_of(tokenizer, tokens) in (decoded, " " + decoded), tokens
        compared += 1
    assert compared > 100
    if kind == "byte_fallback":
        # Mid-text, a piece keeps its space: "the" continues "a" as " the", where a decode alone strips it.
        the = tokenizer.convert_tokens_to_ids("▁the")
        assert tokenizer.decode([the]) == "the" and text_of(tokenizer, [the]) == " the"


def _llamacpp_problem() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama_cpp not importable ({error}); install it with pip install -e .[llamacpp]"
    return None


def write_byte_fallback_gguf(path) -> None:
    """A vocabulary-only GGUF whose tokenizer is llama.cpp's SentencePiece one ("llama"), with byte tokens."""
    import gguf

    specials = ["<unk>", "<s>", "</s>"]
    bytes_ = [f"<0x{byte:02X}>" for byte in range(256)]
    pieces = specials + bytes_ + BYTE_FALLBACK_PIECES
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL] * len(BYTE_FALLBACK_PIECES)
    )
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * 259 + [-float(index) for index in range(len(BYTE_FALLBACK_PIECES))])
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llamacpp_vocabulary(path):
    """llama.cpp's tokenizer of a GGUF, loaded without its weights; the model pointer stays with the tokenizer."""
    from stagereplay.engines.llamacpp.binding import binding
    from stagereplay.engines.llamacpp.tokenizer import LlamaCppTokenizer

    llama_cpp = binding()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp could not load {path}"
    tokenizer = LlamaCppTokenizer(model)
    tokenizer.model = model
    return tokenizer


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_the_writers_text_is_verifys_rebuild_on_llamacpps_tokenizer(kind, tiny_qwen2_folder, tmp_path):
    skip_unless_required(_llamacpp_problem(), "STAGEREPLAY_REQUIRE_LLAMACPP")
    from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

    path = tmp_path / f"{kind}.gguf"
    if kind == "byte_level":
        write_qwen2_gguf(tiny_qwen2_folder, path)
    else:
        write_byte_fallback_gguf(path)
    tokenizer = llamacpp_vocabulary(path)
    llama_cpp = tokenizer.llama_cpp
    special_ids = [
        token
        for token in range(len(tokenizer))
        if llama_cpp.llama_vocab_get_attr(tokenizer.vocab, token) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    ]
    assert_writer_is_rebuilt(tokenizer, tmp_path, special_ids)
    # And llama.cpp's own detokenizer agrees, but for the leading space it strips at the start of a text.
    for tokens in random_sequences(len(tokenizer), count=300):
        decoded = tokenizer.decode(tokens)
        assert text_of(tokenizer, tokens) in (decoded, " " + decoded), tokens


@pytest.mark.slow
def test_a_run_whose_suffixes_hold_a_special_token_verifies(tmp_path):
    """The tiny diverging model ends arith-004's fp32 suffixes with <|endoftext|> (id 256), a special token that is
    not its stop token (<|im_end|>): the run records it in the text, and verify and the storage rule pass."""
    items = tmp_path / "items.jsonl"
    items.write_text(
        next(line for line in (REPO / "data" / "items.jsonl").read_text().splitlines() if '"arith-004"' in line) + "\n"
    )
    ledger = tmp_path / "ledger"
    config = write_config(
        tmp_path / "config.yaml",
        ledger_dir=str(ledger),
        items={"source": str(items)},
        matched={"precision": "fp32", "replicas": 1},
        fixed_prefix={"precisions": ["fp32"], "constructions": ["incremental", "prefill"]},
        transplant={"enabled": False},
    )
    result = snakemake(tmp_path, config)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_table(ledger / "tables" / "trajectories.parquet", TRAJECTORY_SCHEMA).to_pylist()
    special = [row for row in rows if 256 in row["suffix_tokens"][: len(row["suffix_tokens"]) - 1]]
    assert special, "no suffix holds <|endoftext|> before its end: the test no longer sees what it checks"
    assert all("<|endoftext|>" in row["suffix_text"] for row in special)
    assert "ledger OK" in (ledger / "stored.json").read_text()  # the storage rule's own verify
    verified = stagereplay("verify", ledger)
    assert verified.returncode == 0, verified.stderr
    assert "verify: ledger OK" in verified.stdout

    # A ledger written before special tokens were kept in texts still verifies, named in one line.
    vocabulary = dict(zip(*pq.read_table(ledger / "vocab" / "tiny-qwen2.parquet").to_pydict().values()))
    rewritten = 0
    for table in [ledger / "tables" / "trajectories.parquet", *sorted((ledger / "runs").rglob("shard-*.parquet"))]:
        old = read_table(table, TRAJECTORY_SCHEMA).to_pylist()
        for row in old:
            kept = [token for token in row["suffix_tokens"] if token != 256]
            text = rebuilt_text(kept, vocabulary, row["suffix_stop"] == "eos")
            rewritten += text != row["suffix_text"]
            row["suffix_text"] = text
        write_table(old, TRAJECTORY_SCHEMA, table)
    verified = stagereplay("verify", ledger)
    assert verified.returncode == 0, verified.stderr
    (note,) = [line for line in verified.stdout.splitlines() if line.startswith("verify: note:")]
    assert rewritten >= len(special)
    assert f"suffix_text of {rewritten} rows was written without the special tokens it holds" in note
