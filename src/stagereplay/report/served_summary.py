"""The served requests' figures (``experiments.served``), from the served table alone, per server.

Per server: the A/A control (``control`` gives ``alone``'s tokens), then each cell that could change an answer,
counted over items against the item's ``alone`` answer on the same server: ``load`` per item in every run, in
some runs only (unstable under load) or in none; ``hit`` (a prompt-cache hit); and, for every server after the
first (the reference), its ``alone`` against the reference's ``alone``: what the server's own flags change.
``copies``: the same request sent several times at once, per item, how many distinct answers came back
(upstream llama.cpp issue #7052: 5-8 unique completions from 8 slots) and whether any differs from ``alone``.
E1 on the server: ``replay`` (the stage boundary's prefix sent as a new prompt) against the answer alone after the
boundary, with its own A/A control (``replay_control``). ``slot`` (where the design asks for it): the request alone on
each slot in turn, per item whether any slot's answer differs from ``alone``, and which slots did (upstream's
"FIXME: the result is not deterministic when using other slot than slot 0"). ``offset`` (the same): per C, the items
whose answer alone behind another slot's C idle cells differs from ``alone`` (E6's ``kv_offset``, served).
At each item's first divergent step, the top-1 minus top-2 log-probability margin of both answers (logits), and
the tokens per second a client saw alone and amid load, and the server's amid load (every client's tokens over the
load's span). No torch.
"""

from __future__ import annotations

import json
import statistics

import pyarrow as pa

from stagereplay.design.divergence import first_divergence
from stagereplay.report.traffic_verdict import CLIENTS, PATTERNS, client_rows, pattern_counts, verdict

MARGIN_UNIT = "logits (top-1 minus top-2 log-probability of one softmax)"


def served_summary(table: pa.Table) -> dict:
    every_row = table.to_pylist()
    # The figures below are the pinned client's; the verdict (``traffic_verdict``) takes every client's.
    rows = client_rows(every_row, "pinned")
    servers = list(dict.fromkeys(row["server"] for row in rows))
    by_cell = {(row["server"], row["item_id"], row["cell"], row["run"]): row for row in rows}
    records: dict[str, str] = {}
    for row in rows:
        records.setdefault(row["server"], row["server_record"])
    reference = servers[0] if servers else None
    # How the requests picked their tokens (``design.served.sampling_json``): greedy, or seeded draws.
    sampling = sorted({row["sampling"] for row in every_row})
    result = {"reference": reference, "margin_unit": MARGIN_UNIT, "sampling": sampling, "servers": {}}
    for server in servers:
        items = sorted({row["item_id"] for row in rows if row["server"] == server})
        runs = sorted({row["run"] for row in rows if row["server"] == server and row["cell"] == "load"})
        alone = {item: by_cell[(server, item, "alone", 0)] for item in items}
        control_differs = [item for item in items if _differs(by_cell[(server, item, "control", 0)], alone[item])]
        load_counts = {
            item: sum(_differs(by_cell[(server, item, "load", run)], alone[item]) for run in runs) for item in items
        }
        hit_differs = [item for item in items if _differs(by_cell[(server, item, "hit", 0)], alone[item])]
        loads = [by_cell[(server, item, "load", run)] for item in items for run in runs]
        first_load_flip = {
            item: next(
                by_cell[(server, item, "load", run)]
                for run in runs
                if _differs(by_cell[(server, item, "load", run)], alone[item])
            )
            for item in items
            if load_counts[item]
        }
        copies = _runs_by_item(rows, server, "copies")
        distinct = {item: len({tuple(row["tokens"]) for row in rows_of}) for item, rows_of in copies.items()}
        on_slots = _runs_by_item(rows, server, "slot")
        slot_differs = sorted(
            item for item, rows_of in on_slots.items() if any(_differs(row, alone[item]) for row in rows_of)
        )
        replayed = [item for item in items if (server, item, "replay", 0) in by_cell]
        replay = {item: by_cell[(server, item, "replay", 0)] for item in replayed}
        live = {item: _after_boundary(alone[item], replay[item]) for item in replayed}
        replay_differs = [item for item in replayed if _differs(replay[item], live[item])]
        entry = {
            "items": len(items),
            "record": json.loads(records[server]),
            "control_identical": len(items) - len(control_differs),
            "control_differs_items": control_differs,
            "load_runs": len(runs),
            "load_every_run": sorted(item for item, count in load_counts.items() if count == len(runs) and runs),
            "load_some_runs": sorted(item for item, count in load_counts.items() if 0 < count < len(runs)),
            "load_margins": _margins([(alone[item], row) for item, row in first_load_flip.items()]),
            "hit_differs_items": hit_differs,
            "hit_margins": _margins([(alone[item], by_cell[(server, item, "hit", 0)]) for item in hit_differs]),
            "hit_reused_median": statistics.median(by_cell[(server, item, "hit", 0)]["reused"] for item in items)
            if items
            else None,
            "copies_items": len(distinct),
            "copies_per_item": max((len(rows_of) for rows_of in copies.values()), default=0),
            "copies_differ_items": sorted(item for item, count in distinct.items() if count > 1),
            "copies_most_distinct": max(distinct.values(), default=0),
            "copies_differ_from_alone_items": sorted(
                item for item in distinct if any(_differs(row, alone[item]) for row in copies[item])
            ),
            "replay_items": len(replayed),
            "replay_boundary": sorted({_boundary(alone[item], replay[item]) for item in replayed}),
            "replay_control_identical": sum(
                not _differs(by_cell[(server, item, "replay_control", 0)], replay[item]) for item in replayed
            ),
            "replay_differs_items": replay_differs,
            "replay_margins": _margins([(live[item], replay[item]) for item in replay_differs]),
            "tokens_per_second_alone": _rate([alone[item] for item in items]),
            "tokens_per_second_load": _rate(loads),
            "tokens_per_second_all_clients": _all_clients_rate(loads),
        }
        if on_slots:  # a design without the slot cell keeps the summary it had
            entry.update(
                {
                    "slot_items": len(on_slots),
                    "slots_per_item": max(len(rows_of) for rows_of in on_slots.values()),
                    "slot_differs_items": slot_differs,
                    "slot_differing": sorted(
                        {row["run"] for item in slot_differs for row in on_slots[item] if _differs(row, alone[item])}
                    ),
                    "slot_margins": _margins(
                        [
                            (alone[item], next(row for row in on_slots[item] if _differs(row, alone[item])))
                            for item in slot_differs
                        ]
                    ),
                }
            )
        offsets = sorted({row["run"] for row in rows if (row["server"], row["cell"]) == (server, "offset")})
        if offsets:  # the same: only where the design has the cell
            behind = {
                offset: [item for item in items if (server, item, "offset", offset) in by_cell] for offset in offsets
            }
            entry["offset_items"] = {str(offset): len(behind[offset]) for offset in offsets}
            entry["offset_differs_items"] = {
                str(offset): [
                    item for item in behind[offset] if _differs(by_cell[(server, item, "offset", offset)], alone[item])
                ]
                for offset in offsets
            }
        if server != reference:
            reference_alone = {
                item: by_cell[(reference, item, "alone", 0)]
                for item in items
                if (reference, item, "alone", 0) in by_cell
            }
            flips = [item for item in reference_alone if _differs(alone[item], reference_alone[item])]
            entry["vs_reference_items"] = len(reference_alone)
            entry["vs_reference_differs_items"] = flips
            entry["vs_reference_margins"] = _margins([(reference_alone[item], alone[item]) for item in flips])
        total_slots = entry["record"].get("total_slots")
        batteries, controls = {}, {}
        for client in CLIENTS:
            mine = client_rows([row for row in every_row if row["server"] == server], client)
            if not mine:
                continue
            client_alone = {row["item_id"]: row for row in mine if row["cell"] == "alone"}
            controls[client] = (client_alone, {row["item_id"]: row for row in mine if row["cell"] == "control"})
            batteries[client] = {
                pattern: counts
                for pattern in PATTERNS
                if (counts := pattern_counts(mine, client_alone, pattern, total_slots, client)) is not None
            }
        entry["battery"] = batteries
        entry["verdict"] = verdict(batteries, controls, len(items))
        result["servers"][server] = entry
    return result


def _runs_by_item(rows: list[dict], server: str, cell: str) -> dict[str, list[dict]]:
    """Each item's rows of one cell of ``server`` (its runs: copies, slots), in one pass over the rows."""
    runs: dict[str, list[dict]] = {}
    for row in rows:
        if row["server"] == server and row["cell"] == cell:
            runs.setdefault(row["item_id"], []).append(row)
    return runs


def _boundary(alone: dict, replay: dict) -> int:
    """The answer tokens a replay's prompt ends with: the prompt positions the server was sent for the replay less
    those it was sent for the item alone (each the positions it computed plus those it took from its cache)."""
    return (replay["decoded"] + replay["reused"]) - (alone["decoded"] + alone["reused"])


def _after_boundary(alone: dict, replay: dict) -> dict:
    """The answer alone after the replay's boundary: the live decoder's continuation the replay is compared with."""
    boundary = _boundary(alone, replay)
    return {"tokens": list(alone["tokens"])[boundary:], "margins": list(alone["margins"])[boundary:]}


def _differs(a: dict, b: dict) -> bool:
    return first_divergence(list(a["tokens"]), list(b["tokens"])) is not None


def _margins(pairs: list[tuple[dict, dict]]) -> dict:
    """At each pair's first divergent step: the margin of the first (the answer it is compared with) and of the
    second, in logits; the medians and the count of flips where both answers have a margin there."""
    at_flip = []
    for base, served in pairs:
        step = first_divergence(list(served["tokens"]), list(base["tokens"]))
        if step is not None and step < len(base["margins"]) and step < len(served["margins"]):
            at_flip.append((float(base["margins"][step]), float(served["margins"][step])))
    if not at_flip:
        return {"flips": 0, "base_median": None, "served_median": None}
    return {
        "flips": len(at_flip),
        "base_median": statistics.median(base for base, _ in at_flip),
        "served_median": statistics.median(served for _, served in at_flip),
    }


def _rate(rows: list[dict]) -> float | None:
    seconds = sum(row["seconds"] for row in rows)
    return sum(len(row["tokens"]) for row in rows) / seconds if seconds > 0 else None


def _all_clients_rate(loads: list[dict]) -> float | None:
    """The server's throughput amid load, what an operator pays for a flag: every client's tokens (the item's and
    the other clients') over the span from the first arrival to the last answer, summed over the runs."""
    tokens = seconds = 0.0
    for row in loads:
        tokens += len(row["tokens"]) + sum(row["others_generated"])
        ends = [row["seconds"], *(at + took for at, took in zip(row["arrivals"], row["others_seconds"]))]
        seconds += max(ends) - min([0.0, *row["arrivals"]])
    return tokens / seconds if seconds > 0 else None
