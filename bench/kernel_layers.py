"""Which cache layers the kernels factor's environments change: one bf16 prefill of a checkpoint, run once in
this process's environment and once per kernel environment in a process of its own, compared layer by layer.

    python bench/kernel_layers.py ledger/models/smollm2-135m/model.json [--level avx2] [--positions 140]

Prints one row per environment: what ATen and oneDNN report, the layers whose K or V differ from the
reference's, the first of them, and the largest |ΔK| and |ΔV| at layer 0. "ATen only" is the environment the
kernels factor used before it pinned oneDNN and MKL (ATEN_CPU_CAPABILITY alone)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from stagereplay.design.factors import factor_named


def prefill(record: str, positions: int, out: Path) -> None:
    """The child's side: prefill fixed token ids, save the K/V and print what the libraries report."""
    from stagereplay.engines.base import Runtime
    from stagereplay.engines.registry import load_checkpoint
    from stagereplay.experiments.kernel_worker import onednn_isa
    from stagereplay.inputs.checkpoints import read_model_record

    engine = load_checkpoint(read_model_record(record), Runtime(precision="bf16", device="cpu", threads=1))
    cache = engine.empty_cache()
    engine.forward(list(range(1000, 1000 + positions)), cache)
    state = engine.snapshot(cache)
    torch.save({"k": list(state.keys), "v": list(state.values)}, out)
    print(f"ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN {onednn_isa()}")


def run(record: str, positions: int, environment: dict[str, str], out: Path) -> str:
    done = subprocess.run(
        [sys.executable, __file__, record, "--child", str(out), "--positions", str(positions)],
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_record")
    parser.add_argument("--level", default="avx2")
    parser.add_argument("--positions", type=int, default=140)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        prefill(args.model_record, args.positions, Path(args.child))
        return
    pins = factor_named("kernels").environment(args.level, "unused")
    environments = {
        "reference (this process's)": {},
        f"ATen only (ATEN_CPU_CAPABILITY={args.level})": {"ATEN_CPU_CAPABILITY": pins["ATEN_CPU_CAPABILITY"]},
        f"kernels={args.level} (" + ", ".join(f"{k}={v}" for k, v in pins.items()) + ")": pins,
    }
    with tempfile.TemporaryDirectory() as folder:
        reported, caches = {}, {}
        for name, environment in environments.items():
            out = Path(folder) / f"{len(caches)}.pt"
            reported[name] = run(args.model_record, args.positions, environment, out)
            caches[name] = torch.load(out)
    reference = caches[next(iter(caches))]
    print("| environment | reports | layers differing | first | layer 0 max abs dK | layer 0 max abs dV |")
    print("|---|---|---|---|---|---|")
    for name, cache in caches.items():
        differing = [
            layer
            for layer in range(len(reference["k"]))
            if not (
                torch.equal(reference["k"][layer], cache["k"][layer])
                and torch.equal(reference["v"][layer], cache["v"][layer])
            )
        ]
        dk, dv = ((reference[part][0].float() - cache[part][0].float()).abs().max().item() for part in ("k", "v"))
        first = differing[0] if differing else "—"
        print(f"| {name} | {reported[name]} | {len(differing)}/{len(reference['k'])} | {first} | {dk:.3g} | {dv:.3g} |")


if __name__ == "__main__":
    main()
