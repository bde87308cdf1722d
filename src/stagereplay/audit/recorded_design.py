"""What the audit reruns: the design recorded in the ledger (provenance.json), not the config on disk.

``snakemake --config mode=audit`` hands the config it was given to ``audit_config``, which returns the
config the audit runs instead: the ledger's recorded design, with only what is the audit's own to choose taken
from the given config (where the ledger lies, the ``audit`` block, and a job's memory and time
limits). It refuses, in one line naming what differs, a ledger it cannot rerun: one not finished,
one with no provenance record (or one of format 1, naming its migration), or one computed with
other engine versions than this environment has.
"""

from __future__ import annotations

import copy

from stagereplay.engines.registry import ENGINE_LIBRARIES, SPECS
from stagereplay.ledger.jsondiff import value_at
from stagereplay.ledger.layout import LedgerLayout
from stagereplay.ledger.provenance import (
    OldFileDigests,
    ProvenanceError,
    design_of,
    first_config_difference,
    library_versions,
    read_provenance,
)

# A model job's limits on a cluster: the audit's machine may need others than the run's.
RESOURCE_KEYS = ("mem_mb", "runtime_minutes", "device_memory_gb")


class AuditRefused(ValueError):
    """One line: why this ledger cannot be audited here, and the fix."""


def _given_design(config: dict) -> dict | None:
    """The given config resolved (defaults filled), to name where it differs; None when it is not valid."""
    from stagereplay.design.schema import ConfigError, resolve_config

    try:
        return design_of(resolve_config(copy.deepcopy(config)))
    except ConfigError:
        return None


def check_versions(record: dict, current: dict) -> None:
    engines = sorted({checkpoint["engine"] for checkpoint in record["checkpoints"].values()})
    for engine in engines:
        for library in SPECS[engine].libraries if engine in SPECS else ():
            recorded, here = record["environment"].get(library), current.get(library)
            if recorded != here:
                raise AuditRefused(
                    f"audit: the ledger was computed with {library} {recorded}, this environment has {here}"
                    f" — install {library}=={recorded} to audit it (the versions are in provenance.json)"
                )


def audit_config(config: dict) -> tuple[dict, str | None]:
    """(the config the audit runs, a note naming the first key where the given config's design differs)."""
    ledger = LedgerLayout(config.get("ledger_dir", "ledger"))
    if not ledger.exists() or not ledger.root.joinpath("summary.json").is_file():
        raise AuditRefused(
            f"audit: no finished ledger at {ledger.root} (no summary.json) — run snakemake --cores N first,"
            " or point ledger_dir at the ledger to audit"
        )
    try:
        record = read_provenance(ledger.provenance)
    except OldFileDigests as error:
        raise AuditRefused(f"audit: {error}") from None
    except ProvenanceError as error:
        raise AuditRefused(
            f"audit: {str(error).partition(' — ')[0]}, so the design to rerun is unknown"
            " — run snakemake once with the ledger's config (it records it), then audit"
        ) from None
    check_versions(record, library_versions(ENGINE_LIBRARIES))
    design = copy.deepcopy(record["config"])
    given_runtime = config.get("runtime", {})
    design["runtime"].update({key: given_runtime[key] for key in RESOURCE_KEYS if key in given_runtime})
    audited = {**design, "audit": copy.deepcopy(config.get("audit", {})), "mode": "audit"}
    if "ledger_dir" in config:
        audited["ledger_dir"] = config["ledger_dir"]
    given = _given_design(config)
    note = None
    if given is not None:
        difference = first_config_difference(record["config"], given)
        if difference is not None:
            key = ".".join(map(str, difference))
            note = (
                f"audit: the design comes from {ledger.provenance}; the config given differs"
                f" at {key} ({value_at(given, difference)} here, {value_at(record['config'], difference)} in the ledger)"
            )
    return audited, note
