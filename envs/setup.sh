#!/usr/bin/env bash
# Create .venv and install the CPU environment (idempotent; quick when already installed).
# SPEC=envs/cuda.txt bash envs/setup.sh installs the CUDA environment instead. A spec may name a script
# to run after its packages, on a line "# build: envs/SCRIPT.sh" (envs/llamaserver.txt builds llama-server).
set -euo pipefail
cd "$(dirname "$0")/.."
spec="${SPEC:-envs/cpu.txt}"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r "$spec"
for script in $(sed -n 's/^# build: //p' "$spec"); do bash "$script"; done
