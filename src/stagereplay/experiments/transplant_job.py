"""One E5 job: load the model once, transplant donor caches into recipient states, continue, record.

The job reads saved trajectories (their prefixes from the object store, their caches
from it too, or rebuilt from the saved tokens and checked where ``store_caches`` kept
none: recompute.py); the transplant maths is in transplants.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stagereplay.design.divergence import first_divergence
from stagereplay.design.jobs import trajectory_label
from stagereplay.design.names import check_plan
from stagereplay.design.storage import transplant_jobs_store
from stagereplay.experiments.decode import Decoded, continue_from
from stagereplay.experiments.job import JobContext, environment_columns, progress_bar
from stagereplay.experiments.recompute import CacheSource, ModelPool
from stagereplay.experiments.transplants import TransplantSpec, left_both, outcome, sweep_specs, transplant
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.tables import TRAJECTORY_SCHEMA, TRANSPLANT_SCHEMA, LedgerError, read_table, write_table


@dataclass(frozen=True)
class TransplantJob:
    """One E5 shard: which items, which pairs of saved trajectories, which subsets."""

    selection: str  # "selected", "outcome_blind" or "cross_precision"
    item_ids: frozenset[str]
    pairs: tuple[tuple[str, str], ...]  # (donor table, recipient table) shard paths, both directions listed
    plan: object  # plan.SweepPlan; only the all-layer transplant when None


def run_transplant_shard(context: JobContext, job: TransplantJob) -> Path:
    """Transplant donor caches into recipient states and continue in the recipient's precision.

    Caches and prefixes are read from the context's source store (default: the store written to).
    A cache that is not stored is rebuilt (on a model of its own precision, loaded when a
    donor's differs); at store_caches: selected it is then stored in the store written to.
    """
    store_rebuilt_caches = transplant_jobs_store(context.cache_policy())
    record, spec, suffix_tokens = context.record, context.shard_spec, context.suffix_tokens
    store = context.store()
    source_store = context.source_store()
    loaded = context.load_engine()
    if job.plan:
        check_plan(job.plan, loaded.num_layers)
    models = ModelPool(
        {spec.checkpoint: context.record_path}, context.runtime, {(spec.checkpoint, spec.precision): loaded}
    )
    keep = store if store_rebuilt_caches else None
    caches = CacheSource([source_store] + ([store] if store.root != source_store.root else []), models, keep)
    environment = environment_columns(loaded.environment)
    eos = loaded.eos_ids
    rows = []
    work = []
    for donor_path, recipient_path in job.pairs:
        donors = {row["item_id"]: row for row in read_table(donor_path, TRAJECTORY_SCHEMA).to_pylist()}
        recipients = {row["item_id"]: row for row in read_table(recipient_path, TRAJECTORY_SCHEMA).to_pylist()}
        for item_id in sorted(job.item_ids & donors.keys()):
            work.append((donors[item_id], recipients[item_id]))
    bar, on_token = progress_bar(len(work), f"transplant {job.selection} {spec.precision} shard {spec.shard}")
    for donor, recipient in work:
        for row in (donor, recipient):
            if row["model_fingerprint"] != record["fingerprint"]:
                raise LedgerError(
                    f"item {row['item_id']}: donor and recipient must come from checkpoint {record['fingerprint']} — transplant only within one checkpoint"
                )
        donor_state = caches.state(donor)
        recipient_state = caches.state(recipient)
        prefix = source_store.get_tokens(recipient["prefix_object"])
        if donor["prefix_object"] != recipient["prefix_object"]:
            raise LedgerError(
                f"item {donor['item_id']}: donor and recipient prefixes differ — transplant only over one prefix"
            )
        subsets = (
            sweep_specs(recipient_state.num_layers, job.plan)
            if job.plan
            else [TransplantSpec(tuple(range(recipient_state.num_layers)))]
        )
        donor_suffix, recipient_suffix = list(donor["suffix_tokens"]), list(recipient["suffix_tokens"])
        for subset in subsets:
            state = transplant(donor_state, recipient_state, subset)
            fingerprint = fingerprint_cache(state)
            if recipient["boundary_reason"] == "eos":
                suffix = Decoded((), (), "eos")
            elif job.selection == "cross_precision":
                # Decoded to the full budget: the cast live and cast prefill continuations are compared
                # with each other (does the divergence survive the cast?), not only with the two suffixes.
                suffix = continue_from(loaded, state, prefix[-1], suffix_tokens, eos, on_token=on_token)
            else:
                # Once the continuation has left both suffixes it can follow neither: stop there.
                suffix = continue_from(
                    loaded,
                    state,
                    prefix[-1],
                    suffix_tokens,
                    eos,
                    on_token=on_token,
                    stop_after=left_both(donor_suffix, recipient_suffix),
                    stop_reason="left_both",
                )
            tokens = list(suffix.tokens)
            rows.append(
                {
                    "selection": job.selection,
                    "checkpoint": spec.checkpoint,
                    "item_id": donor["item_id"],
                    "divergent": donor_suffix != recipient_suffix,
                    "donor": trajectory_label(donor),
                    "recipient": trajectory_label(recipient),
                    "precision": spec.precision,
                    "subset": subset.label(),
                    "layers": list(subset.layers),
                    "kv": subset.kv,
                    "last_positions": subset.last_positions,
                    "outcome": outcome(tokens, donor_suffix, recipient_suffix),
                    "first_divergence_vs_donor": first_divergence(tokens, donor_suffix),
                    "first_divergence_vs_recipient": first_divergence(tokens, recipient_suffix),
                    "cache_digest": fingerprint.digest,
                    "layer_k": list(fingerprint.keys),
                    "layer_v": list(fingerprint.values),
                    "suffix_object": store.put_tokens(tokens),
                    "suffix_tokens": tokens,
                    "suffix_stop": suffix.stop,
                    "model_fingerprint": record["fingerprint"],
                    **environment,
                }
            )
        bar.update()
    bar.close()
    return write_table(rows, TRANSPLANT_SCHEMA, context.out_path)
