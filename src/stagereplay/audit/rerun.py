"""E4: compare the saved ledger with its recomputation, fingerprint by fingerprint.

The audit tree (``<ledger>/audit/``) is rebuilt by the workflow's own rules from
the saved inputs only: prompt tokens, saved live prefixes, saved caches and the
saved selection. Here every saved row is matched with its recomputed twin and
every recomputed artifact compared: the prefix tokens of live rows (a rebuilt
row's prefix is the saved one, copied, so it proves nothing), each layer's K and
V, the cache digest, suffix tokens, labels, the forced-choice readout, comparison rows, transplant outcomes,
E6's cells, the E5 selection and the model fingerprint. A key shared by several rows, or a
construction pair over unequal prefixes, is a failed check. A difference of
environment (device, threads, attention, versions) is recorded beside each row,
apart from a difference of result.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from stagereplay.design.divergence import first_divergence
from stagereplay.design.jobs import trajectory_label
from stagereplay.ledger.environment import ENVIRONMENT_COLUMNS
from stagereplay.ledger.layout import LedgerLayout
from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import (
    COMPARISON_KEY,
    COMPARISON_SCHEMA,
    FACTOR_CELL_KEY,
    FACTOR_KEY,
    FACTOR_SCHEMA,
    SPREAD_SUFFIX,
    TRAJECTORY_KEY,
    TRAJECTORY_SCHEMA,
    TRANSPLANT_KEY,
    TRANSPLANT_SCHEMA,
    read_table,
    row_key,
)


@dataclass(frozen=True)
class Check:
    """One audited artifact of one saved row."""

    kind: str
    artifact: str
    checkpoint: str | None
    item_id: str | None
    side: str
    reproduced: bool
    saved: str | None = None
    audited: str | None = None
    first_differing_layer: int | None = None
    first_differing_position: int | None = None
    detail: str | None = None
    environment_differs: bool = False
    environment: str | None = None


def environment_difference(saved: dict, audited: dict) -> str | None:
    changes = [
        f"{name} {saved[name]} -> {audited[name]}"
        for name in ENVIRONMENT_COLUMNS
        if name in saved and saved[name] != audited[name]
    ]
    return "; ".join(changes) or None


def _same(kind: str, artifact: str, where: dict, saved, audited, **extra) -> Check:
    return Check(
        kind,
        artifact,
        **where,
        reproduced=saved == audited,
        saved=None if saved == audited else str(saved),
        audited=None if saved == audited else str(audited),
        **extra,
    )


def _layers(kind: str, artifact: str, where: dict, saved: list[str], audited: list[str], **extra) -> Check:
    layer = first_divergence(list(saved), list(audited))
    return Check(
        kind,
        artifact,
        **where,
        reproduced=layer is None,
        saved=None if layer is None else (saved[layer] if layer < len(saved) else f"{len(saved)} layers"),
        audited=None if layer is None else (audited[layer] if layer < len(audited) else f"{len(audited)} layers"),
        first_differing_layer=layer,
        **extra,
    )


def _tokens(
    kind: str, artifact: str, where: dict, saved_id: str, audited_id: str, saved: list[int], audited: list[int], **extra
) -> Check:
    position = None if saved_id == audited_id else first_divergence(list(saved), list(audited))
    detail = None
    if position is not None and position < min(len(saved), len(audited)):
        detail = f"token {saved[position]} saved, {audited[position]} recomputed"
    elif saved_id != audited_id:
        detail = f"{len(saved)} tokens saved, {len(audited)} recomputed"
    return Check(
        kind,
        artifact,
        **where,
        reproduced=saved_id == audited_id,
        saved=None if saved_id == audited_id else saved_id,
        audited=None if saved_id == audited_id else audited_id,
        first_differing_position=position,
        detail=detail,
        **extra,
    )


def _missing(kind: str, where: dict, saved: bool) -> Check:
    detail = "missing from the audit tree" if saved else "recomputed, but not in the saved ledger"
    return Check(kind, kind, **where, reproduced=False, detail=detail)


def _duplicates(kind: str, rows: list[dict], key, where, place: str) -> tuple[set, list[Check]]:
    """Keys shared by several rows, each as one failed check.

    A failed check rather than an error: the audit's job is to say what does not
    reproduce, and stopping here would hide every other result; a row whose key is
    not unique has no single twin, so it cannot count as reproduced either.
    """
    counts = Counter(key(row) for row in rows)
    first = {}
    for row in rows:
        first.setdefault(key(row), row)
    shared = {k for k, count in counts.items() if count > 1}
    checks = [
        Check(
            kind,
            kind,
            **where(first[k]),
            reproduced=False,
            detail=f"{counts[k]} rows share the key {k} in {place} — rebuild that table (rerun snakemake)",
        )
        for k in sorted(shared, key=str)
    ]
    return shared, checks


def _paired(
    kind: str, saved: pa.Table, audited: pa.Table, columns: tuple[str, ...], label
) -> tuple[list[tuple], list[Check]]:
    """Each saved row with its recomputed twin (the same key ``columns``), where it is and how its environment
    differs; a failed check for every row of either side without a twin, and for every key shared by several rows."""

    def key(row: dict) -> tuple:
        return row_key(row, columns)

    def where(row: dict) -> dict:
        return {"checkpoint": row["checkpoint"], "item_id": row["item_id"], "side": label(row)}

    saved_rows, audited_rows = saved.to_pylist(), audited.to_pylist()
    saved_shared, checks = _duplicates(kind, saved_rows, key, where, "the saved ledger")
    audited_shared, more = _duplicates(kind, audited_rows, key, where, "the audit tree")
    checks += more
    shared = saved_shared | audited_shared
    recomputed = {key(row): row for row in audited_rows if key(row) not in shared}
    saved_rows = [row for row in saved_rows if key(row) not in shared]
    saved_keys = {key(row) for row in saved_rows}

    checks += [_missing(kind, where(row), saved=True) for row in saved_rows if key(row) not in recomputed]
    checks += [_missing(kind, where(row), saved=False) for k, row in recomputed.items() if k not in saved_keys]
    pairs = []
    for row in saved_rows:
        twin = recomputed.get(key(row))
        if twin is not None:
            environment = environment_difference(row, twin)
            pairs.append(
                (row, twin, where(row), {"environment_differs": environment is not None, "environment": environment})
            )
    return pairs, checks


def audit_trajectories(
    saved: pa.Table, audited: pa.Table, saved_store: ObjectStore, audit_store: ObjectStore
) -> list[Check]:
    pairs, checks = _paired("trajectory", saved, audited, TRAJECTORY_KEY, trajectory_label)
    for old, new, where, extra_fields in pairs:
        checks.append(
            _same(
                "trajectory",
                "model_fingerprint",
                where,
                old["model_fingerprint"],
                new["model_fingerprint"],
                **extra_fields,
            )
        )
        # A rebuilt row's prefix is copied from the saved live row, not recomputed: comparing it would
        # count a copy as a reproduction. Only a live row's prefix is generated again from the prompt.
        if old["construction"] == "live":
            # Tokens are loaded only to locate a difference.
            differs = old["prefix_object"] != new["prefix_object"]
            prefix_old = saved_store.get_tokens(old["prefix_object"]) if differs else []
            prefix_new = audit_store.get_tokens(new["prefix_object"]) if differs else []
            checks.append(
                _tokens(
                    "trajectory",
                    "prefix",
                    where,
                    old["prefix_object"],
                    new["prefix_object"],
                    prefix_old,
                    prefix_new,
                    **extra_fields,
                )
            )
            # How the stage ended (budget, EOS, or the marker, matched on token ids or text) is recomputed too.
            ended_old = f"{old['boundary_reason']} ({old['marker_match']})"
            ended_new = f"{new['boundary_reason']} ({new['marker_match']})"
            checks.append(_same("trajectory", "stage_end", where, ended_old, ended_new, **extra_fields))
        checks += [
            _same("trajectory", "cache", where, old["cache_object"], new["cache_object"], **extra_fields),
            _layers("trajectory", "layer_k", where, old["layer_k"], new["layer_k"], **extra_fields),
            _layers("trajectory", "layer_v", where, old["layer_v"], new["layer_v"], **extra_fields),
            _tokens(
                "trajectory",
                "suffix",
                where,
                old["suffix_object"],
                new["suffix_object"],
                old["suffix_tokens"],
                new["suffix_tokens"],
                **extra_fields,
            ),
            _same(
                "trajectory",
                "label",
                where,
                (old["answer"], old["correct"]),
                (new["answer"], new["correct"]),
                **extra_fields,
            ),
            # The forced-choice readout: letter, label and the exact float32 logit lead.
            _same(
                "trajectory",
                "readout",
                where,
                (old["readout_answer"], old["readout_correct"], old["readout_margin"]),
                (new["readout_answer"], new["readout_correct"], new["readout_margin"]),
                **extra_fields,
            ),
        ]
    return checks


def audit_comparisons(saved: pa.Table, audited: pa.Table) -> list[Check]:
    pairs, checks = _paired(
        "comparison", saved, audited, COMPARISON_KEY, lambda row: f"{row['experiment']}: {row['a']} vs {row['b']}"
    )
    for old, new, where, _ in pairs:
        differing = [name for name in old if old[name] != new[name]]
        details = [f"fields differ: {', '.join(differing)}"] if differing else []
        # Every construction of a pair is built over the same saved prefix, so unequal prefixes mean the
        # pair compared two different states, even when saved and recomputed rows agree on it.
        if old["relation"] == "construction" and not (old["prefix_equal"] and new["prefix_equal"]):
            details.append(
                "prefixes of the construction pair differ (every construction is built over the same prefix)"
            )
        checks.append(
            Check(
                "comparison",
                "comparison",
                **where,
                reproduced=not details,
                detail="; ".join(details) or None,
                first_differing_layer=old["first_differing_layer"] if "cache_exact" in differing else None,
            )
        )
    return checks


def audit_transplants(saved: pa.Table, audited: pa.Table) -> list[Check]:
    pairs, checks = _paired(
        "transplant",
        saved,
        audited,
        TRANSPLANT_KEY,
        lambda row: f"{row['selection']}: {row['donor']} -> {row['recipient']} {row['subset']}",
    )
    for old, new, where, extra_fields in pairs:
        checks += [
            _layers(
                "transplant",
                "transplant_cache",
                where,
                old["layer_k"] + old["layer_v"],
                new["layer_k"] + new["layer_v"],
                **extra_fields,
            ),
            _tokens(
                "transplant",
                "transplant_suffix",
                where,
                old["suffix_object"],
                new["suffix_object"],
                old["suffix_tokens"],
                new["suffix_tokens"],
                **extra_fields,
            ),
            _same("transplant", "outcome", where, old["outcome"], new["outcome"], **extra_fields),
        ]
    return checks


# The factor table's logit columns (ledger.tables.FACTOR_LOGIT_COLUMNS), by the audit artifact that compares them.
FACTOR_LOGIT_ARTIFACTS = {
    "factor_first_read": ("first_logits_identical", "first_argmax_same", "first_logits_max_abs"),
    "factor_margins": ("margin_at_divergence", "reference_margin_at_divergence", "reference_top_logit_at_divergence"),
}


def _values(row: dict, columns: tuple[str, ...]) -> dict:
    return {column: row[column] for column in columns}


# A cell under load (numbered runs) against its saved runs: each artifact, and the columns that make it.
SPREAD_ARTIFACTS = {
    "factor_cache": ("layer_k", "layer_v"),
    "factor_suffix": ("suffix_object",),
    **FACTOR_LOGIT_ARTIFACTS,
}


def _factor_label(row: dict) -> str:
    run = f" run {row['run']}" if row["run"] is not None else ""
    return f"{row['factor']}={row['level']} {row['cell']}{run}"


def _in_spread(saved_runs: list[dict], new: dict, where: dict, **extra) -> list[Check]:
    """A recomputed run of a cell under load against the spread of its saved runs: each artifact is reproduced
    when it equals that of some saved run. Nothing pins the load a run meets, so no one saved run is its twin."""
    checks = []
    for artifact, columns in SPREAD_ARTIFACTS.items():
        seen = {json.dumps(_values(row, columns), sort_keys=True) for row in saved_runs}
        value = json.dumps(_values(new, columns), sort_keys=True)
        within = value in seen
        checks.append(
            Check(
                "factor",
                artifact + SPREAD_SUFFIX,
                **where,
                reproduced=within,
                saved=None if within else f"{len(seen)} distinct in {len(saved_runs)} saved runs",
                audited=None if within else value,
                detail=None if within else f"outside the spread of the {len(saved_runs)} saved runs under load",
                **extra,
            )
        )
    return checks


def audit_factors(saved: pa.Table, audited: pa.Table) -> list[Check]:
    """E6: each cell's cache (layer by layer), the converted cache it read (if any), suffix, first read and
    margins at divergence, and whether a level ran at all. A cell under load (its rows numbered by run) is
    compared with the spread of its saved runs instead (``_in_spread``)."""
    pairs, checks = _paired("factor", saved, audited, FACTOR_KEY, _factor_label)
    runs: dict[tuple, list[dict]] = {}
    for row in saved.to_pylist():
        if row["run"] is not None and row["applicable"]:
            runs.setdefault(row_key(row, FACTOR_CELL_KEY), []).append(row)
    for old, new, where, extra_fields in pairs:
        checks.append(_same("factor", "factor_applicable", where, old["applicable"], new["applicable"], **extra_fields))
        if not (old["applicable"] and new["applicable"]):
            continue
        if new["run"] is not None:
            checks += _in_spread(runs[row_key(new, FACTOR_CELL_KEY)], new, where, **extra_fields)
            continue
        checks += [
            _layers(
                "factor",
                "factor_cache",
                where,
                old["layer_k"] + old["layer_v"],
                new["layer_k"] + new["layer_v"],
                **extra_fields,
            ),
            _tokens(
                "factor",
                "factor_suffix",
                where,
                old["suffix_object"],
                new["suffix_object"],
                old["suffix_tokens"],
                new["suffix_tokens"],
                **extra_fields,
            ),
        ]
        # The first read and the margins at divergence are as deterministic as the suffix on the machine and
        # build that wrote them, so they are compared exactly, like every other recomputed value.
        checks += [
            _same("factor", artifact, where, _values(old, columns), _values(new, columns), **extra_fields)
            for artifact, columns in FACTOR_LOGIT_ARTIFACTS.items()
        ]
        if old["converted_digest"] or new["converted_digest"]:
            # cache_type: the converted cache the cell read (offline quantization, dequantization) is recomputed too.
            checks.append(
                _same(
                    "factor",
                    "factor_converted_cache",
                    where,
                    old["converted_digest"],
                    new["converted_digest"],
                    **extra_fields,
                )
            )
    return checks


def audit_selection(saved: dict, audited: dict) -> list[Check]:
    return [
        _same(
            "selection",
            "selection",
            {"checkpoint": saved[name].get("checkpoint"), "item_id": None, "side": name},
            saved[name]["item_ids"],
            audited[name]["item_ids"],
        )
        for name in sorted(saved)
    ]


def audit_models(saved_records: dict[str, dict], audited_records: dict[str, dict]) -> list[Check]:
    """The checkpoints the audit used (a ledger may also hold records of checkpoints no longer configured)."""
    return [
        _same(
            "model",
            "model_folder",
            {"checkpoint": name, "item_id": None, "side": record.get("folder") or record["gguf"]},
            saved_records.get(name, {}).get("fingerprint"),
            record["fingerprint"],
        )
        for name, record in sorted(audited_records.items())
    ]


def _records(ledger: LedgerLayout, checkpoints: list[str]) -> dict[str, dict]:
    records = {name: Path(ledger.model_record(name)) for name in checkpoints}
    return {name: json.loads(path.read_text()) for name, path in records.items() if path.is_file()}


def audit_ledger(ledger: str | Path, checkpoints: list[str]) -> list[Check]:
    """Every check of the saved ledger at ``ledger`` against its recomputation in its audit tree
    (``ledger.audit``), for the model records of ``checkpoints`` (those the run used)."""
    saved, audit = LedgerLayout(ledger), LedgerLayout(ledger).audit
    saved_store, audit_store = ObjectStore(saved.objects), ObjectStore(audit.objects)
    checks = audit_models(_records(saved, checkpoints), _records(audit, checkpoints))
    checks += audit_trajectories(
        read_table(saved.table("trajectories"), TRAJECTORY_SCHEMA),
        read_table(audit.table("trajectories"), TRAJECTORY_SCHEMA),
        saved_store,
        audit_store,
    )
    checks += audit_comparisons(
        read_table(saved.table("comparisons"), COMPARISON_SCHEMA),
        read_table(audit.table("comparisons"), COMPARISON_SCHEMA),
    )
    if Path(saved.table("transplants")).exists():
        checks += audit_transplants(
            read_table(saved.table("transplants"), TRANSPLANT_SCHEMA),
            read_table(audit.table("transplants"), TRANSPLANT_SCHEMA),
        )
        checks += audit_selection(
            json.loads(Path(saved.selection).read_text()), json.loads(Path(audit.selection).read_text())
        )
    if Path(saved.table("factors")).exists():
        checks += audit_factors(
            read_table(saved.table("factors"), FACTOR_SCHEMA), read_table(audit.table("factors"), FACTOR_SCHEMA)
        )
    return checks


def audit_rows(checks: list[Check]) -> list[dict]:
    return [asdict(check) for check in checks]
