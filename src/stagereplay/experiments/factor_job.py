"""One E6 job: one factor level over one shard of items — build under the level or the reference,
continue under each, record a row per cell.

Every item starts from its E2 prefill row at the factor precision (the reference, ``(r, r)``): its prefix
tokens, its cache (read from the store, or rebuilt and checked against its fingerprints) and its suffix.
How each level builds and reads is in ``factors``; the cells and verdicts in ``design.factors``.
Test-built caches are fingerprinted and compared with the reference layer by layer; their tensors are
not stored (any of them is rebuilt from the saved tokens and the level). Each cell's first logits and its
margins at divergence are compared with the reference's, read again for them (``cell_logits``).
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stagereplay.design.cells import READ, SERVER, WRITE, cell_label
from stagereplay.design.divergence import first_divergence
from stagereplay.design.factors import Level, reference_level
from stagereplay.engines.base import Engine

# Every factor's setting, registered by its module (setting.runs): switches, contexts, chunks, prefix reuse and
# kernels; batches, load and placement.
from stagereplay.experiments import batch_settings  # noqa: F401
from stagereplay.experiments.cell_logits import NOT_DECODED, NOT_DIVERGED, first_read, margins_at_divergence
from stagereplay.experiments.decode import Decoded
from stagereplay.experiments.difference import cache_difference
from stagereplay.experiments.factor_settings import Kernels
from stagereplay.experiments.job import JobContext, environment_columns, progress_bar
from stagereplay.experiments.level_job import LevelJob, Prefix
from stagereplay.experiments.recompute import CacheSource, ModelPool
from stagereplay.experiments.setting import Setting, level_setting
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState, to_host
from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import FACTOR_SCHEMA, TRAJECTORY_SCHEMA, LedgerError, read_table, write_table


@dataclass(frozen=True)
class LevelSettings:
    """What a factor job compares, the same for every item: the level and the settings that run it and its
    reference."""

    level: Level
    reference: Setting
    test: Setting


@dataclass(frozen=True)
class ReferenceItem:
    """One item's reference ``(r, r)`` as the job holds it: its prefix, its E2 prefill row and that row's cache."""

    prefix: Prefix
    row: dict
    state: KVState
    fed_positions: int = 0  # positions fed to rebuild the cache (0 when it was stored)


def run_factor_shard(context: JobContext, level: Level, reference_shards: list[str | Path], load_runs: int = 1) -> Path:
    """The cells of one factor level for the items of the context's shard (``reference_shards[shard]``'s).

    ``reference_shards`` are every shard of the E2 prefill rows at the factor precision: a batch's
    companions may come from any of them. A level whose input is not pinned (concurrent load on a server)
    runs each item's cells ``load_runs`` times, each with freshly started companions. Test-built caches are
    never stored, so the job has no store_caches policy to read.
    """
    record, spec, runtime, suffix_tokens = context.record, context.shard_spec, context.runtime, context.suffix_tokens
    store = context.store()
    source_store = context.source_store()
    references = {}
    for path in reference_shards:
        for row in read_table(path, TRAJECTORY_SCHEMA).to_pylist():
            if row["construction"] != "prefill" or row["replica"] != 0:
                raise LedgerError(
                    f"{path} is not a shard of prefill rows (replica 0) — E6 starts from E2's prefill rows"
                )
            references[row["item_id"]] = row
    own = read_table(reference_shards[spec.shard], TRAJECTORY_SCHEMA).to_pylist()
    engine = context.load_engine()
    models = ModelPool({spec.checkpoint: context.record_path}, runtime, {(spec.checkpoint, spec.precision): engine})
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
    rows = []
    bar, _ = progress_bar(len(own), f"factor {level.factor}={level.name} {spec.precision} shard {spec.shard}")
    with tempfile.TemporaryDirectory(prefix="stagereplay-prefix-reuse-") as scratch:
        reference = Setting(engine, suffix_tokens, eos)
        job = LevelJob(
            engine,
            runtime,
            suffix_tokens,
            eos,
            prefixes,
            ObjectStore(scratch),
            {**record, "path": context.record_path},
            load_runs,
        )
        test = level_setting(level, job)
        settings = LevelSettings(level, reference, test)
        reason = test.unavailable()
        # The kernels worker needs every reference cache first; they are read (or rebuilt) once, here.
        early: dict[str, tuple[KVState, int]] = {}
        if isinstance(test, Kernels) and reason is None:
            for row in own:
                before = engine.fed_positions
                early[row["item_id"]] = (caches.state(row), engine.fed_positions - before)
            mine = [prefixes[row["item_id"]] for row in own]
            test.run_worker(mine, {item_id: state for item_id, (state, _) in early.items()}, record)
        for row in own:
            if row["model_fingerprint"] != record["fingerprint"]:
                raise LedgerError(
                    f"item {row['item_id']}: its prefill row came from model {row['model_fingerprint']}, not"
                    f" {record['fingerprint']} — rerun the E2 jobs of this checkpoint"
                )
            base = _base_row(level, context, row, engine)
            if reason is not None:
                rows += [
                    {**base, **_cell(cell), "applicable": False, "reason": reason} for cell in level.factor_type.cells
                ]
                bar.update()
                continue
            if row["item_id"] in early:
                reference_state, reference_fed = early.pop(row["item_id"])
            else:
                before = engine.fed_positions
                reference_state = caches.state(row)
                reference_fed = engine.fed_positions - before
            item = ReferenceItem(prefixes[row["item_id"]], row, reference_state, reference_fed)
            for run in test.runs():
                cells = item_cells(settings, item, {**base, "run": run})
                rows += [{**cell, "suffix_object": store.put_tokens(cell["suffix_tokens"])} for cell in cells]
                # A cache rebuilt because it was not stored is fed once, and counted with the first run.
                item = dataclasses.replace(item, fed_positions=0)
            rows += [
                {**base, **_cell(cell), "applicable": False, "reason": why}
                for cell, why in level.factor_type.unbuilt_cells().items()
            ]
            bar.update()
    bar.close()
    return write_table(rows, FACTOR_SCHEMA, context.out_path)


def item_cells(settings: LevelSettings, item: ReferenceItem, base: dict) -> list[dict]:
    """The rows of one item's cells (``design.factors.Factor.cells``): (t, r), (r, t) and (t, t); (t, r) alone for
    a build-only factor, (t, t) alone for a server-only one. ``base``: the columns every cell shares."""
    level, reference, test = settings.level, settings.reference, settings.test
    prefix, reference_row, reference_state = item.prefix, item.row, item.state
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

    wanted = level.factor_type.cells
    # What each cell's reader is given: the cache as built, or converted where the other setting stores
    # another cache type (then the row records the converted cache).
    inputs = {
        WRITE: (test_state, lambda: test.for_reference(test_state), lambda state: reference.read(prefix, state, None)),
        READ: (reference_state, lambda: test.for_test(reference_state), lambda state: test.read(prefix, state, built)),
        SERVER: (test_state, lambda: test_state, lambda state: test.read(prefix, state, built)),
    }
    cells, converted = {}, {}
    for cell in (WRITE, READ, SERVER):
        if cell not in wanted:
            continue
        state, convert, read = inputs[cell]
        fingerprint = test_fingerprint if state is test_state else None
        if cell == SERVER and built.served is not None:
            # The level served the item as one request (its build and read in one block): that read is the cell.
            cells[cell] = (state, fingerprint, built.served)
            fed[cell] = built.served_positions
            fed[wanted[0]] -= built.served_positions  # counted with the build until now
            continue
        given = convert()
        if given is not state:
            converted[cell] = fingerprint_cache(to_host(given))
        cells[cell] = (state, fingerprint, counted(cell, functools.partial(read, given)))
    if WRITE in cells and same_bytes and list(cells[WRITE][2].tokens) != reference_suffix:
        # The same bytes continued by the same reader: only a run that does not reproduce itself differs.
        raise LedgerError(
            f"item {prefix.item_id}: the reference cache rebuilt under {level.factor}={level.name} continued"
            " differently from its E2 row — this environment does not reproduce the ledger; run where it was written"
        )
    divergences = {
        cell: first_divergence(list(decoded.tokens), reference_suffix) for cell, (_, _, decoded) in cells.items()
    }
    replayed = replay_reference(reference, prefix, reference_state, list(divergences.values()), reference_suffix)
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
                "setting": "; ".join(
                    filter(None, (built.note if is_test_cache else "the reference cache", decoded.note))
                ),
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
                "first_divergence": divergences[cell],
                **margins_at_divergence(divergences[cell], decoded, reference_row["suffix_margins"], replayed),
                **first_read(decoded.first_logits, replayed.first_logits),
                **_conversion(converted.get(cell), test_fingerprint if cell == READ else None),
                "forward_positions": fed[cell] + (item.fed_positions if cell == wanted[0] else 0),
            }
        )
    return rows


def replay_reference(
    reference: Setting, prefix: Prefix, state: KVState, divergences: list[int | None], reference_suffix: list[int]
) -> Decoded:
    """The reference read again, up to the last step where a cell diverges (step 0, its first read, at least):
    E2's row keeps the reference's tokens and margins, not its logits. The reference cache read by the reference
    setting is E2's own computation, so its tokens must be E2's. Its positions are no cell's cost."""
    steps = 1 + max((step for step in divergences if step is not None), default=0)
    replayed = reference.with_budget(steps).read(prefix, state, None)
    if list(replayed.tokens) != reference_suffix[: len(replayed.tokens)]:
        raise LedgerError(
            f"item {prefix.item_id}: the reference cache read again under the reference setting continued"
            " differently from its E2 row — this environment does not reproduce the ledger; run where it was written"
        )
    return replayed


def _conversion(given, test_fingerprint) -> dict:
    """The converted cache a cell read, and on ref-test how the offline-quantized reference compares with
    the native test build."""
    if given is None:
        return {"converted_digest": None, "converted_equals_test": None, "converted_first_differing_layer": None}
    compared = test_fingerprint is not None
    differing = (
        [
            layer
            for layer, pair in enumerate(zip(given.keys, test_fingerprint.keys, given.values, test_fingerprint.values))
            if pair[0] != pair[1] or pair[2] != pair[3]
        ]
        if compared
        else []
    )
    return {
        "converted_digest": given.digest,
        "converted_equals_test": given.digest == test_fingerprint.digest if compared else None,
        "converted_first_differing_layer": (differing[0] if differing else None) if compared else None,
    }


def _cell(cell: tuple[str, str]) -> dict:
    return {"build": cell[0], "read": cell[1], "cell": cell_label(cell)}


def _base_row(level: Level, context: JobContext, row: dict, engine: Engine) -> dict:
    """The columns every cell of the item of ``row`` (its E2 prefill row) shares."""
    return {
        "checkpoint": context.shard_spec.checkpoint,
        "precision": context.shard_spec.precision,
        "factor": level.factor,
        "level": level.name,
        "reference_level": reference_level(
            level.factor, dataclasses.asdict(context.runtime), engine.environment.cpu_capability
        ),
        "item_id": row["item_id"],
        "run": None,
        "reference_cache": row["cache_object"],
        "reference_suffix": row["suffix_object"],
        "suffix_object": None,
        "prefix_object": row["prefix_object"],
        "model_fingerprint": context.record["fingerprint"],
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
        **NOT_DIVERGED,
        **NOT_DECODED,
        "converted_digest": None,
        "converted_equals_test": None,
        "converted_first_differing_layer": None,
        "forward_positions": None,
        **environment_columns(engine.environment),
    }
