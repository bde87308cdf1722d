"""The ledger's Parquet tables: their schemas, keys and row digests, read and written atomically.

No torch: the workflow's parse-time code, verify and the report read tables without it. The
objects these tables name live in the content-addressed store (``stagereplay.ledger.store``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from stagereplay.ledger.atomic import atomic_write
from stagereplay.ledger.environment import ENVIRONMENT_FIELDS

# Every table carries the digest of its rows in its Parquet metadata, so an edited cell is detectable.
ROWS_DIGEST_KEY = b"stagereplay.rows_xxh3"


class LedgerError(RuntimeError):
    """One-line message naming the problem and the fix."""


# What the numbers depend on besides the inputs (engines.base.Environment, less the precision,
# which is a key column): recorded in every trajectory and transplant row, compared by
# the audit, listed in summary.json and on the results card.

# One row per (item, checkpoint, precision, construction, replica, prefix precision):
# a boundary state and its continuation. ``prefix_precision`` names the live run
# whose saved integer prefix was rebuilt (for ``live`` rows: its own precision).
TRAJECTORY_SCHEMA = pa.schema(
    [
        ("checkpoint", pa.string()),
        ("precision", pa.string()),
        ("construction", pa.string()),
        ("replica", pa.int32()),
        ("prefix_precision", pa.string()),
        ("item_id", pa.string()),
        ("model_fingerprint", pa.string()),
        ("prompt_length", pa.int32()),
        ("prefix_length", pa.int32()),
        ("boundary_reason", pa.string()),
        ("marker_match", pa.string()),  # "token_ids" or "text" when the stage ended at the marker, else null
        ("reasoning_text", pa.string()),
        ("prefix_object", pa.string()),
        ("cache_object", pa.string()),
        ("cache_positions", pa.int32()),
        ("layer_k", pa.list_(pa.string())),
        ("layer_v", pa.list_(pa.string())),
        ("suffix_object", pa.string()),
        ("suffix_tokens", pa.list_(pa.int64())),
        ("suffix_margins", pa.list_(pa.float32())),
        ("suffix_stop", pa.string()),
        ("suffix_text", pa.string()),
        ("answer", pa.string()),
        ("parsed", pa.bool_()),
        ("correct", pa.bool_()),
        # Forced-choice readout: the cue fed after the continuation, the highest-logit choice letter,
        # and its logit lead over the runner-up letter. Every trajectory has one (never unparsable).
        ("readout_answer", pa.string()),
        ("readout_correct", pa.bool_()),
        ("readout_margin", pa.float32()),
        *ENVIRONMENT_FIELDS,
        ("model_seconds", pa.float64()),
    ]
)

_PER_LAYER = pa.list_(pa.float64())

# One row per compared pair of trajectories of one item (E1 live vs prefill and
# replicas, E2 incremental vs other constructions, E3 incremental vs live).
COMPARISON_SCHEMA = pa.schema(
    [
        ("experiment", pa.string()),
        ("relation", pa.string()),  # "construction" or "replica"
        ("checkpoint", pa.string()),
        ("precision", pa.string()),
        ("item_id", pa.string()),
        ("a", pa.string()),  # side labels, e.g. "live/bf16/rep0", "prefill/fp32/rep0<-bf16"
        ("b", pa.string()),
        ("boundary_reason", pa.string()),
        ("prefix_length", pa.int32()),
        ("prefix_equal", pa.bool_()),
        ("cache_exact", pa.bool_()),
        ("layers_differ", pa.int32()),
        ("first_differing_layer", pa.int32()),
        ("first_differing_kv", pa.string()),
        ("k_max_abs", _PER_LAYER),
        ("k_mean_abs", _PER_LAYER),
        ("k_fraction_differ", _PER_LAYER),
        ("v_max_abs", _PER_LAYER),
        ("v_mean_abs", _PER_LAYER),
        ("v_fraction_differ", _PER_LAYER),
        ("suffix_differs", pa.bool_()),
        ("first_divergence", pa.int32()),
        ("a_margin_at_divergence", pa.float32()),
        ("b_margin_at_divergence", pa.float32()),
        ("a_token_at_divergence", pa.int64()),
        ("b_token_at_divergence", pa.int64()),
        ("a_correct", pa.bool_()),
        ("b_correct", pa.bool_()),
        ("a_parsed", pa.bool_()),
        ("b_parsed", pa.bool_()),
        ("a_readout_correct", pa.bool_()),  # the forced-choice readout's label of each side
        ("b_readout_correct", pa.bool_()),
        ("label_differs", pa.bool_()),
        ("trajectory_exact", pa.bool_()),  # prefix, every cache layer and suffix fingerprints agree
    ]
)

# One row per transplant: a donor's cache (part of it) in a recipient's state, continued.
TRANSPLANT_SCHEMA = pa.schema(
    [
        ("selection", pa.string()),  # "selected", "outcome_blind" or "cross_precision"
        ("checkpoint", pa.string()),
        ("item_id", pa.string()),
        ("divergent", pa.bool_()),  # did the donor's and the recipient's own suffixes differ?
        ("donor", pa.string()),  # side labels as in the comparisons table
        ("recipient", pa.string()),
        ("precision", pa.string()),  # of the continuation (the recipient's)
        ("subset", pa.string()),  # e.g. "layers=0-29 kv=kv positions=all"
        ("layers", pa.list_(pa.int32())),
        ("kv", pa.string()),
        ("last_positions", pa.int32()),
        ("outcome", pa.string()),  # follows_donor, follows_recipient or neither
        ("first_divergence_vs_donor", pa.int32()),
        ("first_divergence_vs_recipient", pa.int32()),
        ("cache_digest", pa.string()),
        ("layer_k", pa.list_(pa.string())),
        ("layer_v", pa.list_(pa.string())),
        ("suffix_object", pa.string()),
        ("suffix_tokens", pa.list_(pa.int64())),
        ("suffix_stop", pa.string()),
        ("model_fingerprint", pa.string()),
        *ENVIRONMENT_FIELDS,
    ]
)

# E6 (factors): one row per (checkpoint, precision, factor, level, item, cell). A cell builds the boundary
# state under one level and continues under another (design.factors): build and read are "ref" or "test".
# The reference cell (ref, ref) is E2's prefill row, named here (reference_cache, reference_suffix), not
# copied. A level that cannot run here has applicable false and its reason, and no cache or suffix.
FACTOR_SCHEMA = pa.schema(
    [
        ("checkpoint", pa.string()),
        ("precision", pa.string()),
        ("factor", pa.string()),
        ("level", pa.string()),
        ("reference_level", pa.string()),  # the run's own setting of the factor (design.factors.reference_level)
        ("item_id", pa.string()),
        ("cell", pa.string()),  # "test-ref" (write side), "ref-test" (read side), "test-test" (as a server runs it)
        # Which run of the cell: null where the level's input is pinned (one run reproduces it); 0..R-1 where it
        # is not (concurrent load on a server: each run with freshly started companions, load_runs of them).
        ("run", pa.int32()),
        ("build", pa.string()),
        ("read", pa.string()),
        ("applicable", pa.bool_()),
        ("reason", pa.string()),
        ("setting", pa.string()),  # what the build did, in words: reused positions, chunks, batch companions
        ("reused_tokens", pa.int32()),  # prefix_reuse: positions taken from the earlier request's cache
        ("reused_digest", pa.string()),  # ... and that cache's fingerprint (after its round trip through a store)
        ("companions", pa.list_(pa.string())),  # batch: the other items in the batch, in row order
        ("reference_cache", pa.string()),
        ("reference_suffix", pa.string()),
        ("prefix_object", pa.string()),
        ("cache_digest", pa.string()),
        ("layer_k", pa.list_(pa.string())),
        ("layer_v", pa.list_(pa.string())),
        ("cache_differs", pa.bool_()),  # from the reference cache, bytes
        ("first_differing_layer", pa.int32()),
        ("layer_max_abs", pa.list_(pa.float64())),  # per layer, max |difference| over K and V
        ("suffix_object", pa.string()),
        ("suffix_tokens", pa.list_(pa.int64())),
        ("suffix_stop", pa.string()),
        ("first_divergence", pa.int32()),  # the first suffix step that differs from the reference's
        # At that step (null where the cell does not diverge): the top-1 minus top-2 logit of this cell and of
        # the reference (its E2 row's suffix_margins), and the reference's top-1 logit, whose binade sets one
        # bf16 step (E2's row does not keep it: the job reads the reference again that far).
        ("margin_at_divergence", pa.float32()),
        ("reference_margin_at_divergence", pa.float32()),
        ("reference_top_logit_at_divergence", pa.float32()),
        # The first read: the logits this cell chose its first token from, against the reference's for the same
        # pending token (on ref-test both read the reference cache's bytes). Null where nothing was decoded.
        ("first_logits_identical", pa.bool_()),  # bit for bit
        ("first_argmax_same", pa.bool_()),
        ("first_logits_max_abs", pa.float64()),
        # cache_type: a cell that read a cache of the other type read it converted (design in experiments.factor_settings):
        # that cache's fingerprint; on ref-test (the reference quantized offline) whether it has the native
        # test build's bytes, and from which layer it differs.
        ("converted_digest", pa.string()),
        ("converted_equals_test", pa.bool_()),
        ("converted_first_differing_layer", pa.int32()),
        # Token positions this cell fed through the model, padding included (its build, where it built one,
        # and its continuation); test-ref also counts a reference cache rebuilt because it was not stored.
        ("forward_positions", pa.int64()),
        ("model_fingerprint", pa.string()),
        *ENVIRONMENT_FIELDS,
    ]
)

# The factor columns added with the first read and the margins at divergence.
FACTOR_LOGIT_COLUMNS = (
    "margin_at_divergence",
    "reference_margin_at_divergence",
    "reference_top_logit_at_divergence",
    "first_logits_identical",
    "first_argmax_same",
    "first_logits_max_abs",
)
# The factor columns each later version of E6 added, oldest first, with what they record. A factor table that
# lacks exactly the columns of the last versions was written before them, and only its factor jobs can compute
# them (verify names the migration once).
FACTOR_LATER_COLUMNS = (
    ("the first read and the margins at divergence", FACTOR_LOGIT_COLUMNS),
    ("the run of a cell under load", ("run",)),
)

# Served requests (experiments.served): one row per (server, item, cell, run), a whole greedy request as a client
# sends it to a llama-server deployed or attached, with what came back.
SERVED_SCHEMA = pa.schema(
    [
        ("server", pa.string()),  # the config's name for it (served.servers); the first is the reference
        ("item_id", pa.string()),
        # alone, control (alone again), replay and replay_control (the stage boundary's prefix as a new prompt),
        # hit (prompt-cache hit), load (amid other clients), copies (the same request several times at once), slot
        # (alone on one slot, each slot in turn), offset (alone behind another slot's idle cells)
        ("cell", pa.string()),
        # pinned: token ids on /completion, prompt reuse off but for the hit; default: chat messages on
        # /v1/chat/completions as an OpenAI-compatible client sends them, the server's prompt cache as it defaults
        ("client", pa.string()),
        ("run", pa.int32()),  # load: the schedule (0..load_runs-1); copies: the copy; slot: the slot; offset: C
        ("tokens", pa.list_(pa.int64())),  # the tokens generated (greedy unless ``sampling`` says otherwise)
        ("margins", pa.list_(pa.float32())),  # at each step, top-1 minus top-2 log-probability: logits
        ("reused", pa.int32()),  # prompt positions the server took from its cache (timings.cache_n)
        ("decoded", pa.int32()),  # prompt positions it computed (timings.prompt_n)
        ("seconds", pa.float64()),  # the request's wall time
        ("others", pa.list_(pa.string())),  # load: the other clients' items, by arrival; hit: the items between
        ("arrivals", pa.list_(pa.float64())),  # load: their arrivals, seconds from the item's
        ("others_generated", pa.list_(pa.int32())),  # load: the tokens each other client got back, by arrival
        ("others_seconds", pa.list_(pa.float64())),  # load: each other client's wall time, by arrival
        ("slot", pa.int32()),  # the slot that served the request (its answer's id_slot)
        # Whether the pattern's trigger happened, from the server's batch log: "met: ...", "not met: ...",
        # "not proven: ..."; "" for a request alone.
        ("trigger", pa.string()),
        # How each token was picked, as JSON: {"temperature": 0} (greedy), or the sampled request's temperature and
        # seed (and top_k, top_p where given), the same for every request of the table.
        ("sampling", pa.string()),
        ("server_record", pa.string()),  # JSON: how the server was started or where it was attached, what it said
        ("model_fingerprint", pa.string()),
    ]
)
# Columns added to the served table since its first version (a table without them: MIGRATIONS).
SERVED_LATER_COLUMNS = (
    ("what the other clients amid load got back", ("others_generated", "others_seconds")),
    ("the client, the slot and whether a pattern's trigger happened", ("client", "slot", "trigger")),
    ("how each token was picked (greedy or seeded sampling)", ("sampling",)),
)

# One row per checkpoint and item: the integers every stage (and the audit) starts from.
PROMPT_SCHEMA = pa.schema(
    [
        ("item_id", pa.string()),
        ("prompt_tokens", pa.list_(pa.int64())),
        ("prompt_fingerprint", pa.string()),
        # The forced-choice readout's cue and the token of each choice letter (A, B, ...), tokenized
        # here with the prompt so every job (and the audit) reads the same integers.
        ("readout_cue_tokens", pa.list_(pa.int64())),
        ("readout_letter_tokens", pa.list_(pa.int64())),
    ]
)

# How each token id of a checkpoint is spelled, written by the prompts job (which holds the
# tokenizer) so that the report and `stagereplay show` spell tokens without loading an engine.
VOCAB_SCHEMA = pa.schema(
    [
        ("token_id", pa.int64()),
        ("text", pa.string()),
    ]
)

# The artifact name's ending of a check against the saved runs' spread (a run under load has no one saved twin):
# an expected spread, not a reproduction, so E4 counts these apart.
SPREAD_SUFFIX = "_in_spread"

# One row per audited artifact (E4): a saved fingerprint against its recomputation.
AUDIT_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),  # trajectory, comparison, transplant, selection or model
        ("artifact", pa.string()),  # prefix, cache, layer_k, layer_v, suffix, label, comparison, ...
        ("checkpoint", pa.string()),
        ("item_id", pa.string()),
        (
            "side",
            pa.string(),
        ),  # the row's label, e.g. "live/bf16/rep0" or "selected: live/bf16/rep0 -> prefill/bf16/rep0<-bf16"
        ("reproduced", pa.bool_()),
        ("saved", pa.string()),  # the saved fingerprint (or value) of the first difference
        ("audited", pa.string()),
        ("first_differing_layer", pa.int32()),
        ("first_differing_position", pa.int32()),
        ("detail", pa.string()),
        ("environment_differs", pa.bool_()),  # device, threads, attention or versions differ from the saved row
        ("environment", pa.string()),  # e.g. "threads 1 -> 2"
    ]
)

# The columns that identify a row: no two rows of a table share them (verify, the audit and the
# comparisons look rows up by them).
TRAJECTORY_KEY = ("checkpoint", "construction", "precision", "prefix_precision", "replica", "item_id")
COMPARISON_KEY = ("experiment", "relation", "checkpoint", "precision", "item_id", "a", "b")
TRANSPLANT_KEY = ("selection", "checkpoint", "item_id", "donor", "recipient", "precision", "subset")
# A factor cell, and (with its run) a factor row.
FACTOR_CELL_KEY = ("checkpoint", "precision", "factor", "level", "item_id", "cell")
FACTOR_KEY = (*FACTOR_CELL_KEY, "run")
SERVED_KEY = ("server", "item_id", "cell", "client", "run")
# The served cells whose input is pinned (one request at a time, the same cache history): a rerun must give the
# same tokens and margins. A load cell's run depends on where the other clients have got when the item arrives.
SERVED_PINNED_CELLS = ("alone", "control", "replay", "replay_control", "slot", "offset", "hit")


def row_key(row: dict, columns: tuple[str, ...]) -> tuple:
    return tuple(row[name] for name in columns)


SCHEMAS = {
    "trajectories": TRAJECTORY_SCHEMA,
    "comparisons": COMPARISON_SCHEMA,
    "transplants": TRANSPLANT_SCHEMA,
    "factors": FACTOR_SCHEMA,
    "served": SERVED_SCHEMA,
    "prompts": PROMPT_SCHEMA,
    "audit": AUDIT_SCHEMA,
}


def is_object_id(text: str) -> bool:
    return isinstance(text, str) and len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def rows_digest(table: pa.Table) -> str:
    """xxh3-128 over the rows as canonical JSON: the same for any chunking or file layout."""
    canonical = json.dumps(table.to_pylist(), sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(canonical.encode())


def stored_rows_digest(table: pa.Table) -> str | None:
    metadata = table.schema.metadata or {}
    digest = metadata.get(ROWS_DIGEST_KEY)
    return digest.decode() if digest is not None else None


def write_table(rows: list[dict], schema: pa.Schema, path: str | Path) -> Path:
    """Write rows as Parquet with ``schema`` and the digest of its rows, atomically."""
    table = pa.Table.from_pylist(rows, schema=schema)
    # The digest is taken after conversion (float32 rounding included), so reading back reproduces it.
    table = table.replace_schema_metadata({ROWS_DIGEST_KEY: rows_digest(table).encode()})
    return atomic_write(path, lambda temporary: pq.write_table(table, temporary))


def read_vocabulary(path: str | Path) -> dict[int, str]:
    """A checkpoint's vocabulary table as token id -> its spelling (``VOCAB_SCHEMA``; ``ledger.text``)."""
    table = read_table(path, VOCAB_SCHEMA)
    return dict(zip(table.column("token_id").to_pylist(), table.column("text").to_pylist()))


def read_table(path: str | Path, schema: pa.Schema | None = None) -> pa.Table:
    path = Path(path)
    if not path.exists():
        raise LedgerError(f"ledger table {path} not found — run the workflow to create it")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise LedgerError(f"ledger table {path} is unreadable ({error}) — delete it and rerun the workflow") from None
    if schema is not None and not table.schema.equals(schema):
        before = table_before(table.schema, schema)
        if before is not None:
            raise LedgerError(f"ledger table {path}: {before[0]} — {before[1].fix}")
        raise LedgerError(f"ledger table {path} does not have the expected schema — rerun the workflow to rebuild it")
    return table


@dataclass(frozen=True)
class Migration:
    """How a table written before some of its columns existed is named and rewritten: the workflow sees no changed
    input, so only a forced rerun of the jobs that compute the columns rewrites it."""

    schema: pa.Schema  # today's
    kind: str  # "factor": in "N more factor tables"
    recorder: str  # "E6": in "written before E6 recorded ..."
    later_columns: tuple  # (what they record, (column, ...)), oldest first
    fix: str


MIGRATIONS = (
    Migration(
        FACTOR_SCHEMA,
        "factor",
        "E6",
        FACTOR_LATER_COLUMNS,
        "migrate it: rerun snakemake --forcerun factor (the factor jobs rewrite every E6 row with them; gathering,"
        " summary.json and the card follow)",
    ),
    Migration(
        SERVED_SCHEMA,
        "served",
        "the served requests",
        SERVED_LATER_COLUMNS,
        "migrate it: rerun snakemake --forcerun served (the served jobs send every request again; gathering,"
        " summary.json and the card follow)",
    ),
)


def table_before(found: pa.Schema, expected: pa.Schema) -> tuple[str, Migration] | None:
    """What a table found where one of ``expected`` belongs was written before (its columns are today's less exactly
    those the last versions of its later columns added) and its migration, or None if it is not such a table."""
    for migration in MIGRATIONS:
        if migration.schema is not expected:
            continue
        today = list(expected.remove_metadata())
        for start in range(len(migration.later_columns)):
            later = migration.later_columns[start:]
            missing = [column for _, columns in later for column in columns]
            if list(found.remove_metadata()) == [field for field in today if field.name not in missing]:
                return (
                    f"written before {migration.recorder} recorded {' and '.join(what for what, _ in later)}"
                    f" (no {', '.join(missing)}): only the {migration.kind} jobs compute them",
                    migration,
                )
    return None


def concat_tables(paths: list[str | Path], schema: pa.Schema) -> pa.Table:
    tables = [read_table(path, schema) for path in paths]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def checkpoint_order(comparisons: pa.Table) -> list[str]:
    """The checkpoints of a comparisons table: the primary one (the one E3 ran on) first, then the others by name."""
    rows = comparisons.select(["checkpoint", "experiment", "relation"]).to_pylist()
    primary = sorted(
        {row["checkpoint"] for row in rows if row["experiment"] == "E3" and row["relation"] == "construction"}
    )
    return primary + sorted({row["checkpoint"] for row in rows} - set(primary))
