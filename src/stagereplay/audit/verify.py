"""Check a saved ledger without a model: objects, tables, rows, counts, what it was computed from
(provenance.json and the labels: stagereplay.audit.provenance_check) and what was computed from them.

Every object must hash to its own name, every table must be readable, have its
schema and carry the digest of its rows, and every row must agree with the
objects it names (cache layers, token counts and suffix tokens). A fault names
the file (and row) and the fix; nothing is repaired or deleted.

A table the run produced must be there. "Produced" is read from the ledger
itself: a file was produced when something computed from it is present, since
an interrupted run (which verifies clean) simply has not got that far yet:

- tables/trajectories.parquet, when tables/comparisons.parquet or summary.json exists;
- tables/comparisons.parquet, when summary.json exists (E1-E3 are computed from it);
- tables/transplants.parquet, when summary.json holds E5;
- tables/audit.parquet, when audit/e4.json exists (computed from it);
- summary.json, when results.md or report/results.html exists (drawn from it).

summary.json must equal the figures recomputed from the tables it was computed
from: an edited figure and a summary left behind by regenerated tables are both
named by their first differing key. audit/e4.json must equal the E4 figures
recomputed from tables/audit.parquet, in the same way. E5 is
recomputed when summary.json holds it: a run that turns transplants off keeps
the old transplant table but summarises without it. The results card
(results.md, report/results.html) must carry the stamp of the summary.json
bytes it was rendered from and of its own text (stamp.py).

``documents=False`` (``verify --audit-inputs``) leaves out summary.json, the
card, the audit table and e4.json: the audit reads none of them, and verifies
before the workflow has rewritten them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stagereplay.audit.faults import RERUN, Fault, Report
from stagereplay.audit.labels import verify_labels
from stagereplay.audit.provenance_check import answer_key, verify_provenance
from stagereplay.audit.verify_documents import (
    FACTORS,
    SERVED,
    SUMMARY,
    TRAJECTORIES,
    TRANSPLANTS,
    peek_summary,
    read_summary,
    verify_cards,
    verify_e4,
    verify_produced,
    verify_summary,
)
from stagereplay.design.factors import factor_named
from stagereplay.design.storage import StorageError, caches_may_be_absent, read_policy
from stagereplay.ledger.fingerprint import fingerprint_tensor, fingerprint_tensors
from stagereplay.ledger.layout import RELATIVE, LedgerLayout
from stagereplay.ledger.store import OBJECT_SUFFIX, ObjectStore
from stagereplay.ledger.tables import (
    AUDIT_SCHEMA,
    COMPARISON_KEY,
    COMPARISON_SCHEMA,
    FACTOR_KEY,
    FACTOR_SCHEMA,
    PROMPT_SCHEMA,
    SERVED_KEY,
    SERVED_SCHEMA,
    TRAJECTORY_KEY,
    TRAJECTORY_SCHEMA,
    TRANSPLANT_KEY,
    TRANSPLANT_SCHEMA,
    VOCAB_SCHEMA,
    LedgerError,
    is_object_id,
    read_table,
    row_key,
    rows_digest,
    stored_rows_digest,
    table_before,
)


@dataclass(frozen=True)
class StoredObject:
    """What verification learnt of one object: tensor digests and shapes, and tokens if it holds any."""

    layer_digests: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    tokens: tuple[int, ...] | None


SCHEMA_OF_KIND = {
    "trajectories": TRAJECTORY_SCHEMA,
    "transplants": TRANSPLANT_SCHEMA,
    "factors": FACTOR_SCHEMA,
    "served": SERVED_SCHEMA,
    "comparisons": COMPARISON_SCHEMA,
    "audit": AUDIT_SCHEMA,
    "prompts": PROMPT_SCHEMA,
    "vocab": VOCAB_SCHEMA,
}


def table_schema(relative: Path) -> pa.Schema | None:
    """The schema a table must have, by what the layout says lies where it lies."""
    return SCHEMA_OF_KIND.get(LedgerLayout.table_kind(relative))


def verify_objects(store: ObjectStore, report: Report) -> dict[str, StoredObject]:
    known: dict[str, StoredObject] = {}
    if not store.root.is_dir():
        return known
    for path in sorted(store.root.rglob("*")):
        if not path.is_file():
            continue
        where = str(Path(RELATIVE.objects) / path.relative_to(store.root))
        if path.name.startswith(".") and path.name.endswith(".tmp"):
            report.leftover_temporaries += 1
            continue
        object_id = path.name.removesuffix(OBJECT_SUFFIX)
        if not path.name.endswith(OBJECT_SUFFIX) or not is_object_id(object_id) or path.parent.name != object_id[:2]:
            report.faults.append(
                Fault(
                    where,
                    "not an object of this store (a name must be <2 hex>/<32 hex>.safetensors)",
                    "move it out of the object store",
                )
            )
            continue
        report.objects += 1
        try:
            tensors = store.load_unchecked(object_id)
        except LedgerError:
            report.faults.append(Fault(where, "unreadable safetensors file (truncated or overwritten)"))
            continue
        actual = fingerprint_tensors(tensors)
        if actual != object_id:
            report.faults.append(Fault(where, f"content hashes to {actual}, not its name (bytes flipped or edited)"))
            continue
        tokens = tuple(tensors["tokens"].tolist()) if set(tensors) == {"tokens"} else None
        # A cache part stored as blocks names its format after the part (layer.000.k.q8_0-h64): rows name parts.
        parts = {".".join(name.split(".")[:3]): tensor for name, tensor in tensors.items()}
        known[object_id] = StoredObject(
            layer_digests={name: fingerprint_tensor(tensor) for name, tensor in parts.items()},
            shapes={name: tuple(tensor.shape) for name, tensor in parts.items()},
            tokens=tokens,
        )
    return known


def verify_tables(root: Path, report: Report) -> dict[str, pa.Table]:
    tables: dict[str, pa.Table] = {}
    older: dict[tuple, list[str]] = {}  # (what older tables were written before, their migration) -> their paths
    for path in LedgerLayout(root).table_files():
        relative = path.relative_to(root)
        schema = table_schema(relative)
        if schema is None:
            report.faults.append(Fault(str(relative), "not a table of this ledger", "move it out of the ledger"))
            continue
        report.tables += 1
        try:
            table = read_table(path, schema)
        except LedgerError:
            before = _table_before(path, schema)
            if before is not None:
                older.setdefault(before, []).append(str(relative))
                continue
            report.faults.append(
                Fault(str(relative), "unreadable Parquet, or not the schema of its place in the ledger")
            )
            continue
        expected = stored_rows_digest(table)
        if expected is None:
            report.faults.append(Fault(str(relative), "carries no digest of its rows (not written by stagereplay)"))
            continue
        if rows_digest(table) != expected:
            report.faults.append(
                Fault(str(relative), "rows differ from the digest written with them (a cell was edited)")
            )
            continue
        report.rows += table.num_rows
        tables[str(relative)] = table
    for (before, migration), paths in older.items():
        # Every such table of a ledger is in that shape: one line for all of them, with the one fix.
        others = f" and {len(paths) - 1} more {migration.kind} tables" if len(paths) > 1 else ""
        report.faults.append(Fault(f"{paths[0]}{others}", before, migration.fix))
    return tables


def _table_before(path: Path, expected: pa.Schema) -> tuple | None:
    try:
        return table_before(pq.read_schema(path), expected)
    except (pa.ArrowException, OSError):
        return None


def _row_where(relative: str, row: dict) -> str:
    return f"{relative} item {row['item_id']}"


def _check_tokens(
    where: str,
    role: str,
    object_id: str,
    known: dict[str, StoredObject],
    faults: list[Fault],
    expected: list[int] | None = None,
    length: int | None = None,
) -> None:
    stored = known.get(object_id)
    if stored is None:
        faults.append(Fault(where, f"{role} object {object_id} is missing or corrupt"))
    elif stored.tokens is None:
        faults.append(Fault(where, f"{role} object {object_id} holds no tokens"))
    elif expected is not None and list(stored.tokens) != list(expected):
        faults.append(Fault(where, f"{role} tokens differ from object {object_id}"))
    elif length is not None and len(stored.tokens) != length:
        faults.append(
            Fault(where, f"{role} length {length} differs from object {object_id} ({len(stored.tokens)} tokens)")
        )


def _check_cache(
    where: str, row: dict, object_key: str, known: dict[str, StoredObject], faults: list[Fault], absent_ok: bool
) -> None:
    stored = known.get(row[object_key])
    if stored is None and absent_ok:
        return  # store_caches selected or none: the row's fingerprints stand for the cache
    if stored is None:
        faults.append(Fault(where, f"cache object {row[object_key]} is missing or corrupt"))
        return
    layers = len(row["layer_k"])
    for kv, digests in (("k", row["layer_k"]), ("v", row["layer_v"])):
        for layer, digest in enumerate(digests):
            if stored.layer_digests.get(f"layer.{layer:03d}.{kv}") != digest:
                faults.append(
                    Fault(where, f"layer {layer} {kv.upper()} fingerprint differs from cache object {row[object_key]}")
                )
                return
    if len(stored.layer_digests) != 2 * layers:
        faults.append(
            Fault(
                where, f"cache object {row[object_key]} holds {len(stored.layer_digests) // 2} layers, the row {layers}"
            )
        )


def verify_rows(
    tables: dict[str, pa.Table], known: dict[str, StoredObject], report: Report, absent_caches_ok: bool = False
) -> None:
    """``absent_caches_ok``: the ledger's storage.json says not every cache tensor was kept."""
    faults = report.faults
    for relative, table in tables.items():
        schema = table.schema
        rows = table.to_pylist()
        if schema.equals(TRAJECTORY_SCHEMA):
            keys = Counter(row_key(r, TRAJECTORY_KEY) for r in rows)
            for row in rows:
                where = _row_where(relative, row)
                _check_tokens(where, "prefix", row["prefix_object"], known, faults, length=row["prefix_length"])
                _check_tokens(where, "suffix", row["suffix_object"], known, faults, expected=row["suffix_tokens"])
                _check_cache(where, row, "cache_object", known, faults, absent_caches_ok)
                stored = known.get(row["cache_object"])
                if stored is not None and stored.shapes.get("layer.000.k", (0, 0, -1))[-2] != row["cache_positions"]:
                    faults.append(
                        Fault(where, f"cache_positions {row['cache_positions']} differs from the cache object")
                    )
        elif schema.equals(TRANSPLANT_SCHEMA):
            keys = Counter(row_key(r, TRANSPLANT_KEY) for r in rows)
            for row in rows:
                _check_tokens(
                    _row_where(relative, row),
                    "transplant suffix",
                    row["suffix_object"],
                    known,
                    faults,
                    expected=row["suffix_tokens"],
                )
        elif schema.equals(FACTOR_SCHEMA):
            keys = Counter(row_key(r, FACTOR_KEY) for r in rows)
            for row in rows:
                verify_factor_row(_row_where(relative, row), row, known, faults)
        elif schema.equals(COMPARISON_SCHEMA):
            keys = Counter(row_key(r, COMPARISON_KEY) for r in rows)
            for row in rows:
                # Every construction is rebuilt from the saved live prefix: two prefixes mean a broken ledger.
                if row["relation"] == "construction" and not row["prefix_equal"]:
                    faults.append(
                        Fault(
                            _row_where(relative, row),
                            f"{row['experiment']} {row['a']} vs {row['b']} compares different prefixes",
                        )
                    )
        elif schema.equals(SERVED_SCHEMA):
            keys = Counter(row_key(r, SERVED_KEY) for r in rows)
            for row in rows:
                if len(row["margins"]) != len(row["tokens"]):
                    faults.append(Fault(_row_where(relative, row), "a margin is missing for some generated token"))
        elif schema.equals(PROMPT_SCHEMA):
            keys = Counter(r["item_id"] for r in rows)
        else:
            keys = Counter()
        for key, count in keys.items():
            if count > 1:
                faults.append(Fault(relative, f"{count} rows share the key {key}", "rebuild the table: " + RERUN))


def verify_factor_row(where: str, row: dict, known: dict[str, StoredObject], faults: list[Fault]) -> None:
    """An E6 cell: its suffix tokens are its object's, a prefix-cache hit reused tokens, and a cell over the
    reference cache names the reference's bytes."""
    if not row["applicable"]:
        return
    where = f"{where} {row['factor']}={row['level']} {row['cell']}"
    _check_tokens(where, "suffix", row["suffix_object"], known, faults, expected=row["suffix_tokens"])
    _check_tokens(where, "prefix", row["prefix_object"], known, faults)
    if factor_named(row["factor"]).reuses_prefix and not (row["reused_tokens"] or 0) > 0:
        faults.append(Fault(where, "a prefix-cache hit that reused no tokens"))
    if row["build"] == "ref" and row["cache_digest"] != row["reference_cache"]:
        faults.append(Fault(where, "a cell built under the reference names another cache than the reference's"))
    if row["build"] == "test" and row["cache_differs"] != (row["cache_digest"] != row["reference_cache"]):
        faults.append(Fault(where, f"cache_differs is {row['cache_differs']}, but its digest says otherwise"))


def verify_gathered(tables: dict[str, pa.Table], report: Report) -> None:
    """The gathered tables hold exactly rows of the shard tables (row counts and contents)."""
    for gathered in (TRAJECTORIES, TRANSPLANTS, FACTORS, SERVED):
        if gathered not in tables:
            continue
        kind = LedgerLayout.table_kind(gathered)
        shard_rows = {
            _canonical(row)
            for relative, table in tables.items()
            if relative != gathered and LedgerLayout.table_kind(relative) == kind
            for row in table.to_pylist()
        }
        rows = tables[gathered].to_pylist()
        strays = [row for row in rows if _canonical(row) not in shard_rows]
        if strays:
            report.faults.append(
                Fault(
                    gathered,
                    f"{len(strays)} of {len(rows)} rows match no shard table (first: item {strays[0]['item_id']})",
                    "rerun snakemake --forcerun gather gather_transplants gather_factors to regather",
                )
            )


def verify_factor_references(tables: dict[str, pa.Table], report: Report) -> None:
    """Each E6 row names, as its reference, the cache and suffix of E2's prefill row it started from."""
    if FACTORS not in tables or TRAJECTORIES not in tables:
        return
    prefill = {
        (row["checkpoint"], row["precision"], row["item_id"]): row
        for row in tables[TRAJECTORIES].to_pylist()
        if row["construction"] == "prefill" and row["replica"] == 0 and row["prefix_precision"] == row["precision"]
    }
    for row in tables[FACTORS].to_pylist():
        reference = prefill.get((row["checkpoint"], row["precision"], row["item_id"]))
        named = (row["reference_cache"], row["reference_suffix"], row["prefix_object"])
        if reference is None or named != (
            reference["cache_object"],
            reference["suffix_object"],
            reference["prefix_object"],
        ):
            report.faults.append(
                Fault(
                    f"{FACTORS} item {row['item_id']}",
                    f"{row['factor']}={row['level']} {row['cell']} does not start from the E2 prefill row of the"
                    " trajectories table (E6 rows computed from other E2 rows)",
                    "rerun snakemake --forcerun factor to recompute E6 from the current rows",
                )
            )
            return


def verify_counts(root: Path, tables: dict[str, pa.Table], report: Report) -> None:
    """Each gathered trajectory group (checkpoint, construction, precision, replica) covers every item."""
    if TRAJECTORIES not in tables or not (root / RELATIVE.items).is_file():
        return
    items = sum(1 for line in (root / RELATIVE.items).read_text().splitlines() if line.strip())
    group_key = tuple(name for name in TRAJECTORY_KEY if name != "item_id")
    groups = Counter(row_key(row, group_key) for row in tables[TRAJECTORIES].to_pylist())
    for group, count in sorted(groups.items()):
        if count != items:
            report.faults.append(
                Fault(
                    TRAJECTORIES,
                    f"{count} rows for {'/'.join(map(str, group))}, but items.jsonl holds {items} items",
                    "rerun snakemake --forcerun gather to regather",
                )
            )


def _canonical(row: dict) -> str:
    return json.dumps(row, sort_keys=True)


def verify_ledger(root: str | Path, documents: bool = True) -> Report:
    """Every check of the ledger at ``root``; ``documents=False`` leaves out summary.json, the card, the
    audit table and e4.json (what the audit reads nothing of, and verifies before they are rewritten)."""
    root = Path(root)
    if not LedgerLayout(root).exists():
        raise LedgerError(
            f"no ledger at {root} (no objects/, tables/ or runs/) — pass the ledger_dir of a run, e.g. ledger"
        )
    report = Report()
    known = verify_objects(ObjectStore(LedgerLayout(root).objects), report)
    tables = verify_tables(root, report)
    verify_rows(tables, known, report, _caches_may_be_absent(root, report))
    verify_gathered(tables, report)
    verify_factor_references(tables, report)
    verify_counts(root, tables, report)
    provenance = verify_provenance(root, (root / SUMMARY).is_file(), report.faults)
    if provenance is not None:
        prefixes = {name: stored.tokens for name, stored in known.items() if stored.tokens is not None}
        verify_labels(root, answer_key(provenance), tables, prefixes, report)
    summary = read_summary(root, report) if documents else None
    verify_produced(root, summary if documents else peek_summary(root), documents, report)
    if documents:
        verify_summary(summary, tables, report)
        verify_e4(root, tables, report)
        verify_cards(root, report)
    return report


def _caches_may_be_absent(root: Path, report: Report) -> bool:
    try:
        return caches_may_be_absent(read_policy(root / RELATIVE.storage))
    except StorageError as error:
        what, _, fix = str(error).partition(" — ")
        report.faults.append(Fault(RELATIVE.storage, what.removeprefix(f"{root / RELATIVE.storage} "), fix))
        return False
