"""E6's settings that put other sequences beside the item: a batch the engine composes (``Batch``), concurrent
load on a server (``ConcurrentLoad``, run ``load_runs`` times), one KV stream per sequence (``kv_unified``), and
the item's cells behind another sequence's (``kv_offset``). Registered by factor name with the others
(``setting.runs``)."""

from __future__ import annotations

import dataclasses
import itertools
from contextlib import contextmanager

import torch

from stagereplay.experiments.constructions import build_boundary, build_boundary_state
from stagereplay.experiments.decode import Decoded, continue_from, decode_greedy, generate_greedy, greedy_choice
from stagereplay.experiments.level_job import Built, Prefix
from stagereplay.experiments.setting import Setting, mechanism, runs
from stagereplay.inputs.items import items_after


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
        if mechanism(job, level.factor) == "load":
            return ConcurrentLoad(
                job.engine,
                job.budget,
                job.eos,
                level.value,
                job.prefixes,
                level.factor_type.repeats_item(level.name),
                load_runs=job.load_runs,
            )
        return Batch(
            job.engine, job.budget, job.eos, level.value, job.prefixes, level.factor_type.repeats_item(level.name)
        )

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
        if mechanism(job, level.factor) == "load":
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
        return cls(
            job.engine, job.budget, job.eos, level.value, level.factor_type.removes_filler(level.name), job.prefixes
        )

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
