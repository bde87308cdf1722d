"""E6's levels as settings: how each one builds an item's boundary state over ``prefix[:-1]`` and how it
continues from one (the job that runs them is ``factor_job``; the cells and verdicts are defined in
``design.factors``).

The reference setting is the one E2 ran: a one-shot prefill, then greedy decoding at batch 1 with the
run's threads and attention. A test level switches a setting around its builds and reads (threads,
attention; on llama.cpp a new context with flash attention, micro-batch size, cache type or rotation
changed), builds another way (chunks, a prefix-cache hit), runs in a batch (of other items, padded, or of
the item repeated), or runs in a worker process of its own (CPU kernels, fixed when torch starts, with
oneDNN's and MKL's ISA pinned alike: ``kernel_worker``). A cache another setting wrote is converted
before it is read only where the two store different things (a cache type): ``for_reference`` and
``for_test`` say how, and the row records the converted cache.

Each factor's control level (``design.factors.Factor.control``) is the reference setting run by the same
class as a test level: the switch set to the run's own value, batch 1 through the batched path, one chunk
of the whole context, the whole context through the prefix store, the worker at torch's own kernel level.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from stagereplay.design.factors import WHOLE, FactorError, Level, factor_named
from stagereplay.engines.base import ModelError, Runtime
from stagereplay.experiments.constructions import build_boundary_state
from stagereplay.experiments.decode import Decoded, greedy_choice
from stagereplay.experiments.level_job import Built, Prefix
from stagereplay.experiments.setting import Setting, mechanism, runs, runs_by
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState, to_host
from stagereplay.ledger.store import ObjectStore, store_cache
from stagereplay.ledger.tables import LedgerError


class Switched(Setting):
    """A level the engine switches to around each build and read, then back: threads, attention kernel."""

    def __init__(self, engine, budget, eos, switch: Callable[[object], None], value, reference_value):
        super().__init__(engine, budget, eos)
        self.switch, self.value, self.reference_value = switch, value, reference_value

    @contextmanager
    def active(self):
        self.switch(self.value)
        try:
            yield
        finally:
            self.switch(self.reference_value)


@runs("threads")
class Threads(Switched):
    @classmethod
    def for_level(cls, level, job):
        return cls(job.engine, job.budget, job.eos, job.engine.use_threads, level.value, job.runtime.threads)


@runs("attention")
class Attention(Switched):
    @classmethod
    def for_level(cls, level, job):
        engine = job.engine
        return cls(engine, job.budget, job.eos, engine.use_attention, level.value, job.runtime.attn_implementation)

    def unavailable(self):
        """An attention kernel whose package is absent (flash_attention_2) is recorded as not applicable: the engine
        refuses to switch to it."""
        try:
            self.engine.use_attention(self.value)
        except ModelError as error:
            return str(error)
        self.engine.use_attention(self.reference_value)
        return None


@runs_by("context", "restart")
class Reconfigured(Switched):
    """A factor an engine applies as a new context (llama.cpp) or a server restart (llama-server) around each build
    and read, then goes back to the run's own value: flash attention, micro-batch size, cache type, rotation.
    The engine takes the level's value under the factor's name (``reconfigure(flash_attn=False)``); the run's own value
    is the factor's reference level, read by the factor's own grammar."""

    def __init__(self, engine, budget, eos, factor: str, value, reference_value):
        super().__init__(engine, budget, eos, lambda v: engine.reconfigure(**{factor: v}), value, reference_value)

    @classmethod
    def for_level(cls, level, job):
        reference = level.factor_type.value(level.factor_type.reference(dataclasses.asdict(job.runtime), None))
        return cls(job.engine, job.budget, job.eos, level.factor, level.value, reference)

    def build(self, prefix):
        with self.active():
            state = build_boundary_state(self.engine, list(prefix.tokens), "prefill", prefix.prompt_length)
            return Built(state, f"llama.cpp context: {self.engine.build_description()}")


@runs("cache_type")
class CacheType(Reconfigured):
    """A KV cache type. Built natively in a context of that type; read across types after a conversion
    (the engine's ``converted``): a test-built cache dequantized for the reference's context (t, r), and
    the reference cache quantized offline, by gguf's reference quantizer, for the test context (r, t)."""

    def for_reference(self, state):
        return self.engine.converted(state)

    def for_test(self, state):
        with self.active():
            return self.engine.converted(state)


@runs("chunk")
class Chunk(Setting):
    def __init__(self, engine, budget, eos, chunk: int):
        super().__init__(engine, budget, eos)
        self.chunk = chunk

    @classmethod
    def for_level(cls, level, job):
        return cls(job.engine, job.budget, job.eos, level.value)

    def build(self, prefix):
        context = len(prefix.tokens) - 1
        size = self.chunk or context  # 0 (whole, the control): one chunk of the whole context
        chunks = -(-context // size)
        state = build_boundary_state(self.engine, list(prefix.tokens), f"chunked:{size}", prefix.prompt_length)
        return Built(state, f"{chunks} chunks of at most {size} over {context} positions")


@runs("prefix_reuse")
class PrefixReuse(Setting):
    """A prefix-cache hit: the first k positions come from an earlier request's cache, saved to an object
    store and loaded back (the same safetensors round trip as the ledger's); the rest is prefilled on top
    in one forward. The reference (a miss) prefills everything in one forward. An engine that keeps
    sequences itself reuses them its own way (``HeldPrefix``)."""

    def __init__(self, engine, budget, eos, level: Level, scratch: ObjectStore, model_fingerprint: str, precision):
        super().__init__(engine, budget, eos)
        self.level, self.scratch = level, scratch
        self.model_fingerprint, self.precision = model_fingerprint, precision

    @classmethod
    def for_level(cls, level, job):
        kind = HeldPrefix if mechanism(job, "prefix_reuse") == "kept" else PrefixReuse
        return kind(
            job.engine, job.budget, job.eos, level, job.scratch, job.record["fingerprint"], job.runtime.precision
        )

    def reused(self, prefix: Prefix) -> int:
        context = len(prefix.tokens) - 1
        if self.level.value == "prompt":
            return min(prefix.prompt_length, context)
        if self.level.value == WHOLE:
            return context  # the control: the one-shot prefill itself, through the store
        block = self.level.value
        reused = (context // block) * block
        if reused == 0:
            raise FactorError(
                f"factors.prefix_reuse block:{block}: item {prefix.item_id} has {context} cached positions, fewer"
                f" than one block, so the hit would reuse nothing — use a block size of at most {context}"
            )
        return reused

    def build(self, prefix):
        context, reused = prefix.context, self.reused(prefix)
        cache = self.engine.empty_cache()
        with torch.inference_mode():
            self.engine.forward(context[:reused], cache)
        earlier = to_host(self.engine.snapshot(cache))
        digest = fingerprint_cache(earlier).digest
        store_cache(self.scratch, earlier, digest, self.model_fingerprint, self.precision)
        loaded = KVState.from_named_tensors(self.scratch.get(digest))
        if loaded.num_positions != reused:
            raise LedgerError(
                f"item {prefix.item_id}: the reused cache holds {loaded.num_positions} positions, not {reused}"
            )
        cache = self.engine.to_cache(loaded)
        if reused < len(context):
            with torch.inference_mode():
                self.engine.forward(context[reused:], cache)
        rest = len(context) - reused
        return Built(self.engine.snapshot(cache), f"{reused} positions reused, {rest} prefilled on top", reused, digest)


class HeldPrefix(PrefixReuse):
    """A prefix-cache hit through the engine's own mechanism (llama.cpp), never a simulation.

    ``prompt`` / ``block:N``: the slot keeps an earlier request in its context — that request's tokens, one
    prefill, then the token it generated — and the new request keeps the longest common prefix of the two
    token lists (``truncate``, llama.cpp's ``llama_memory_seq_rm``), then decodes only the rest in one call.
    ``restore:...``: the earlier request's sequence is saved to a file with its tokens and restored into an
    emptied context (``llama_state_seq_save_file`` / ``load_file``: a server's slot save and restore)."""

    def build(self, prefix):
        context, reused = prefix.context, self.reused(prefix)
        earlier = context[:reused]
        cache = self.engine.empty_cache()
        with torch.inference_mode():
            logits = self.engine.forward(earlier, cache)
            if self.level.restores:
                path = Path(self.scratch.root) / "slot.bin"
                size = self.engine.save_sequence(cache, path, earlier)
                cache, tokens = self.engine.load_sequence(path, len(context) + 1)
                path.unlink()
                if tokens != earlier:
                    raise LedgerError(
                        f"item {prefix.item_id}: the restored sequence holds other tokens than were saved"
                    )
                kept, how = reused, f"restored from a {size}-byte slot file"
            else:
                held = [*earlier, greedy_choice(logits)[0]]
                self.engine.forward(held[-1:], cache)
                kept = next((i for i, (a, b) in enumerate(zip(held, context)) if a != b), min(len(held), len(context)))
                self.engine.truncate(cache, kept)
                how = f"kept in the context (the earlier request held {len(held)})"
            if kept == 0:
                raise FactorError(f"factors.prefix_reuse {self.level.name}: item {prefix.item_id} would reuse nothing")
            reused_digest = fingerprint_cache(self.engine.snapshot(cache)).digest
            if kept < len(context):
                self.engine.forward(context[kept:], cache)
        note = f"{kept} positions {how}, {len(context) - kept} decoded on top"
        return Built(self.engine.snapshot(cache), note, kept, reused_digest)


@runs("kernels")
class Kernels(Setting):
    """torch's CPU kernels are fixed when it starts, so the test level runs in a worker process of its own
    (``run_kernel_worker``), started with ATen's capability and oneDNN's and MKL's ISA pinned (``Kernels.environment``
    in design.factors): it builds each item's cache and continues both that cache and the reference one. The caches (and each continuation's first logits) cross between the processes
    through a scratch object store, fingerprint-checked on reading; (t, r) is then continued here, at the reference level."""

    def __init__(self, engine, budget, eos, level: Level, scratch: ObjectStore, model_record, runtime: Runtime):
        super().__init__(engine, budget, eos)
        self.level, self.scratch, self.model_record, self.runtime = level, scratch, model_record, runtime
        # The control (own) runs the worker at the level torch picked in this process, set explicitly.
        self.pins = factor_named("kernels").environment(level.name, engine.environment.cpu_capability)
        self.capability = self.pins["ATEN_CPU_CAPABILITY"]
        self.reported = ""  # the ISA each library in the worker reports, in words (every row of the level)
        self.results: dict[str, dict] = {}
        self.worker_fed = 0  # positions the worker fed for the builds and reads consumed so far

    @classmethod
    def for_level(cls, level, job):
        return cls(job.engine, job.budget, job.eos, level, job.scratch, job.record["path"], job.runtime)

    def fed_positions(self) -> int:
        return self.engine.fed_positions + self.worker_fed

    def run_worker(self, prefixes: list[Prefix], reference_states: dict[str, KVState], record: dict) -> None:
        digests = {}
        for prefix in prefixes:
            state = to_host(reference_states[prefix.item_id])
            digests[prefix.item_id] = fingerprint_cache(state).digest
            store_cache(self.scratch, state, digests[prefix.item_id], record["fingerprint"], self.runtime.precision)
        request = {
            "model_record": str(self.model_record),
            "runtime": dataclasses.asdict(self.runtime),
            "budget": self.budget,
            "items": [{**dataclasses.asdict(prefix), "reference": digests[prefix.item_id]} for prefix in prefixes],
        }
        folder = Path(self.scratch.root)
        (folder / "request.json").write_text(json.dumps(request))
        environment = {**os.environ, **self.pins}
        done = subprocess.run(
            [sys.executable, "-m", "stagereplay", "kernel-worker", str(folder)],
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelError(f"the kernels={self.capability} worker failed: {last}")
        answer = json.loads((folder / "answer.json").read_text())
        if answer["cpu_capability"].lower() != self.capability:
            raise FactorError(
                f"factors.kernels: ATEN_CPU_CAPABILITY={self.capability} gave torch's {answer['cpu_capability']}"
                " kernels — this torch build cannot run that level; remove it"
            )
        self.results = answer["items"]
        pinned = ", ".join(f"{name}={value}" for name, value in self.pins.items())
        self.reported = f"ATen {answer['cpu_capability']}, oneDNN {answer['onednn_isa']}, MKL {answer['mkl_instructions']} ({pinned})"

    def build(self, prefix):
        result = self.results[prefix.item_id]
        self.worker_fed += result["built_positions"]
        state = KVState.from_named_tensors(self.scratch.get(result["built"]))
        return Built(state, f"built in the kernels={self.level.name} worker: {self.reported}")

    def read(self, prefix, state, built):
        if prefix.ended_by_eos:
            return Decoded((), (), "eos")
        continued = self.results[prefix.item_id]["continued"][fingerprint_cache(to_host(state)).digest]
        self.worker_fed += continued["positions"]
        first = self.scratch.get(continued["first_logits"])["logits"]  # decoded: the stage did not end the answer
        tokens, margins, tops = (tuple(continued[key]) for key in ("tokens", "margins", "top_logits"))
        return Decoded(tokens, margins, continued["stop"], first_logits=first, top_logits=tops)
