"""E4 for the served requests: each saved request against its recomputation in the audit tree.

The pinned client's request alone, its A/A repeat, the replays from the stage boundary and a prompt-cache hit are pinned (the same prompt to the same server, nothing else
in flight, the same cache history): their tokens and margins must be reproduced exactly. A request amid other
clients, or one of several copies sent at once, is not pinned (where the others have got when it arrives changes
from run to run), so each recomputed run is compared with the spread of the saved runs of its cell, counted apart (``SPREAD_SUFFIX``). Each server's record (how it was
started, or what an attached one said of itself) is compared too. The checks name no item as such (the item is in
the side): E4's per-item figure stays the checkpoint's items.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from stagereplay.audit.rerun import Check, _missing, _same
from stagereplay.ledger.layout import LedgerLayout
from stagereplay.ledger.tables import (
    SERVED_KEY,
    SERVED_PINNED_CELLS,
    SERVED_SCHEMA,
    SPREAD_SUFFIX,
    read_table,
    row_key,
)


def audit_served_ledger(ledger: str | Path) -> list[Check]:
    saved, audit = LedgerLayout(ledger), LedgerLayout(ledger).audit
    if not Path(saved.table("served")).exists():
        return []
    return audit_served(
        read_table(saved.table("served"), SERVED_SCHEMA), read_table(audit.table("served"), SERVED_SCHEMA)
    )


def audit_served(saved: pa.Table, audited: pa.Table) -> list[Check]:
    saved_rows, audited_rows = saved.to_pylist(), audited.to_pylist()
    recomputed = {row_key(row, SERVED_KEY): row for row in audited_rows}
    # The runs of each unpinned cell (amid load, copies at once) of an item: the spread a rerun is compared with.
    spread: dict[tuple, list[dict]] = {}
    for row in saved_rows:
        if not _pinned(row):
            spread.setdefault((row["server"], row["item_id"], row["cell"], row["client"]), []).append(row)
    checks = _records(saved_rows, audited_rows)
    for old in saved_rows:
        # The item is named in the side, not as an item: E4's per-item figure counts the checkpoint's items.
        side = f"served {old['server']} {old['cell']} run {old['run']} item {old['item_id']}"
        if old["client"] != "pinned":
            side += f" ({old['client']} client)"
        where = {"checkpoint": None, "item_id": None, "side": side}
        new = recomputed.get(row_key(old, SERVED_KEY))
        if new is None:
            checks.append(_missing("served", where, saved=True))
            continue
        if _pinned(old):
            checks.append(_same("served", "served_tokens", where, list(old["tokens"]), list(new["tokens"])))
            # As JSON, so a sampled answer's NaN (a step whose log-probabilities the server drops) equals itself.
            margins = [json.dumps(list(row["margins"])) for row in (old, new)]
            checks.append(_same("served", "served_margins", where, *margins))
            continue
        runs = spread[(old["server"], old["item_id"], old["cell"], old["client"])]
        seen = {json.dumps(list(row["tokens"])) for row in runs}
        within = json.dumps(list(new["tokens"])) in seen
        checks.append(
            Check(
                "served",
                "served_tokens" + SPREAD_SUFFIX,
                **where,
                reproduced=within,
                saved=None if within else f"{len(seen)} distinct in {len(runs)} saved runs",
                audited=None if within else json.dumps(list(new["tokens"])),
                detail=None if within else f"outside the spread of the saved {old['cell']} runs",
            )
        )
    return checks


def _pinned(row: dict) -> bool:
    """A request the audit must reproduce exactly: one of the pinned client's cells sent alone. The default client's
    requests follow whatever the prompt cache holds, itself left by runs amid others: compared with the spread."""
    return row["cell"] in SERVED_PINNED_CELLS and row["client"] == "pinned"


def _records(saved_rows: list[dict], audited_rows: list[dict]) -> list[Check]:
    """Each server's record (every row of a server holds it) against its recomputation's."""
    saved = {row["server"]: row["server_record"] for row in saved_rows}
    audited = {row["server"]: row["server_record"] for row in audited_rows}
    return [
        _same(
            "served",
            "served_server",
            {"checkpoint": None, "item_id": None, "side": server},
            record,
            audited.get(server),
        )
        for server, record in sorted(saved.items())
    ]
