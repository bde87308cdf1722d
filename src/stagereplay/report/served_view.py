"""The card's table of served requests (summary.json's ``served``): per server, what changed a greedy answer.

An operator's table: each server as it was started (or the URL it was attached at), the A/A control, the items
replayed from the stage boundary whose continuation differs from the answer alone's (E1 on the server), the items
whose answer amid other clients differs from their answer alone (in every run, or in some only: unstable under
load), the margins at the flip, the items whose copies sent at once came back with an answer other than the one
alone (and those with more than one answer among the copies), those
whose answer alone on another slot differs, the prompt-cache hits that differ, each server's own flags against the
reference server, the tokens per second a client saw alone and amid load, and the server's amid load (all clients').
No torch.
"""

from __future__ import annotations

from stagereplay.design.served import GREEDY_JSON
from stagereplay.report.traffic_verdict import verdict_line

COLUMNS = [
    "server",
    "as",
    "slots",
    "alone twice: identical",
    "replayed from the stage boundary: differs (replay twice: identical)",
    "margin at the flip, alone / replayed",
    "amid load: differs in all R runs / in some of R runs (R: the runs)",
    "margin at the flip, alone / amid load",
    "the same request at once: differs from alone (items with more than one answer; most distinct)",
    "alone on each slot: differs (slots that did)",
    "alone behind another slot's C cells: differs, per C",
    "prompt-cache hit: differs",
    "positions reused (median)",
    "alone, against the reference server's: differs",
    "tokens/s alone / amid load: the item's, all clients'",
]


VERDICT_COLUMNS = [
    "server",
    "as",
    "verdict",
    "together: met / runs, differ",
    "together_copies: met / runs, differ",
    "tokens/s amid load, all clients'",
]


def verdict_blocks(summary: dict) -> list[tuple]:
    """The operator's answer, first on the card: per server, whether its greedy answers are independent of other
    traffic (``report.traffic_verdict``)."""
    served = summary.get("served")
    if not served or not served.get("servers"):
        return []
    rows = []
    for name, entry in served["servers"].items():
        if "verdict" not in entry:  # a summary written before the battery
            continue
        record = entry["record"]
        rows.append(
            [
                name,
                record.get("started") or f"attached at {record.get('attached')}",
                verdict_line(entry),
                _together(entry, "together"),
                _together(entry, "together_copies"),
                _rate(entry["tokens_per_second_all_clients"]),
            ]
        )
    if not rows:
        return []
    sampled = [text for text in served.get("sampling", [GREEDY_JSON]) if text != GREEDY_JSON]
    answer = "a seeded sampled answer" if sampled else "a greedy answer"
    how = (
        f" The requests were sampled ({'; '.join(sampled)}): each answer is the server's draw with that seed."
        if sampled
        else ""
    )
    return [
        ("heading", 2, f"Which server keeps {answer} independent of other traffic"),
        (
            "paragraph",
            "Each item's answer under each traffic pattern against its answer alone on the same server. A pattern of"
            " several clients at once counts only the runs whose trigger the server's own batch log proves (met);"
            " the rest are counted apart. The first counterexample is named; with none, the bound is on the share of"
            f" items that would change. Details: the served table below.{how}",
        ),
        ("table", VERDICT_COLUMNS, rows),
    ]


def _together(entry: dict, pattern: str) -> str:
    """Per client: the runs whose trigger the log proves, of all, and the items that differ in those (and in the
    rest, apart)."""
    cells = []
    for client, battery in entry["battery"].items():
        counts = battery.get(pattern)
        if counts is None:
            continue
        if counts["cannot_occur"]:
            cells.append(f"{client}: cannot occur (1 slot)")
            continue
        differ = f"{len(counts['differs_met_items'])}/{counts['items']}"
        unmet = counts["differs_trigger_not_met_items"]
        cells.append(
            f"{client}: {counts['met']}/{counts['runs']}, {differ}" + (f" (+{len(unmet)} not met)" if unmet else "")
        )
    return "; ".join(cells) or "—"


def served_blocks(summary: dict) -> list[tuple]:
    served = summary.get("served")
    if not served or not served.get("servers"):
        return []
    rows = [_row(name, entry, name == served["reference"]) for name, entry in served["servers"].items()]
    listed = [
        f"`{name}`: amid load in all {entry['load_runs']} runs {_items(entry['load_every_run'])}; in some of"
        f" {entry['load_runs']} runs"
        f" {_items(entry['load_some_runs'])}; prompt-cache hit {_items(entry['hit_differs_items'])}"
        + (
            f"; against the reference {_items(entry['vs_reference_differs_items'])}"
            if "vs_reference_differs_items" in entry
            else ""
        )
        + (f"; replayed {_items(entry['replay_differs_items'])}" if "replay_differs_items" in entry else "")
        + (
            f"; copies at once {_items(entry['copies_differ_from_alone_items'])}"
            if "copies_differ_from_alone_items" in entry
            else ""
        )
        + (f"; on another slot {_items(entry['slot_differs_items'])}" if entry.get("slot_items") else "")
        + "".join(
            f"; behind {offset} cells {_items(differ)}"
            for offset, differ in entry.get("offset_differs_items", {}).items()
        )
        for name, entry in served["servers"].items()
    ]
    listed += [
        f"`{name}`, its model: {entry['record']['model_check']}"
        for name, entry in served["servers"].items()
        if entry["record"].get("model_check")
    ]
    return [
        ("heading", 2, "Served requests: what changes a greedy answer on the server as started"),
        (
            "paragraph",
            f"Each item's prompt sent as a whole greedy request (up to the token budget or an end-of-generation token) to each server: alone"
            f" (twice: the A/A control); replayed (E1 on the server: the prompt and the answer's tokens up to the"
            f" stage boundary sent as a new prompt, without prompt reuse, its continuation against the answer"
            f" alone's after the boundary; twice, its A/A control); amid other clients' requests on a seeded"
            f" schedule (each run its own); sent several times at the same instant (copies, one client each); alone"
            f" on each slot in turn and alone behind another slot's C idle cells, where the run asks for them; and"
            f" as a prompt-cache hit. Counted against the item's answer alone on the same server; the first server,"
            f" `{served['reference']}`, is the reference for the others' own flags. R runs amid load bound the spread"
            f" from below: an item unchanged in all R runs may change in a further one. Margins are in"
            f" {served['margin_unit']}, medians over the flips.",
        ),
        ("table", COLUMNS, rows),
        ("bullets", listed),
    ]


def _row(name: str, entry: dict, reference: bool) -> list[str]:
    record = entry["record"]
    how = record.get("started") or f"attached at {record.get('attached')}"
    if "attached" in record and record.get("model_file_xxh3") is None:
        how += " (weights not hashed)"
    slots = record.get("total_slots")
    if "attached" in record:
        slots = f"{record['total_slots']} (used: {', '.join(map(str, record['slots']))})"
    n = entry["items"]
    load = f"{len(entry['load_every_run'])}/{n} / {len(entry['load_some_runs'])}/{n} ({entry['load_runs']} runs)"
    against = "reference" if reference else f"{len(entry['vs_reference_differs_items'])}/{entry['vs_reference_items']}"
    return [
        name,
        how,
        str(slots),
        f"{entry['control_identical']}/{n}",
        _replayed(entry),
        _margins(entry["replay_margins"]) if "replay_margins" in entry else "—",
        load,
        _margins(entry["load_margins"]),
        _copies(entry),
        _on_slots(entry),
        _behind(entry),
        f"{len(entry['hit_differs_items'])}/{n}",
        "—" if entry["hit_reused_median"] is None else f"{entry['hit_reused_median']:g}",
        against,
        f"{_rate(entry['tokens_per_second_alone'])} / {_rate(entry['tokens_per_second_load'])},"
        f" {_rate(entry['tokens_per_second_all_clients'])}",
    ]


def _copies(entry: dict) -> str:
    """Copies that agree with each other but not with the answer alone differ: counted against alone first."""
    if not entry.get("copies_items"):
        return "—"
    n = entry["copies_items"]
    return (
        f"{len(entry['copies_differ_from_alone_items'])}/{n} ({len(entry['copies_differ_items'])}/{n};"
        f" {entry['copies_most_distinct']} of {entry['copies_per_item']} copies)"
    )


def _on_slots(entry: dict) -> str:
    if not entry.get("slot_items"):
        return "—"
    differing = ", ".join(map(str, entry["slot_differing"])) or "none"
    flips = entry["slot_margins"]
    margins = f"; margin alone / on the slot {_margins(flips)}" if flips["flips"] else ""
    return f"{len(entry['slot_differs_items'])}/{entry['slot_items']} (slots {differing}{margins})"


def _behind(entry: dict) -> str:
    if not entry.get("offset_items"):
        return "—"
    return ", ".join(
        f"C={offset}: {len(entry['offset_differs_items'][offset])}/{count}"
        for offset, count in entry["offset_items"].items()
    )


def _replayed(entry: dict) -> str:
    if not entry.get("replay_items"):
        return "— (no answer passed the stage boundary)" if "replay_items" in entry else "—"
    boundary = ", ".join(map(str, entry["replay_boundary"]))
    return (
        f"{len(entry['replay_differs_items'])}/{entry['replay_items']} ({entry['replay_control_identical']}/"
        f"{entry['replay_items']}; boundary {boundary} tokens)"
    )


def _margins(margins: dict) -> str:
    if not margins["flips"]:
        return "—"
    return f"{margins['base_median']:.3g} / {margins['served_median']:.3g} ({margins['flips']} flips)"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _items(items: list[str]) -> str:
    return ", ".join(f"`{item}`" for item in items) if items else "none"
