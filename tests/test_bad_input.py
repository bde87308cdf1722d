"""The bad-input catalogue: config, items, model and ledger mistakes a user can plausibly make.

Each case runs the real command (snakemake, or the stagereplay CLI) and asserts
a one-line message that names the problem and the fix, a non-zero exit, and a
ledger left as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from workflow_helpers import (
    copy_run,
    ledger_snapshot,
    snakemake,
    stagereplay,
    write_config,
)

from stagereplay.inputs.checkpoints import build_random_qwen2

pytestmark = pytest.mark.slow

ITEM = '{"id": "%s", "question": "q", "choices": ["1", "2", "3", "4"], "answer": "A"}\n'


@dataclass(frozen=True)
class BadInput:
    needle: str  # what the one-line message must say
    overrides: dict = field(default_factory=dict)  # config changes
    items: str | None = None  # content of an item file to use as items.source
    prepare: Callable[[Path], dict] | None = None  # builds files under a temporary folder; returns config changes
    damage: Callable[[Path], None] | None = None  # damages a copy of a finished ledger first
    command: str = "run"  # "run", "audit" (snakemake targets) or "verify" (the CLI)
    in_job: bool = False  # fails inside a job (its log and model folders are new), not at parse time
    snakemake_args: tuple[str, ...] = ()  # given on snakemake's command line, after the config file


def fake_gguf(folder: Path) -> dict:
    (folder / "model.gguf").write_bytes(b"GGUF not really")
    return {"checkpoints": {"fake": {"gguf": str(folder / "model.gguf"), "sha256": "0" * 64}}}


def folder_without_config(folder: Path) -> dict:
    (folder / "empty-model").mkdir()
    return {"checkpoints": {"mine": {"folder": str(folder / "empty-model")}}}


def pickle_only_folder(folder: Path) -> dict:
    """A model folder whose weights are a pickle (pytorch_model.bin): never to be loaded."""
    model = build_random_qwen2(folder / "model", seed=0)
    weights = model / "model.safetensors"
    from safetensors.torch import load_file

    torch.save(load_file(str(weights)), model / "pytorch_model.bin")
    weights.unlink()
    return {"checkpoints": {"pickled": {"folder": str(model)}}}


def missing_item_file(folder: Path) -> dict:
    return {"items": {"source": str(folder / "nowhere.jsonl"), "limit": None}}


def latin1_item_file(folder: Path) -> dict:
    """Items saved in a legacy encoding (here Latin-1), as a spreadsheet export on Windows may be."""
    (folder / "latin1.jsonl").write_bytes((ITEM % "a" + ITEM.replace('"q"', '"café?"') % "b").encode("latin-1"))
    return {"items": {"source": str(folder / "latin1.jsonl"), "limit": None}}


def not_a_ledger(folder: Path) -> dict:
    (folder / "notes").mkdir()
    return {"verify": str(folder / "notes")}


def ledger_dir_is_a_file(folder: Path) -> dict:
    (folder / "ledger.txt").write_text("not a directory")
    return {"ledger_dir": str(folder / "ledger.txt")}


def overwrite_a_shard(ledger: Path) -> None:
    next((ledger / "runs" / "live").rglob("shard-000.parquet")).write_bytes(b"PAR1 not really parquet")


def flip_a_byte_of_an_object(ledger: Path) -> None:
    row = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()[0]
    path = ledger / "objects" / row["cache_object"][:2] / f"{row['cache_object']}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


CATALOGUE = {
    # config
    "schema: shard_size 0": BadInput("shard_size", {"shard_size": 0}),
    "unknown key": BadInput("precison", {"matched": {"precison": "bf16"}}),
    "unknown precision": BadInput("fp8", {"fixed_prefix": {"precisions": ["bf16", "fp8"]}}),
    "unknown construction": BadInput("replay", {"fixed_prefix": {"constructions": ["incremental", "replay"]}}),
    "chunk size 0": BadInput("chunked:0", {"fixed_prefix": {"constructions": ["incremental", "chunked:0"]}}),
    "chunk size not a number": BadInput("chunked:x", {"fixed_prefix": {"constructions": ["incremental", "chunked:x"]}}),
    "no incremental": BadInput(
        "must include incremental", {"fixed_prefix": {"constructions": ["prefill", "chunked:4"]}}
    ),
    "outcome-blind sample too large": BadInput("larger than", {"transplant": {"outcome_blind": {"sample": 99}}}),
    "layer out of range": BadInput("layer 7 out of range", {"transplant": {"sweep": {"single_layers": [0, 7]}}}),
    "block larger than the model": BadInput(
        "exceeds the model", {"transplant": {"sweep": {"single_layers": "all", "block_sizes": [5]}}}
    ),
    "unknown outcome-blind checkpoint": BadInput(
        "not in checkpoints", {"transplant": {"outcome_blind": {"checkpoint": "nope"}}}
    ),
    "cross precision equals E1's": BadInput("must differ", {"transplant": {"cross_precision": "bf16"}}),
    "audit threads 0": BadInput("audit.runtime.threads", {"audit": {"runtime": {"threads": 0}}}),
    # snakemake --config reads values inside a mapping as strings: 24 arrives as '24'
    "a nested --config override": BadInput(
        "config key items.limit: '2' is not of type 'integer', 'null' — unquote it; if it came from snakemake"
        " --config, which passes a value inside a mapping as a string, give that override in a YAML file",
        snakemake_args=("--config", 'items={"source": "items.jsonl", "limit": 2}'),
    ),
    "ledger_dir is a file": BadInput("is a file, not a directory", prepare=ledger_dir_is_a_file),
    # items
    "duplicate ids": BadInput("duplicate id", items=ITEM % "a" * 2),
    "unsafe id": BadInput("../x", items=ITEM % "../x"),
    "malformed row": BadInput("line 2", items=ITEM % "a" + '{"id": "b"\n'),
    "empty item file": BadInput("contains no items", items=""),
    "missing item file": BadInput("not found", prepare=missing_item_file),
    "item file not UTF-8": BadInput(
        "line 2: not UTF-8 text (byte 0xe9) — save the file as UTF-8", prepare=latin1_item_file
    ),
    # model
    "missing model folder": BadInput("does not exist", {"checkpoints": {"mine": {"folder": "/nonexistent/model"}}}),
    "two model sources": BadInput(
        "exactly one source", {"checkpoints": {"mine": {"folder": "/tmp", "embedded": True}}}
    ),
    "model folder without config.json": BadInput("has no config.json", prepare=folder_without_config),
    "an engine the registry does not have": BadInput(
        "checkpoints.tiny.engine: unknown engine 'vllm' — use one of transformers, llamacpp",
        {"checkpoints": {"tiny": {"engine": "vllm", "random_qwen2": {"seed": 0}}}},
    ),
    "bf16 on a llama.cpp checkpoint": BadInput(
        "whose precision is the KV cache type: bf16 is not one",
        {"checkpoints": {"tiny": {"engine": "llamacpp", "random_qwen2": {"seed": 0}}}},
    ),
    "a llama.cpp cache type on a transformers checkpoint": BadInput(
        "q8_0 is a llama.cpp cache type — use bf16, fp16 or fp32", {"fixed_prefix": {"precisions": ["bf16", "q8_0"]}}
    ),
    "a quantized V cache without flash attention": BadInput(
        "llama.cpp stores a q8_0 V cache only with flash attention — set runtime.flash_attn: true",
        {
            "checkpoints": {"tiny": {"engine": "llamacpp", "random_qwen2": {"seed": 0}}},
            "matched": {"precision": "q8_0"},
            "fixed_prefix": {"precisions": ["q8_0"]},
            "transplant": {"cross_precision": None},
        },
    ),
    "a quantized cache cast to another precision": BadInput(
        "a q8_0 cache cannot be cast to fp16",
        {
            "checkpoints": {"tiny": {"engine": "llamacpp", "random_qwen2": {"seed": 0}}},
            "runtime": {"flash_attn": True},
            "matched": {"precision": "q8_0"},
            "fixed_prefix": {"precisions": ["q8_0"]},
            "transplant": {"cross_precision": "fp16"},
        },
    ),
    "llama.cpp flash attention on a transformers checkpoint": BadInput(
        "runtime.flash_attn is llama.cpp's flash attention", {"runtime": {"flash_attn": True}}
    ),
    "gguf checksum mismatch": BadInput("checksum mismatch", prepare=fake_gguf, in_job=True),
    "pickle weights only": BadInput("no .safetensors weights", prepare=pickle_only_folder, in_job=True),
    "cuda without a GPU": BadInput(
        "no CUDA device",
        {"checkpoints": {"tiny-cuda": {"random_qwen2": {"seed": 0}}}, "runtime": {"device": "cuda"}},
        in_job=True,
    ),
    "model larger than the device memory": BadInput(
        "GB are available (runtime.device_memory_gb)",
        {"checkpoints": {"tiny-small-device": {"random_qwen2": {"seed": 0}}}, "runtime": {"device_memory_gb": 0.01}},
        in_job=True,
    ),
    "prompt longer than the context": BadInput(
        "exceeds the model's context",
        {"checkpoints": {"tiny-long": {"random_qwen2": {"seed": 0}}}, "stage": {"suffix_tokens": 5000}},
        in_job=True,
    ),
    # ledger
    "verify a folder that is no ledger": BadInput("no ledger at", prepare=not_a_ledger, command="verify"),
    "shard table overwritten": BadInput("unreadable Parquet", damage=overwrite_a_shard, command="verify"),
    "object corrupt before the audit": BadInput(
        "content hashes to", damage=flip_a_byte_of_an_object, command="audit", in_job=True
    ),
}


def one_line_error(output: str, needle: str) -> str:
    lines = [line for line in output.splitlines() if needle in line]
    assert lines, output[-3000:]
    assert "—" in lines[0], lines[0]  # the line names the fix too
    return lines[0]


def assert_ledger_kept(before: dict, after: dict, in_job: bool) -> None:
    if not in_job:
        assert after == before
        return
    assert {path: digest for path, digest in after.items() if path in before} == before
    for path in set(after) - set(before):  # only what a new checkpoint prepares before its first model job
        assert path.split("/")[0] in ("logs", "models", "downloads", "prompts", "vocab"), path


@pytest.mark.parametrize("case", list(CATALOGUE))
def test_bad_input_stops_with_one_line_and_leaves_the_ledger(case, test_run, tmp_path):
    bad = CATALOGUE[case]
    workdir, ledger, config = test_run
    if bad.damage:
        ledger, config = copy_run(workdir, tmp_path / "copy")
        workdir = tmp_path / "copy"
        bad.damage(ledger)
    overrides = dict(bad.overrides)
    if bad.items is not None:
        (tmp_path / "bad.jsonl").write_text(bad.items)
        overrides["items"] = {"source": str(tmp_path / "bad.jsonl"), "limit": None}
    if bad.prepare:
        overrides.update(bad.prepare(tmp_path))
    before = ledger_snapshot(ledger)
    if bad.command == "verify":
        result = stagereplay("verify", overrides.get("verify", ledger))
    else:
        config = write_config(tmp_path / "bad.yaml", **{"ledger_dir": str(ledger), **overrides})
        result = snakemake(
            workdir, config, *bad.snakemake_args, *(["--config", "mode=audit"] if bad.command == "audit" else [])
        )
    assert result.returncode != 0
    one_line_error(result.stdout + result.stderr, bad.needle)
    assert_ledger_kept(before, ledger_snapshot(ledger), bad.in_job)
