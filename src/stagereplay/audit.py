"""E4: compare the saved ledger with its recomputation, fingerprint by fingerprint.

The audit tree (``<ledger>/audit/``) is rebuilt by the workflow's own rules from
the saved inputs only: prompt tokens, saved live prefixes, saved caches and the
saved selection. Here every saved row is matched with its recomputed twin and
every recomputed artifact compared: the prefix tokens of live rows (a rebuilt
row's prefix is the saved one, copied, so it proves nothing), each layer's K and
V, the cache digest, suffix tokens, labels, comparison rows, transplant outcomes,
the E5 selection and the model fingerprint. A key shared by several rows, or a
construction pair over unequal prefixes, is a failed check. A difference of
environment (device, threads, attention, versions) is recorded beside each row,
apart from a difference of result.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from .compare import Side, first_divergence
from .ledger import (
    COMPARISON_SCHEMA,
    ENVIRONMENT_COLUMNS,
    TRAJECTORY_SCHEMA,
    TRANSPLANT_SCHEMA,
    LedgerError,
    ObjectStore,
    read_table,
)

MISMATCHES_LISTED = 50
NOT_MEASURED = "not measured"


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
    changes = [f"{name} {saved[name]} -> {audited[name]}" for name in ENVIRONMENT_COLUMNS
               if name in saved and saved[name] != audited[name]]
    return "; ".join(changes) or None


def _same(kind: str, artifact: str, where: dict, saved, audited, **extra) -> Check:
    return Check(kind, artifact, **where, reproduced=saved == audited, saved=None if saved == audited else str(saved),
                 audited=None if saved == audited else str(audited), **extra)


def _layers(kind: str, artifact: str, where: dict, saved: list[str], audited: list[str], **extra) -> Check:
    layer = first_divergence(list(saved), list(audited))
    return Check(kind, artifact, **where, reproduced=layer is None,
                 saved=None if layer is None else (saved[layer] if layer < len(saved) else f"{len(saved)} layers"),
                 audited=None if layer is None else (audited[layer] if layer < len(audited) else f"{len(audited)} layers"),
                 first_differing_layer=layer, **extra)


def _tokens(kind: str, artifact: str, where: dict, saved_id: str, audited_id: str, saved: list[int], audited: list[int],
            **extra) -> Check:
    position = None if saved_id == audited_id else first_divergence(list(saved), list(audited))
    detail = None
    if position is not None and position < min(len(saved), len(audited)):
        detail = f"token {saved[position]} saved, {audited[position]} recomputed"
    elif saved_id != audited_id:
        detail = f"{len(saved)} tokens saved, {len(audited)} recomputed"
    return Check(kind, artifact, **where, reproduced=saved_id == audited_id,
                 saved=None if saved_id == audited_id else saved_id,
                 audited=None if saved_id == audited_id else audited_id,
                 first_differing_position=position, detail=detail, **extra)


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
    checks = [Check(kind, kind, **where(first[k]), reproduced=False,
                    detail=f"{counts[k]} rows share the key {k} in {place} — rebuild that table (rerun snakemake)")
              for k in sorted(shared, key=str)]
    return shared, checks


def _paired(kind: str, saved: pa.Table, audited: pa.Table, key, label) -> tuple[list[tuple], list[Check]]:
    """Each saved row with its recomputed twin, where it is and how its environment differs;
    a failed check for every row of either side without a twin, and for every key shared by several rows."""

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
            pairs.append((row, twin, where(row), {"environment_differs": environment is not None, "environment": environment}))
    return pairs, checks


def _side_label(row: dict) -> str:
    return Side(row["construction"], row["precision"], row["prefix_precision"], row["replica"]).label()


def _trajectory_key(row: dict) -> tuple:
    return (row["checkpoint"], row["construction"], row["precision"], row["prefix_precision"], row["replica"], row["item_id"])


def audit_trajectories(saved: pa.Table, audited: pa.Table, saved_store: ObjectStore, audit_store: ObjectStore) -> list[Check]:
    pairs, checks = _paired("trajectory", saved, audited, _trajectory_key, _side_label)
    for old, new, where, extra_fields in pairs:
        checks.append(_same("trajectory", "model_fingerprint", where, old["model_fingerprint"], new["model_fingerprint"],
                            **extra_fields))
        # A rebuilt row's prefix is copied from the saved live row, not recomputed: comparing it would
        # count a copy as a reproduction. Only a live row's prefix is generated again from the prompt.
        if old["construction"] == "live":
            # Tokens are loaded only to locate a difference.
            differs = old["prefix_object"] != new["prefix_object"]
            prefix_old = saved_store.get_tokens(old["prefix_object"]) if differs else []
            prefix_new = audit_store.get_tokens(new["prefix_object"]) if differs else []
            checks.append(_tokens("trajectory", "prefix", where, old["prefix_object"], new["prefix_object"], prefix_old,
                                  prefix_new, **extra_fields))
        checks += [
            _same("trajectory", "cache", where, old["cache_object"], new["cache_object"], **extra_fields),
            _layers("trajectory", "layer_k", where, old["layer_k"], new["layer_k"], **extra_fields),
            _layers("trajectory", "layer_v", where, old["layer_v"], new["layer_v"], **extra_fields),
            _tokens("trajectory", "suffix", where, old["suffix_object"], new["suffix_object"], old["suffix_tokens"],
                    new["suffix_tokens"], **extra_fields),
            _same("trajectory", "label", where, (old["answer"], old["correct"]), (new["answer"], new["correct"]),
                  **extra_fields),
        ]
    return checks


def _comparison_key(row: dict) -> tuple:
    return (row["experiment"], row["relation"], row["checkpoint"], row["precision"], row["item_id"], row["a"], row["b"])


def audit_comparisons(saved: pa.Table, audited: pa.Table) -> list[Check]:
    pairs, checks = _paired("comparison", saved, audited, _comparison_key,
                            lambda row: f"{row['experiment']}: {row['a']} vs {row['b']}")
    for old, new, where, _ in pairs:
        differing = [name for name in old if old[name] != new[name]]
        details = [f"fields differ: {', '.join(differing)}"] if differing else []
        # Every construction of a pair is built over the same saved prefix, so unequal prefixes mean the
        # pair compared two different states, even when saved and recomputed rows agree on it.
        if old["relation"] == "construction" and not (old["prefix_equal"] and new["prefix_equal"]):
            details.append("prefixes of the construction pair differ (every construction is built over the same prefix)")
        checks.append(Check(
            "comparison", "comparison", **where, reproduced=not details,
            detail="; ".join(details) or None,
            first_differing_layer=old["first_differing_layer"] if "cache_exact" in differing else None,
        ))
    return checks


def _transplant_key(row: dict) -> tuple:
    return (row["selection"], row["checkpoint"], row["item_id"], row["donor"], row["recipient"], row["precision"],
            row["subset"])


def audit_transplants(saved: pa.Table, audited: pa.Table) -> list[Check]:
    pairs, checks = _paired("transplant", saved, audited, _transplant_key,
                            lambda row: f"{row['selection']}: {row['donor']} -> {row['recipient']} {row['subset']}")
    for old, new, where, extra_fields in pairs:
        checks += [
            _layers("transplant", "transplant_cache", where, old["layer_k"] + old["layer_v"],
                    new["layer_k"] + new["layer_v"], **extra_fields),
            _tokens("transplant", "transplant_suffix", where, old["suffix_object"], new["suffix_object"],
                    old["suffix_tokens"], new["suffix_tokens"], **extra_fields),
            _same("transplant", "outcome", where, old["outcome"], new["outcome"], **extra_fields),
        ]
    return checks


def audit_selection(saved: dict, audited: dict) -> list[Check]:
    return [
        _same("selection", "selection", {"checkpoint": saved[name].get("checkpoint"), "item_id": None, "side": name},
              saved[name]["item_ids"], audited[name]["item_ids"])
        for name in sorted(saved)
    ]


def audit_models(saved_records: dict[str, dict], audited_records: dict[str, dict]) -> list[Check]:
    """The checkpoints the audit used (a ledger may also hold records of checkpoints no longer configured)."""
    return [
        _same("model", "model_folder", {"checkpoint": name, "item_id": None, "side": record["folder"]},
              saved_records.get(name, {}).get("fingerprint"), record["fingerprint"])
        for name, record in sorted(audited_records.items())
    ]


def _records(root: Path) -> dict[str, dict]:
    return {path.parent.name: json.loads(path.read_text()) for path in sorted(root.glob("models/*/model.json"))}


def audit_ledger(ledger: str | Path, audit_dir: str | Path) -> list[Check]:
    """Every check of the saved ledger at ``ledger`` against its recomputation in ``audit_dir``."""
    ledger, audit_dir = Path(ledger), Path(audit_dir)
    saved_store, audit_store = ObjectStore(ledger / "objects"), ObjectStore(audit_dir / "objects")
    checks = audit_models(_records(ledger), _records(audit_dir))
    checks += audit_trajectories(read_table(ledger / "tables/trajectories.parquet", TRAJECTORY_SCHEMA),
                                 read_table(audit_dir / "tables/trajectories.parquet", TRAJECTORY_SCHEMA),
                                 saved_store, audit_store)
    checks += audit_comparisons(read_table(ledger / "tables/comparisons.parquet", COMPARISON_SCHEMA),
                                read_table(audit_dir / "tables/comparisons.parquet", COMPARISON_SCHEMA))
    if (ledger / "tables/transplants.parquet").exists():
        checks += audit_transplants(read_table(ledger / "tables/transplants.parquet", TRANSPLANT_SCHEMA),
                                    read_table(audit_dir / "tables/transplants.parquet", TRANSPLANT_SCHEMA))
        checks += audit_selection(json.loads((ledger / "transplants/selection.json").read_text()),
                                  json.loads((audit_dir / "transplants/selection.json").read_text()))
    return checks


def audit_rows(checks: list[Check]) -> list[dict]:
    return [asdict(check) for check in checks]


def _describe(check: dict) -> str:
    where = " ".join(part for part in (
        f"item {check['item_id']}" if check["item_id"] else None, check["side"], check["artifact"],
        f"first differing layer {check['first_differing_layer']}" if check["first_differing_layer"] is not None else None,
        f"first differing position {check['first_differing_position']}" if check["first_differing_position"] is not None else None,
        check["detail"],
    ) if part)
    return where


def _reproduced(values: list[bool]) -> dict:
    """x/N; with nothing audited there is no count, only the statement that nothing was measured."""
    if not values:
        return {"reproduced": None, "n": 0, "status": NOT_MEASURED}
    return {"reproduced": sum(values), "n": len(values)}


def e4_figures(rows: list[dict], audit_runtime: dict | None = None) -> dict:
    """Reproduced x/N per artifact kind, per trajectory and per item; mismatches and environment differences."""
    by_artifact: dict[str, list[bool]] = defaultdict(list)
    by_trajectory: dict[tuple, bool] = {}
    by_item: dict[tuple, bool] = {}
    for row in rows:
        by_artifact[row["artifact"]].append(row["reproduced"])
        if row["kind"] == "trajectory":
            key = (row["checkpoint"], row["item_id"], row["side"])
            by_trajectory[key] = by_trajectory.get(key, True) and row["reproduced"]
        if row["item_id"] is not None:
            key = (row["checkpoint"], row["item_id"])
            by_item[key] = by_item.get(key, True) and row["reproduced"]
    mismatches = [row for row in rows if not row["reproduced"]]
    environment = Counter(row["environment"] for row in rows if row["environment_differs"])
    # A run is reproduced only if trajectories were recomputed: a model fingerprint alone reproduces no result.
    status = "differences found" if mismatches else "reproduced" if by_trajectory else NOT_MEASURED
    figures = {
        "name": "audit",
        "status": status,
        "method": "every saved row recomputed from its saved inputs into audit/, every fingerprint compared",
        "items": _reproduced(list(by_item.values())),
        "trajectories": _reproduced(list(by_trajectory.values())),
        "artifacts": {name: _reproduced(values) for name, values in sorted(by_artifact.items())},
        "mismatches": [
            {key: row[key] for key in ("kind", "artifact", "checkpoint", "item_id", "side", "first_differing_layer",
                                       "first_differing_position", "detail", "saved", "audited")}
            for row in mismatches[:MISMATCHES_LISTED]
        ],
        "mismatches_not_listed": max(len(mismatches) - MISMATCHES_LISTED, 0),
        "environment_differences": [{"difference": text, "rows": count} for text, count in sorted(environment.items())],
    }
    if audit_runtime:
        figures["audit_runtime"] = audit_runtime
    return figures


def _fraction(entry: dict) -> str:
    return NOT_MEASURED if entry["n"] == 0 else f"{entry['reproduced']}/{entry['n']}"


def verdict(figures: dict) -> str:
    artifacts = sum(entry["n"] for entry in figures["artifacts"].values())
    reproduced = sum(entry["reproduced"] or 0 for entry in figures["artifacts"].values())
    if not artifacts:
        return f"E4 audit: {NOT_MEASURED} (no saved row was audited)"
    line = (f"E4 audit: {figures['status']}; {reproduced}/{artifacts} artifacts reproduced; trajectories "
            f"{_fraction(figures['trajectories'])}, items {_fraction(figures['items'])}")
    if figures["mismatches"]:
        line += f"; first mismatch: {_describe(figures['mismatches'][0])}"
    if figures["environment_differences"]:
        line += f"; environment differs ({figures['environment_differences'][0]['difference']})"
    return line


def add_to_summary(summary_path: str | Path, figures: dict) -> None:
    """Put E4 into summary.json (the summary rule drops it again whenever the ledger changes)."""
    from .summary import write_json

    path = Path(summary_path)
    if not path.exists():
        raise LedgerError(f"{path} not found — run snakemake on the same config before the audit")
    summary = json.loads(path.read_text())
    summary["E4"] = figures
    write_json(summary, path)

