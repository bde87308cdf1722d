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

import copy
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from stagereplay.design.factors import WHOLE, FactorError, Level, factor_named
from stagereplay.engines.base import Engine, ModelError, Runtime
from stagereplay.engines.transformers.spec import RUN_ATTENTION
from stagereplay.experiments.constructions import build_boundary, build_boundary_state
from stagereplay.experiments.decode import Decoded, continue_from, decode_greedy, generate_greedy, greedy_choice
from stagereplay.experiments.level_job import Built, LevelJob, Prefix
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState, to_host
from stagereplay.ledger.store import ObjectStore, store_cache
from stagereplay.ledger.tables import LedgerError

# factor name -> the setting that runs its test levels (each class says which factor it runs)
SETTINGS: dict[str, type[Setting]] = {}


def runs(factor: str):
    """Register a setting class as the one that runs ``factor``'s test levels."""

    def register(cls):
        SETTINGS[factor] = cls
        return cls

    return register


class Setting:
    """The reference level: a one-shot prefill, then batch-1 greedy decoding with the run's settings."""

    def __init__(self, engine: Engine, budget: int, eos: frozenset[int]):
        self.engine, self.budget, self.eos = engine, budget, eos

    @classmethod
    def for_level(cls, level: Level, job: LevelJob) -> Setting:
        """This setting at a factor's test level."""
        return cls(job.engine, job.budget, job.eos)

    def unavailable(self) -> str | None:
        """Why the level cannot run here (recorded on every row of the job), or None."""
        return None

    def runs(self) -> tuple[int | None, ...]:
        """The runs of each item's cells: one, unnumbered, where this setting pins its whole input, so that
        a second run must reproduce the first; numbered runs where it does not (``ConcurrentLoad``)."""
        return (None,)

    def fed_positions(self) -> int:
        """Positions fed through the model so far for this setting's builds and reads (and the job's)."""
        return self.engine.fed_positions

    @contextmanager
    def active(self) -> Iterator[None]:
        yield

    def build(self, prefix: Prefix) -> Built:
        with self.active():
            return Built(build_boundary_state(self.engine, list(prefix.tokens), "prefill", prefix.prompt_length), "")

    def read(self, prefix: Prefix, state: KVState, built: Built | None) -> Decoded:
        """Continue from ``state``; ``built`` is this level's build of the same item (batch companions)."""
        if prefix.ended_by_eos:
            return Decoded((), (), "eos")
        with self.active():
            return continue_from(self.engine, state, prefix.tokens[-1], self.budget, self.eos)

    def with_budget(self, budget: int) -> Setting:
        """This setting, decoding at most ``budget`` tokens (E6 replays the reference only as far as it needs)."""
        shorter = copy.copy(self)
        shorter.budget = budget
        return shorter

    def for_reference(self, state: KVState) -> KVState:
        """A cache this level built, as the reference setting reads it (as it is, unless it stores another type)."""
        return state

    def for_test(self, state: KVState) -> KVState:
        """The reference cache, as this level reads it."""
        return state


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
        """An attention kernel whose package is absent (flash_attention_2) is recorded as not applicable."""
        if self.value in RUN_ATTENTION:
            return None  # built into transformers
        try:
            self.engine.use_attention(self.value)
        except ModelError as error:
            return str(error)
        self.engine.use_attention(self.reference_value)
        return None


class Reconfigured(Switched):
    """A llama.cpp context setting (flash attention, micro-batch size, cache type, rotation): the engine
    makes a new context with it around each build and read, then goes back to the reference's."""

    key = ""  # the engine's name of the context setting

    def __init__(self, engine, budget, eos, key: str, value, reference_value):
        super().__init__(engine, budget, eos, lambda v: engine.reconfigure(**{key: v}), value, reference_value)

    @classmethod
    def for_level(cls, level, job):
        return cls(job.engine, job.budget, job.eos, cls.key, level.value, cls.reference_value_of(job.runtime))

    @staticmethod
    def reference_value_of(runtime: Runtime):
        raise NotImplementedError

    def build(self, prefix):
        with self.active():
            state = build_boundary_state(self.engine, list(prefix.tokens), "prefill", prefix.prompt_length)
            return Built(state, f"llama.cpp context: {self.engine.build_description()}")


@runs("flash_attn")
class FlashAttn(Reconfigured):
    key = "flash_attn"

    @staticmethod
    def reference_value_of(runtime):
        return runtime.flash_attn


@runs("ubatch")
class Ubatch(Reconfigured):
    key = "n_ubatch"

    @staticmethod
    def reference_value_of(runtime):
        return 0  # the whole prefix in one micro-batch


@runs("rotation")
class Rotation(Reconfigured):
    key = "rotation"

    @staticmethod
    def reference_value_of(runtime):
        return True


@runs("cache_type")
class CacheType(Reconfigured):
    """A KV cache type. Built natively in a context of that type; read across types after a conversion
    (the engine's ``converted``): a test-built cache dequantized for the reference's context (t, r), and
    the reference cache quantized offline, by gguf's reference quantizer, for the test context (r, t)."""

    key = "cache_type"

    @staticmethod
    def reference_value_of(runtime):
        return runtime.precision

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
        kind = HeldPrefix if job.engine.keeps_sequences else PrefixReuse
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


def items_after(order: list[str], item_id: str) -> Iterator[str]:
    """The items after ``item_id`` in ``order``, wrapping round without end: a batch's companions, a filler's
    sources (a fixed function of the item list, not of the ledger's item count)."""
    start = order.index(item_id)
    return (order[(start + offset) % len(order)] for offset in itertools.count(1))


@runs("batch")
class Batch(Setting):
    """The item in row 0 of a batch of B, with B-1 companions: the next B-1 items (by id, wrapping round),
    left-padded, with an attention mask and per-row positions; or, at same-B, the item itself B-1 more times
    (rows of one length: no padding). Built in one batched prefill; read by decoding the batch step by step
    (each row its own greedy token) until the item's row ends. ``unified`` False (``kv_unified``'s levels): each
    sequence in a KV stream of its own instead of one unified cache."""

    def __init__(
        self,
        engine,
        budget,
        eos,
        size: int,
        prefixes: dict[str, Prefix],
        repeated: bool = False,
        unified: bool = True,
    ):
        super().__init__(engine, budget, eos)
        self.size, self.prefixes, self.repeated, self.unified = size, prefixes, repeated, unified
        self.order = sorted(prefixes)

    @classmethod
    def for_level(cls, level, job):
        if job.engine.serves_concurrent_requests:
            return ConcurrentLoad(
                job.engine,
                job.budget,
                job.eos,
                level.value,
                job.prefixes,
                level.of.repeats_item(level.name),
                load_runs=job.load_runs,
            )
        return Batch(job.engine, job.budget, job.eos, level.value, job.prefixes, level.of.repeats_item(level.name))

    def active(self):
        return self.engine.batch_context(self.size, unified=self.unified)

    def companions(self, item_id: str) -> tuple[str, ...]:
        if self.repeated:
            return (item_id,) * (self.size - 1)
        return self.following(item_id, self.size - 1)

    def following(self, item_id: str, count: int) -> tuple[str, ...]:
        """The ``count`` items after ``item_id`` by id, wrapping round (a fixed function of the item list)."""
        return tuple(itertools.islice(items_after(self.order, item_id), count))

    def build(self, prefix):
        companions = self.companions(prefix.item_id)
        rows = [prefix.context] + [self.prefixes[name].context for name in companions]
        with self.active():
            batch, _ = self.engine.batch_forward(None, rows)
            states = [self.engine.batch_row(batch, row) for row in range(len(rows))]
        if self.repeated:
            note = f"batch of {self.size}: the item repeated, rows of one length (no padding)"
        else:
            note = f"batch of {self.size}" + (f" with {', '.join(companions)}" if companions else "")
        if not self.unified:
            note += ", one KV stream per sequence"
        return Built(states[0], note, companions=companions, companion_states=tuple(states[1:]))

    def read(self, prefix, state, built):
        if prefix.ended_by_eos:
            return Decoded((), (), "eos")
        with self.active():
            return self._read(prefix, state, built)

    def _read(self, prefix, state, built):
        batch = self.engine.batch_of([state, *built.companion_states])
        # Row 0 is decoded greedily as at batch 1; the other rows feed their own greedy choices alongside. A
        # finished companion keeps decoding: the batch keeps its shape while the item's row runs.
        others = [self.prefixes[name].tokens[-1] for name in built.companions]

        def feed(token: int) -> torch.Tensor:
            nonlocal batch, others
            batch, logits = self.engine.batch_forward(batch, [[token], *([other] for other in others)])
            others = [greedy_choice(row)[0] for row in logits[1:]]
            return logits[0]

        return decode_greedy(self.engine, None, feed(prefix.tokens[-1]), self.budget, self.eos, feed=feed)


# The slots of concurrent load's control: llama-server's own default (-np auto), so the control goes through
# as much of the load path as the largest usual level.
CONTROL_SLOTS = 4


class ConcurrentLoad(Batch):
    """Batch B on a server: the item's requests on slot 0 of a server with B slots (one unified cache, or with
    ``unified`` False one KV stream per slot), while B-1 other requests (the same companions as ``Batch``: the next
    items, or the item repeated) generate on the other slots, so every decode call the server makes carries
    their tokens beside the item's (``llamaserver.load``). The served cell is one served request: the item's
    build and its read in one load block, on one slot, with no restart and no restore between them (the built
    cells are read out by a slot save, which leaves them as they are). The read
    side (the reference cache, restored, then read) runs in a block of its own. The reference runs on the
    one-slot server, as E2 did.

    Batch 1 (the control) goes through the whole load path: a server of ``CONTROL_SLOTS`` slots whose companions
    start generating, then are cancelled and erased before the item's request arrives; it must reproduce the
    reference. Every row's setting records the load its build or read ran under: the companions, and the tokens
    each had decoded when the block began and ended.

    Nothing pins how far the companions have got when the item's request arrives, so every item's cells run
    ``load_runs`` times, each with freshly started companions (``runs``): a ledger records the spread, and the
    audit compares a run with it."""

    def __init__(self, *args, load_runs: int = 1, **options):
        super().__init__(*args, **options)
        self.load_runs = load_runs

    def runs(self):
        return tuple(range(self.load_runs))

    @contextmanager
    def loaded(self, item_id: str):
        control = self.size == 1
        slots = CONTROL_SLOTS if control else self.size
        others = self.following(item_id, slots - 1) if control else self.companions(item_id)
        prompts = [list(self.prefixes[name].context) for name in others]
        self.engine.reconfigure(load_slots=slots, kv_unified=self.unified)
        try:
            with self.engine.in_flight(prompts, cancelled=control) as load:
                yield load
        finally:
            self.engine.reconfigure(load_slots=0)

    def describe(self, load) -> str:
        slots = len(load.slots) + 1
        cache = "one unified cache" if self.unified else "one KV stream per slot"
        return f"{slots} slot{'s' if slots != 1 else ''}, {cache}; {load.describe()}"

    def build(self, prefix):
        companions = self.companions(prefix.item_id)
        served, served_positions = None, 0
        with self.loaded(prefix.item_id) as load:
            mark = self.engine.log_mark()
            cache, state = build_boundary(self.engine, list(prefix.tokens), "prefill", prefix.prompt_length)
            if not prefix.ended_by_eos:
                # The same request goes on from the slot as it stands: the build's cells, never saved and restored.
                before = self.engine.fed_positions
                served = generate_greedy(self.engine, cache, [prefix.tokens[-1]], self.budget, self.eos)
                served_positions = self.engine.fed_positions - before
            # How the server cut the item's prompt into decode calls beside the companions' tokens, from its log
            # (read after the served tokens: the log's own thread has written the prompt's calls by then).
            split = self.engine.prompt_split(mark, len(prefix.context))
        note = f"built and served in one block: {self.describe(load)}"
        if companions:
            note += f": {'the item repeated' if self.repeated else ', '.join(companions)}"
        note += f"; {split}"
        return Built(state, note, companions=companions, served=served, served_positions=served_positions)

    def read(self, prefix, state, built):
        if prefix.ended_by_eos:
            return Decoded((), (), "eos")
        with self.loaded(prefix.item_id) as load:
            decoded = continue_from(self.engine, state, prefix.tokens[-1], self.budget, self.eos)
        return dataclasses.replace(decoded, note=f"read in a block of its own: {self.describe(load)}")


@runs("kv_unified")
class KvUnified(Setting):
    """``batch`` B with one KV stream per sequence: on a server, ``--no-kv-unified`` under concurrent load (every
    slot's cells from cell 0 of its own stream); on the binding, a batched decode in a context of one stream per
    sequence. ``off:1`` (the control) is that path with the item alone (on a server, with cancelled companions)."""

    @classmethod
    def for_level(cls, level, job):
        if job.engine.serves_concurrent_requests:
            return ConcurrentLoad(
                job.engine, job.budget, job.eos, level.value, job.prefixes, unified=False, load_runs=job.load_runs
            )
        return Batch(job.engine, job.budget, job.eos, level.value, job.prefixes, unified=False)


@runs("kv_offset")
class KvOffset(Setting):
    """The item's cells behind ``cells`` cells of another, idle sequence in one unified cache (the engine's
    ``behind_filler``), around each build and read; with ``removed`` (the control), the filler decoded and
    removed before the item arrives. The filler is the next items' tokens (a fixed function of the item list)."""

    def __init__(self, engine, budget, eos, cells: int, removed: bool, prefixes: dict[str, Prefix]):
        super().__init__(engine, budget, eos)
        self.cells, self.removed, self.prefixes = cells, removed, prefixes
        self.order = sorted(prefixes)

    @classmethod
    def for_level(cls, level, job):
        return cls(job.engine, job.budget, job.eos, level.value, level.of.removes_filler(level.name), job.prefixes)

    def filler(self, item_id: str) -> list[int]:
        """``cells`` tokens: the contexts of the items after ``item_id`` (by id, wrapping round), joined."""
        contexts = (token for name in items_after(self.order, item_id) for token in self.prefixes[name].context)
        return list(itertools.islice(contexts, self.cells))

    def placed(self, item_id: str):
        return self.engine.behind_filler(self.filler(item_id), removed=self.removed)

    def build(self, prefix):
        with self.placed(prefix.item_id):
            state = build_boundary_state(self.engine, list(prefix.tokens), "prefill", prefix.prompt_length)
            how = self.engine.build_description()
        if self.removed:
            where = f"a {self.cells}-cell filler sequence decoded and removed before the item: its cells from cell 0"
        else:
            where = f"the item's cells from cell {self.cells}, behind {self.cells} idle cells of another sequence"
        return Built(state, f"{where}; {how}")

    def read(self, prefix, state, built):
        if prefix.ended_by_eos:
            return Decoded((), (), "eos")
        with self.placed(prefix.item_id):
            return continue_from(self.engine, state, prefix.tokens[-1], self.budget, self.eos)


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


def level_setting(level: Level, job: LevelJob) -> Setting:
    """The setting that runs a factor's test level (``SETTINGS``: each factor's own class)."""
    if level.factor not in SETTINGS:
        raise FactorError(f"factors.{level.factor}: no setting of this factor runs in one process — see design.factors")
    return SETTINGS[level.factor].for_level(level, job)
