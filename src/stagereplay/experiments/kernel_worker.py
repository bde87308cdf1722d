"""The kernels factor: torch fixes its CPU kernels when it starts (ATen's ATEN_CPU_CAPABILITY; oneDNN's and
MKL's ISA, pinned at the same level: ``design.factors.KERNEL_PINS``), so the ``Kernels`` setting starts
``stagereplay kernel-worker`` with the level set, and the worker builds each item's cache at that level and
continues it and the reference cache. Requests and answers cross as JSON files; caches and each continuation's
first logits as a scratch object store, fingerprint-checked. The worker reports the ISA each library runs."""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from stagereplay.engines.base import Runtime
from stagereplay.engines.registry import load_checkpoint
from stagereplay.experiments.level_job import Prefix
from stagereplay.experiments.setting import Setting
from stagereplay.inputs.checkpoints import read_model_record
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState, to_host
from stagereplay.ledger.store import ObjectStore, store_cache


@functools.cache  # oneDNN writes its header once per process
def onednn_isa() -> str:
    """The ISA oneDNN reports it runs (its verbose header, written to the process's stdout by C code, so
    read through the file descriptor), after one oneDNN primitive (a reorder)."""
    sys.stdout.flush()
    with tempfile.TemporaryFile(mode="w+") as sink:
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                torch.ones(8, 8).to_mkldnn().to_dense()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        lines = [line for line in sink.read().splitlines() if ",isa:" in line]
    return lines[0].split(",isa:", 1)[1] if lines else "not reported"


def run_kernel_worker(folder: str | Path) -> None:
    """The kernels factor's test side, in a process started with ATEN_CPU_CAPABILITY set: for each item,
    build its cache (stored in the scratch store ``folder``) and continue it and the reference cache."""
    folder = Path(folder)
    request = json.loads((folder / "request.json").read_text())
    record = read_model_record(request["model_record"])
    runtime = Runtime(**request["runtime"])
    engine = load_checkpoint(record, runtime)
    scratch = ObjectStore(folder)
    setting = Setting(engine, request["budget"], engine.eos_ids)
    items = {}
    for entry in request["items"]:
        prefix = Prefix(entry["item_id"], tuple(entry["tokens"]), entry["prompt_length"], entry["ended_by_eos"])
        start = engine.fed_positions
        built = to_host(setting.build(prefix).state)
        built_positions = engine.fed_positions - start
        digest = fingerprint_cache(built).digest
        store_cache(scratch, built, digest, record["fingerprint"], runtime.precision)
        continued = {}
        for state in (built, KVState.from_named_tensors(scratch.get(entry["reference"]))):
            start = engine.fed_positions
            decoded = setting.read(prefix, state, None)
            continued[fingerprint_cache(state).digest] = {
                "tokens": list(decoded.tokens),
                "margins": list(decoded.margins),
                "top_logits": list(decoded.top_logits),
                # The logits of the first read cross as an object of the scratch store, like the caches.
                "first_logits": (
                    None
                    if decoded.first_logits is None
                    else scratch.put({"logits": decoded.first_logits}, {"kind": "first_logits"})
                ),
                "stop": decoded.stop,
                "positions": engine.fed_positions - start,
            }
        items[prefix.item_id] = {"built": digest, "built_positions": built_positions, "continued": continued}
    answer = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_isa": onednn_isa(),
        "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "unpinned"),  # MKL reports no ISA
        "items": items,
    }
    (folder / "answer.json").write_text(json.dumps(answer))
