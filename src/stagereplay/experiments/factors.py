"""One E6 job: one factor level over one shard of items — build under each level, continue under each.

The cells and verdicts are defined in ``design.factors``. Every item starts from its E2 prefill row at
the factor precision (the reference, ``(r, r)``): its prefix tokens, its cache (read from the store, or
rebuilt and checked against its fingerprints) and its suffix. A level is a ``Setting``: how it builds
the boundary state over ``prefix[:-1]`` and how it continues from one. The reference setting is the
one E2 ran: a one-shot prefill, then greedy decoding at batch 1.

Test-built caches are fingerprinted and compared with the reference layer by layer; their tensors are
not stored (any of them is rebuilt from the saved tokens and the level).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from stagereplay.design.factors import (
    BUILD_ONLY,
    READ,
    SERVER,
    WRITE,
    FactorError,
    Level,
    cell_label,
    cells_of,
    reference_level,
)
from stagereplay.engines.base import Engine, ModelError, Runtime
from stagereplay.engines.registry import load_checkpoint
from stagereplay.experiments.compare import first_divergence
from stagereplay.experiments.constructions import build_boundary_state
from stagereplay.experiments.decode import Decoded, continue_from, greedy_choice
from stagereplay.experiments.difference import cache_difference
from stagereplay.experiments.job import ShardSpec, environment_columns, progress_bar
from stagereplay.experiments.recompute import CacheSource, ModelPool
from stagereplay.inputs.checkpoints import read_model_record
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState, to_host
from stagereplay.ledger.store import ObjectStore, store_cache
from stagereplay.ledger.tables import FACTOR_SCHEMA, TRAJECTORY_SCHEMA, LedgerError, read_table, write_table


@dataclass(frozen=True)
class Prefix:
    """One item's E1 prefix, as its reference row saved it."""

    item_id: str
    tokens: tuple[int, ...]  # the last one is pending
    prompt_length: int
    ended_by_eos: bool  # the stage ended the answer: nothing is continued, caches are still compared

    @property
    def context(self) -> list[int]:
        return list(self.tokens[:-1])


@dataclass(frozen=True)
class Built:
    state: KVState
    note: str  # what this build did, in words (reused tokens, chunks, companions)
    reused_tokens: int | None = None
    reused_digest: str | None = None
    companions: tuple[str, ...] = ()


class Setting:
    """The reference level: a one-shot prefill, then batch-1 greedy decoding with the run's settings."""

    def __init__(self, engine: Engine, budget: int, eos: frozenset[int]):
        self.engine, self.budget, self.eos = engine, budget, eos

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


class Chunk(Setting):
    def __init__(self, engine, budget, eos, chunk: int):
        super().__init__(engine, budget, eos)
        self.chunk = chunk

    def build(self, prefix):
        context = len(prefix.tokens) - 1
        chunks = -(-context // self.chunk)
        state = build_boundary_state(self.engine, list(prefix.tokens), f"chunked:{self.chunk}", prefix.prompt_length)
        return Built(state, f"{chunks} chunks of at most {self.chunk} over {context} positions")


class PrefixReuse(Setting):
    """A prefix-cache hit: the first k positions come from an earlier request's cache, saved to an object
    store and loaded back (the same safetensors round trip as the ledger's); the rest is prefilled on top
    in one forward. The reference (a miss) prefills everything in one forward."""

    def __init__(self, engine, budget, eos, level: Level, scratch: ObjectStore, model_fingerprint: str, precision):
        super().__init__(engine, budget, eos)
        self.level, self.scratch = level, scratch
        self.model_fingerprint, self.precision = model_fingerprint, precision

    def reused(self, prefix: Prefix) -> int:
        context = len(prefix.tokens) - 1
        if self.level.name == "prompt":
            return min(prefix.prompt_length, context)
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


class Batch(Setting):
    """The item in row 0 of a batch of B, with the next B-1 items (by id, wrapping round) as companions:
    left-padded, with an attention mask and per-row positions. Built in one batched prefill; read by
    decoding the batch step by step (each row its own greedy token) until the item's row ends."""

    def __init__(self, engine, budget, eos, size: int, prefixes: dict[str, Prefix]):
        super().__init__(engine, budget, eos)
        self.size, self.prefixes = size, prefixes
        self.order = sorted(prefixes)
        self.companion_states: dict[str, list[KVState]] = {}

    def companions(self, item_id: str) -> tuple[str, ...]:
        start = self.order.index(item_id)
        return tuple(self.order[(start + offset) % len(self.order)] for offset in range(1, self.size))

    def build(self, prefix):
        companions = self.companions(prefix.item_id)
        rows = [prefix.context] + [self.prefixes[name].context for name in companions]
        batch, _ = self.engine.batch_forward(None, rows)
        states = [self.engine.batch_row(batch, row) for row in range(len(rows))]
        self.companion_states[prefix.item_id] = states[1:]
        note = f"batch of {self.size}" + (f" with {', '.join(companions)}" if companions else "")
        return Built(states[0], note, companions=companions)

    def read(self, prefix, state, built):
        if prefix.ended_by_eos:
            return Decoded((), (), "eos")
        companions = self.companions(prefix.item_id)
        batch = self.engine.batch_of([state, *self.companion_states[prefix.item_id]])
        pending = [prefix.tokens[-1]] + [self.prefixes[name].tokens[-1] for name in companions]
        tokens: list[int] = []
        margins: list[float] = []
        while True:
            batch, logits = self.engine.batch_forward(batch, [[token] for token in pending])
            choices = [greedy_choice(row) for row in logits]
            token, margin = choices[0]
            tokens.append(token)
            margins.append(margin)
            if token in self.eos:
                return Decoded(tuple(tokens), tuple(margins), "eos")
            if len(tokens) >= self.budget:
                return Decoded(tuple(tokens), tuple(margins), "budget")
            # A finished companion keeps decoding: the batch keeps its shape while the item's row runs.
            pending = [choice for choice, _ in choices]


class Kernels(Setting):
    """torch's CPU kernel level is fixed when torch starts (ATEN_CPU_CAPABILITY), so the test level runs in a
    worker process of its own (``run_kernel_worker``): it builds each item's cache and continues both that
    cache and the reference one. The caches cross between the processes through a scratch object store,
    fingerprint-checked on reading; (t, r) is then continued here, at the reference level."""

    def __init__(self, engine, budget, eos, level: Level, scratch: ObjectStore, model_record, runtime: Runtime):
        super().__init__(engine, budget, eos)
        self.level, self.scratch, self.model_record, self.runtime = level, scratch, model_record, runtime
        self.results: dict[str, dict] = {}
        self.worker_fed = 0  # positions the worker fed for the builds and reads consumed so far

    def fed_positions(self) -> int:
        return self.engine.fed_positions + self.worker_fed

    def run_worker(self, prefixes: list[Prefix], reference_states: dict[str, KVState], record: dict) -> None:
        for prefix in prefixes:
            state = to_host(reference_states[prefix.item_id])
            store_cache(
                self.scratch, state, fingerprint_cache(state).digest, record["fingerprint"], self.runtime.precision
            )
        request = {
            "model_record": str(self.model_record),
            "runtime": dataclasses.asdict(self.runtime),
            "budget": self.budget,
            "items": [
                {
                    **dataclasses.asdict(prefix),
                    "reference": fingerprint_cache(to_host(reference_states[prefix.item_id])).digest,
                }
                for prefix in prefixes
            ],
        }
        folder = Path(self.scratch.root)
        (folder / "request.json").write_text(json.dumps(request))
        environment = {**os.environ, "ATEN_CPU_CAPABILITY": self.level.name}
        done = subprocess.run(
            [sys.executable, "-m", "stagereplay", "kernel-worker", str(folder)],
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelError(f"the kernels={self.level.name} worker failed: {last}")
        answer = json.loads((folder / "answer.json").read_text())
        if answer["cpu_capability"].lower() != self.level.name:
            raise FactorError(
                f"factors.kernels: ATEN_CPU_CAPABILITY={self.level.name} gave torch's {answer['cpu_capability']}"
                " kernels — this torch build cannot run that level; remove it"
            )
        self.results = answer["items"]

    def build(self, prefix):
        result = self.results[prefix.item_id]
        self.worker_fed += result["built_positions"]
        state = KVState.from_named_tensors(self.scratch.get(result["built"]))
        return Built(state, f"built with torch's {self.level.name} CPU kernels (ATEN_CPU_CAPABILITY)")

    def read(self, prefix, state, built):
        if prefix.ended_by_eos:
            return Decoded((), (), "eos")
        continued = self.results[prefix.item_id]["continued"][fingerprint_cache(to_host(state)).digest]
        self.worker_fed += continued["positions"]
        return Decoded(tuple(continued["tokens"]), tuple(continued["margins"]), continued["stop"])


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
                "stop": decoded.stop,
                "positions": engine.fed_positions - start,
            }
        items[prefix.item_id] = {"built": digest, "built_positions": built_positions, "continued": continued}
    answer = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "items": items}
    (folder / "answer.json").write_text(json.dumps(answer))


def test_setting(level: Level, engine: Engine, runtime: Runtime, budget, eos, prefixes, scratch, record) -> Setting:
    factor = level.factor
    if factor == "threads":
        return Switched(engine, budget, eos, engine.use_threads, level.value, runtime.threads)
    if factor == "attention":
        return Switched(engine, budget, eos, engine.use_attention, level.value, runtime.attn_implementation)
    if factor == "chunk":
        return Chunk(engine, budget, eos, level.value)
    if factor == "prefix_reuse":
        return PrefixReuse(engine, budget, eos, level, scratch, record["fingerprint"], runtime.precision)
    if factor == "batch":
        return Batch(engine, budget, eos, level.value, prefixes)
    if factor == "kernels":
        return Kernels(engine, budget, eos, level, scratch, record["path"], runtime)
    raise FactorError(f"factors.{factor}: no setting of this factor runs in one process — see design.factors")


def not_applicable(level: Level, engine: Engine) -> str | None:
    """Why the level cannot run here (recorded on every row of the job), or None."""
    if level.factor == "attention" and level.name == "flash_attention_2":
        try:
            engine.use_attention(level.name)
        except ModelError as error:
            return str(error)
        engine.use_attention(engine.environment.attn_implementation)
    return None


def run_factor_shard(
    model_record: str | Path,
    level: Level,
    reference_shards: list[str | Path],
    spec: ShardSpec,
    runtime: Runtime,
    suffix_tokens: int,
    store_root: str | Path,
    out_path: str | Path,
    source_store_root: str | Path | None = None,
) -> Path:
    """The cells of one factor level for the items of one shard (``reference_shards[spec.shard]``'s).

    ``reference_shards`` are every shard of the E2 prefill rows at the factor precision: a batch's
    companions may come from any of them.
    """
    record = read_model_record(model_record)
    store = ObjectStore(store_root)
    source_store = ObjectStore(source_store_root or store_root)
    references = {}
    for path in reference_shards:
        for row in read_table(path, TRAJECTORY_SCHEMA).to_pylist():
            if row["construction"] != "prefill" or row["replica"] != 0:
                raise LedgerError(
                    f"{path} is not a shard of prefill rows (replica 0) — E6 starts from E2's prefill rows"
                )
            references[row["item_id"]] = row
    own = read_table(reference_shards[spec.shard], TRAJECTORY_SCHEMA).to_pylist()
    engine = load_checkpoint(record, runtime)
    models = ModelPool({spec.checkpoint: model_record}, runtime, {(spec.checkpoint, spec.precision): engine})
    caches = CacheSource([source_store] + ([store] if store.root != source_store.root else []), models)
    prefixes = {
        item_id: Prefix(
            item_id,
            tuple(source_store.get_tokens(row["prefix_object"])),
            row["prompt_length"],
            row["boundary_reason"] == "eos",
        )
        for item_id, row in references.items()
    }
    eos = engine.eos_ids
    reason = not_applicable(level, engine)
    rows = []
    bar, _ = progress_bar(len(own), f"factor {level.factor}={level.name} {spec.precision} shard {spec.shard}")
    with tempfile.TemporaryDirectory(prefix="stagereplay-prefix-reuse-") as scratch:
        reference = Setting(engine, suffix_tokens, eos)
        test = test_setting(
            level, engine, runtime, suffix_tokens, eos, prefixes, ObjectStore(scratch), {**record, "path": model_record}
        )
        if isinstance(test, Kernels) and reason is None:
            mine = [prefixes[row["item_id"]] for row in own]
            test.run_worker(mine, {row["item_id"]: caches.state(row) for row in own}, record)
        for row in own:
            if row["model_fingerprint"] != record["fingerprint"]:
                raise LedgerError(
                    f"item {row['item_id']}: its prefill row came from model {row['model_fingerprint']}, not"
                    f" {record['fingerprint']} — rerun the E2 jobs of this checkpoint"
                )
            base = _base_row(level, spec, row, record, engine, runtime)
            if reason is not None:
                rows += [
                    {**base, **_cell(cell), "applicable": False, "reason": reason} for cell in cells_of(level.factor)
                ]
                bar.update()
                continue
            before = engine.fed_positions
            reference_state = caches.state(row)
            reference_fed = engine.fed_positions - before
            cells = item_cells(
                level, prefixes[row["item_id"]], row, reference_state, reference, test, base, reference_fed
            )
            rows += [{**cell, "suffix_object": store.put_tokens(cell["suffix_tokens"])} for cell in cells]
            bar.update()
    bar.close()
    return write_table(rows, FACTOR_SCHEMA, out_path)


def item_cells(
    level: Level,
    prefix: Prefix,
    reference_row: dict,
    reference_state: KVState,
    reference: Setting,
    test: Setting,
    base: dict,
    reference_fed: int = 0,
) -> list[dict]:
    """The rows of one item's cells: (t, r), and unless the factor is build-only, (r, t) and (t, t).
    ``reference_fed``: positions fed to rebuild the reference cache (0 when it was stored)."""
    reference_suffix = list(reference_row["suffix_tokens"])
    start = test.fed_positions()
    built = test.build(prefix)
    test_state = to_host(built.state)
    test_fingerprint = fingerprint_cache(test_state)
    keys, values = cache_difference(reference_state, test_state)
    layer_max_abs = [max(k.max_abs, v.max_abs) for k, v in zip(keys, values)]
    differing = [
        layer
        for layer, (a, b, c, d) in enumerate(
            zip(test_fingerprint.keys, reference_row["layer_k"], test_fingerprint.values, reference_row["layer_v"])
        )
        if a != b or c != d
    ]
    same_bytes = test_fingerprint.digest == reference_row["cache_object"]
    fed: dict[tuple, int] = {}

    def counted(cell: tuple, compute):
        """Run one cell's computation; what it fed (since ``start`` for the first) is that cell's cost."""
        nonlocal start
        result = compute()
        fed[cell] = test.fed_positions() - start
        start = test.fed_positions()
        return result

    cells = {WRITE: (test_state, test_fingerprint, counted(WRITE, lambda: reference.read(prefix, test_state, None)))}
    if level.factor not in BUILD_ONLY:
        cells[READ] = (reference_state, None, counted(READ, lambda: test.read(prefix, reference_state, built)))
        cells[SERVER] = (test_state, test_fingerprint, counted(SERVER, lambda: test.read(prefix, test_state, built)))
    write_suffix = list(cells[WRITE][2].tokens)
    if same_bytes and write_suffix != reference_suffix:
        # The same bytes continued by the same reader: only a run that does not reproduce itself differs.
        raise LedgerError(
            f"item {prefix.item_id}: the reference cache rebuilt under {level.factor}={level.name} continued"
            " differently from its E2 row — this environment does not reproduce the ledger; run where it was written"
        )
    rows = []
    for cell, (_, fingerprint, decoded) in cells.items():
        tokens = list(decoded.tokens)
        is_test_cache = fingerprint is not None
        rows.append(
            {
                **base,
                **_cell(cell),
                "applicable": True,
                "reason": None,
                "setting": built.note if is_test_cache else "the reference cache",
                "reused_tokens": built.reused_tokens,
                "reused_digest": built.reused_digest,
                "companions": list(built.companions),
                "cache_digest": (fingerprint.digest if is_test_cache else reference_row["cache_object"]),
                "layer_k": list(fingerprint.keys if is_test_cache else reference_row["layer_k"]),
                "layer_v": list(fingerprint.values if is_test_cache else reference_row["layer_v"]),
                "cache_differs": not same_bytes if is_test_cache else False,
                "first_differing_layer": (differing[0] if differing else None) if is_test_cache else None,
                "layer_max_abs": layer_max_abs if is_test_cache else [0.0] * len(layer_max_abs),
                "suffix_tokens": tokens,
                "suffix_stop": decoded.stop,
                "first_divergence": first_divergence(tokens, reference_suffix),
                "forward_positions": fed[cell] + (reference_fed if cell == WRITE else 0),
            }
        )
    return rows


def _cell(cell: tuple[str, str]) -> dict:
    return {"build": cell[0], "read": cell[1], "cell": cell_label(cell)}


def _base_row(level: Level, spec: ShardSpec, row: dict, record: dict, engine: Engine, runtime: Runtime) -> dict:
    return {
        "checkpoint": spec.checkpoint,
        "precision": spec.precision,
        "factor": level.factor,
        "level": level.name,
        "reference_level": reference_level(
            level.factor, dataclasses.asdict(runtime), engine.environment.cpu_capability
        ),
        "item_id": row["item_id"],
        "reference_cache": row["cache_object"],
        "reference_suffix": row["suffix_object"],
        "suffix_object": None,
        "prefix_object": row["prefix_object"],
        "model_fingerprint": record["fingerprint"],
        "setting": None,
        "reused_tokens": None,
        "reused_digest": None,
        "companions": [],
        "cache_digest": None,
        "layer_k": [],
        "layer_v": [],
        "cache_differs": None,
        "first_differing_layer": None,
        "layer_max_abs": [],
        "suffix_tokens": [],
        "suffix_stop": None,
        "first_divergence": None,
        "forward_positions": None,
        **environment_columns(engine.environment),
    }
