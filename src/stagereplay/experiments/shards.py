"""One job = one shard of items: load the model once, build boundary states, continue, record.

A shard writes its artifacts into the object store and one Parquet table of
trajectory rows; the ledger rule gathers the shard tables afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path

from stagereplay.design.storage import model_jobs_store
from stagereplay.engines.base import Engine
from stagereplay.experiments.constructions import StageBoundary, build_boundary_state, build_live, parse_construction
from stagereplay.experiments.decode import Decoded, ReadoutCue, continue_from, read_out_state
from stagereplay.experiments.job import JobContext, environment_columns, progress_bar
from stagereplay.inputs import items as items_mod
from stagereplay.inputs.scoring import score
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState, to_host
from stagereplay.ledger.store import store_cache
from stagereplay.ledger.tables import (
    PROMPT_SCHEMA,
    TRAJECTORY_SCHEMA,
    LedgerError,
    read_table,
    write_table,
)
from stagereplay.ledger.text import generated_text


def shard_slice(rows: list, shard: int, shard_size: int) -> list:
    chosen = rows[shard * shard_size : (shard + 1) * shard_size]
    if not chosen:
        raise LedgerError(
            f"shard {shard} of size {shard_size} is empty — the item list and the shard count disagree; rerun snakemake"
        )
    return chosen


class ShardRecorder:
    """Stores a trajectory's artifacts and builds its ledger row."""

    def __init__(
        self, context: JobContext, engine: Engine, construction: str, prefix_precision: str, store_caches: bool
    ):
        self.prefix_precision = prefix_precision
        # False at store_caches selected or none: the row keeps the cache's fingerprints, not its tensors.
        self.store_caches = store_caches
        self.engine = engine
        self.record = context.record
        self.spec = context.shard_spec
        self.store = context.store()
        self.construction = construction
        self.rows: list[dict] = []

    def text(self, tokens, stopped: bool) -> str:
        return generated_text(self.engine.tokenizer, tokens, stopped)

    def add(
        self,
        item: items_mod.Item,
        prompt_length: int,
        prefix: tuple[int, ...],
        boundary_reason: str,
        marker_match: str | None,
        state: KVState,
        suffix: Decoded,
        seconds: float,
    ) -> None:
        # One device-to-host copy, shared by the fingerprints and the stored object (a no-op on CPU).
        state = to_host(state)
        fingerprint = fingerprint_cache(state)
        if self.store_caches:
            store_cache(self.store, state, fingerprint.digest, self.record["fingerprint"], self.spec.precision)
        reasoning_text = self.text(prefix[prompt_length:], boundary_reason == "eos")
        suffix_text = self.text(suffix.tokens, suffix.stop == "eos")
        answer, correct = score(item, reasoning_text + suffix_text)
        readout = suffix.readout
        self.rows.append(
            {
                "checkpoint": self.spec.checkpoint,
                "precision": self.spec.precision,
                "construction": self.construction,
                "replica": self.spec.replica,
                "prefix_precision": self.prefix_precision,
                "item_id": item.item_id,
                "model_fingerprint": self.record["fingerprint"],
                "prompt_length": prompt_length,
                "prefix_length": len(prefix),
                "boundary_reason": boundary_reason,
                "marker_match": marker_match,
                "reasoning_text": reasoning_text,
                "prefix_object": self.store.put_tokens(prefix),
                "cache_object": fingerprint.digest,
                "cache_positions": state.num_positions,
                "layer_k": list(fingerprint.keys),
                "layer_v": list(fingerprint.values),
                "suffix_object": self.store.put_tokens(suffix.tokens),
                "suffix_tokens": list(suffix.tokens),
                "suffix_margins": list(suffix.margins),
                "suffix_stop": suffix.stop,
                "suffix_text": suffix_text,
                "answer": answer,
                "parsed": answer is not None,
                "correct": correct,
                "readout_answer": readout.answer,
                "readout_correct": readout.answer == item.answer,
                "readout_margin": readout.margin,
                **environment_columns(self.engine.environment),
                "model_seconds": seconds,
            }
        )


def _continue(
    engine: Engine, state: KVState, prefix, boundary_reason: str, budget: int, eos, on_token, cue: ReadoutCue
) -> Decoded:
    """The suffix and its forced-choice readout."""
    if boundary_reason == "eos":  # the stage ended the answer itself: nothing to continue, the readout still reads
        return Decoded((), (), "eos", readout=read_out_state(engine, state, prefix[-1], cue))
    return continue_from(engine, state, prefix[-1], budget, eos, on_token=on_token, readout=cue)


def run_live_shard(context: JobContext, boundary: StageBoundary) -> Path:
    """Generate each item of the shard to the stage ``boundary``, keep the live cache, continue."""
    store_caches = model_jobs_store(context.cache_policy())
    spec = context.shard_spec
    item_list = shard_slice(items_mod.load_items(context.items_path), spec.shard, spec.shard_size)
    prompts = prompt_rows_by_item(context.prompts_path)
    engine = context.load_engine()
    recorder = ShardRecorder(context, engine, "live", spec.precision, store_caches)
    eos = engine.eos_ids
    bar, on_token = progress_bar(len(item_list), f"live {spec.precision} rep{spec.replica} shard {spec.shard}")
    for item in item_list:
        prompt = prompts[item.item_id]["prompt_tokens"]
        started = time.perf_counter()
        live = build_live(engine, prompt, boundary, eos, engine.tokenizer, on_token=on_token)
        suffix = _continue(
            engine,
            live.state,
            live.prefix,
            live.reasoning.stop,
            context.suffix_tokens,
            eos,
            on_token,
            readout_cue(prompts[item.item_id]),
        )
        recorder.add(
            item,
            len(prompt),
            live.prefix,
            live.reasoning.stop,
            live.marker_match,
            live.state,
            suffix,
            time.perf_counter() - started,
        )
        bar.update()
    bar.close()
    return write_table(recorder.rows, TRAJECTORY_SCHEMA, context.out_path)


def run_construction_shard(context: JobContext, source_shard: str | Path, construction: str) -> Path:
    """Rebuild each boundary state of the live shard ``source_shard`` from its saved integer prefix, then continue.

    Prefixes are read from the context's source store (default: the store written to), so the
    audit can rebuild from the saved ledger into a separate store.
    """
    store_caches = model_jobs_store(context.cache_policy())
    parse_construction(construction)
    record = context.record
    spec = context.shard_spec
    items = {item.item_id: item for item in items_mod.load_items(context.items_path)}
    prompts = prompt_rows_by_item(context.prompts_path)
    source = read_table(source_shard, TRAJECTORY_SCHEMA).to_pylist()
    if any(row["construction"] != "live" for row in source):
        raise LedgerError(f"{source_shard} is not a live shard — rebuild constructions only from saved live prefixes")
    source_store = context.source_store()
    engine = context.load_engine()
    prefix_precision = source[0]["precision"] if source else spec.precision
    recorder = ShardRecorder(context, engine, construction, prefix_precision, store_caches)
    eos = engine.eos_ids
    bar, on_token = progress_bar(len(source), f"{construction} {spec.precision} rep{spec.replica} shard {spec.shard}")
    for row in source:
        if row["model_fingerprint"] != record["fingerprint"]:
            raise LedgerError(
                f"item {row['item_id']}: saved prefix came from model {row['model_fingerprint']}, not {record['fingerprint']} — rerun the live stage for this checkpoint"
            )
        prefix = tuple(source_store.get_tokens(row["prefix_object"]))
        started = time.perf_counter()
        state = build_boundary_state(engine, list(prefix), construction, row["prompt_length"])
        suffix = _continue(
            engine,
            state,
            prefix,
            row["boundary_reason"],
            context.suffix_tokens,
            eos,
            on_token,
            readout_cue(prompts[row["item_id"]]),
        )
        # The stage ended where the live run ended it: boundary and marker match are the source row's.
        recorder.add(
            items[row["item_id"]],
            row["prompt_length"],
            prefix,
            row["boundary_reason"],
            row["marker_match"],
            state,
            suffix,
            time.perf_counter() - started,
        )
        bar.update()
    bar.close()
    return write_table(recorder.rows, TRAJECTORY_SCHEMA, context.out_path)


def prompt_rows_by_item(prompts_path: str | Path) -> dict[str, dict]:
    """The prompts table's rows (prompt tokens, readout cue and letters) by item id."""
    return {row["item_id"]: row for row in read_table(prompts_path, PROMPT_SCHEMA).to_pylist()}


def readout_cue(prompt_row: dict) -> ReadoutCue:
    letters = items_mod.LETTERS[: len(prompt_row["readout_letter_tokens"])]
    return ReadoutCue(tuple(prompt_row["readout_cue_tokens"]), letters, tuple(prompt_row["readout_letter_tokens"]))
