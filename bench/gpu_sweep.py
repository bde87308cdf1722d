"""A kernel sweep on one device with a tiny random Qwen2: does live vs prefill stay exact per kernel?

For each setting (precision, attention implementation, SDPA backend, TF32) the same items run E1's
constructions through the library: a live greedy stage, a one-shot prefill and an incremental
rebuild of the same tokens, both continued greedily, and a second live run (replica). A batch
column prefills each item alone and inside a left-padded batch of others and compares the item's
own cache rows. The model is built from a seed on the device (no download), with near-tied output
logits, so a last-bit difference in a cache shows as a different suffix.

    python bench/gpu_sweep.py --device cuda --out ledger/gpu_sweep.md     # on a GPU node
    python bench/gpu_sweep.py --device cpu --items 4 --quick               # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stagereplay.engines.base import Runtime
from stagereplay.engines.transformers.engine import load_model
from stagereplay.experiments.constructions import StageBoundary, build_boundary_state, build_live
from stagereplay.experiments.decode import continue_from
from stagereplay.inputs.checkpoints import build_random_qwen2
from stagereplay.ledger.fingerprint import fingerprint_cache

STAGE_TOKENS = 16
SUFFIX_TOKENS = 16
BATCH = 4


@dataclass(frozen=True)
class Setting:
    precision: str
    attention: str  # eager or sdpa
    backend: str  # the SDPA backend forced, "default" for PyTorch's choice, "-" for eager
    tf32: bool

    def label(self) -> list[str]:
        return [self.precision, self.attention, self.backend, "on" if self.tf32 else "off"]


def settings(device: str, quick: bool) -> list[Setting]:
    grid = [Setting("bf16", "eager", "-", False), Setting("bf16", "sdpa", "default", False)]
    if device == "cuda" and not quick:
        grid += [Setting("bf16", "sdpa", name, False) for name in ("math", "flash", "efficient", "cudnn")]
    grid += [Setting("fp32", "eager", "-", False), Setting("fp32", "sdpa", "default", False)]
    if device == "cuda":
        grid += [Setting("fp32", "eager", "-", True), Setting("fp32", "sdpa", "default", True)]
    return grid


def sdpa_context(backend: str):
    if backend in ("default", "-"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[backend]
    return sdpa_kernel([chosen])


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Byte tokens of the random model's tokenizer; ids 3.. avoid its special tokens.
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(32, 97))] for _ in range(count)]


def batch_rows(engine, items: list[list[int]], index: int) -> tuple[bool, bool]:
    """Item ``index`` prefilled alone vs inside a left-padded batch: (cache rows differ, next token differs)."""
    model, device = engine.model, engine.device
    alone_cache = engine.empty_cache()
    alone_logits = engine.forward(items[index], alone_cache)
    members = [items[(index + offset) % len(items)] for offset in range(BATCH)]
    width = max(map(len, members))
    ids = torch.zeros(len(members), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(members):
        ids[row, width - len(tokens) :] = torch.tensor(tokens, device=device)
        mask[row, width - len(tokens) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batch_cache = engine.empty_cache()
    with torch.inference_mode():
        output = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            cache=batch_cache,
        )
    own = len(items[index])
    alone, batched = engine.snapshot(alone_cache), engine.snapshot(batch_cache)
    differ = any(
        not torch.equal(a[0], b[0:1, :, width - own :][0])
        for a, b in zip(alone.keys + alone.values, batched.keys + batched.values)
    )
    return differ, int(alone_logits.argmax()) != int(output.logits[0, -1].float().argmax())


def run_setting(folder: Path, setting: Setting, device: str, items: list[list[int]]) -> list[str]:
    loaded = load_model(
        folder, Runtime(precision=setting.precision, device=device, threads=1, attn_implementation=setting.attention)
    )
    if setting.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    engine, eos = loaded, loaded.eos_ids
    caches_differ = suffixes_differ = bridge_exact = replicas_exact = batch_caches = batch_tokens = 0
    started = time.perf_counter()
    with sdpa_context(setting.backend):
        for index, prompt in enumerate(items):
            boundary = StageBoundary(max_new_tokens=STAGE_TOKENS)
            live = build_live(engine, prompt, boundary, eos, loaded.tokenizer)
            again = build_live(engine, prompt, boundary, eos, loaded.tokenizer)
            prefix, pending = list(live.prefix), live.prefix[-1]
            prefill = build_boundary_state(engine, prefix, "prefill", len(prompt))
            incremental = build_boundary_state(engine, prefix, "incremental", len(prompt))
            live_digest = fingerprint_cache(live.state).digest
            caches_differ += live_digest != fingerprint_cache(prefill).digest
            bridge_exact += live_digest == fingerprint_cache(incremental).digest
            replicas_exact += live_digest == fingerprint_cache(again.state).digest and live.prefix == again.prefix
            live_suffix = continue_from(engine, live.state, pending, SUFFIX_TOKENS, eos).tokens
            prefill_suffix = continue_from(engine, prefill, pending, SUFFIX_TOKENS, eos).tokens
            suffixes_differ += live_suffix != prefill_suffix
            differ, flipped = batch_rows(engine, items, index)
            batch_caches += differ
            batch_tokens += flipped
    seconds = time.perf_counter() - started
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    n = len(items)
    return [
        *setting.label(),
        f"{caches_differ}/{n}",
        f"{suffixes_differ}/{n}",
        f"{bridge_exact}/{n}",
        f"{replicas_exact}/{n}",
        f"{batch_caches}/{n}",
        f"{batch_tokens}/{n}",
        f"{seconds:.1f}",
    ]


HEADER = [
    "precision",
    "attention",
    "SDPA backend",
    "TF32",
    "live≠prefill caches",
    "suffixes differ",
    "bridge bit-exact",
    "replicas exact",
    f"batch {BATCH}: item's cache rows differ",
    f"batch {BATCH}: next token differs",
    "seconds",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="fewer settings (a smoke run)")
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = build_random_qwen2(
            Path(scratch) / "model", seed=2, layers=args.layers, hidden=args.hidden, near_ties=True
        )
        vocab = load_model(folder, Runtime(precision="fp32", device="cpu", threads=1)).model.config.vocab_size
        items = prompts(args.items, vocab)
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        for setting in settings(args.device, args.quick):
            try:
                row = run_setting(folder, setting, args.device, items)
            except Exception as error:  # a backend the device or deterministic mode refuses is a result too
                row = [*setting.label(), f"not run: {type(error).__name__}: {str(error).splitlines()[0][:120]}"]
                row += [""] * (len(HEADER) - len(row))
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    intro = (
        f"device: {device_name}; torch {torch.__version__}; tiny random Qwen2 (near-tied head), "
        f"{args.layers} layers, hidden {args.hidden}; {args.items} items; stage {STAGE_TOKENS}, suffix {SUFFIX_TOKENS} tokens; "
        "deterministic algorithms on, TF32 off unless the row says on"
    )
    table = "\n".join([intro, "", *lines]) + "\n"
    print("\n" + table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()
