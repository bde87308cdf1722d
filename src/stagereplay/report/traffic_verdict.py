"""Does a server keep a greedy answer independent of other traffic? One verdict per server, from its served rows.

The battery's patterns, each counted against the item's answer alone on the same server:

- ``together``: the item's prompt sent at the same instant as other clients' prompts of other lengths;
- ``together_copies``: the same with copies of its own prompt;
- ``amid``: the item's request amid other clients' on a seeded schedule (the served table's ``load`` runs);
- ``copies``: copies of its prompt at once, each copy compared with the answer alone;
- ``hit``: a prompt-cache hit after other clients' requests; ``slot`` and ``offset``: where other traffic leaves
  the item's cells (where the design asks for them).

A pattern of several clients at once counts only the runs whose trigger the server's batch log proves ("met");
runs whose trigger did not happen ("not met") or could not be proven are counted apart, never as "no change". On a
server with one slot, requests wait their turn: the patterns of several clients at once cannot occur there (its
``/props``: ``total_slots`` 1), and do not fail its verdict. The pinned patterns (``hit``, ``slot``, ``offset``) are
applied by the client itself: every run counts.

The verdict is either "independent of other traffic" over N items x the patterns shown x R runs, with the one-sided
95% upper bound on the share of items that would change (Clopper-Pearson), or the first counterexample: item,
pattern, client, run, first divergent step, and the margins there. A pattern that could occur but whose trigger was
never met is "not shown", and so is a server's verdict while one is. The A/A control comes first: a server whose
answer alone is not repeatable is not deterministic alone, whatever the traffic. No torch.
"""

from __future__ import annotations

from stagereplay.design.divergence import first_divergence
from stagereplay.report.stats import upper_bound

# Pattern -> the served table's cell, in the order a counterexample is looked for.
PATTERNS = {
    "together": "together",
    "together_copies": "together_copies",
    "amid": "load",
    "copies": "copies",
    "hit": "hit",
    "slot": "slot",
    "offset": "offset",
}
AT_ONCE = ("together", "together_copies", "amid", "copies")
# pinned: token ids on /completion, prompt reuse off but for the hit; default: an OpenAI-style client (chat messages,
# the server's prompt cache as it defaults, no slot). The verdict looks at them in this order.
CLIENTS = ("pinned", "default")

INDEPENDENT = "independent of other traffic"
NOT_SHOWN = "not shown"
NOT_INDEPENDENT = "changes answers"


def _trigger(row: dict, pattern: str) -> str:
    """met, not met or not proven; a pinned pattern's request is what its client sent: met."""
    if pattern not in AT_ONCE:
        return "met"
    found = row.get("trigger") or ""
    for state in ("not met", "not proven", "met"):
        if found.startswith(state):
            return state
    return "not proven"


def pattern_counts(
    rows: list[dict], alone: dict[str, dict], pattern: str, total_slots: int | None, client: str = "pinned"
) -> dict | None:
    """One pattern's runs on one server by one client (``rows``: that client's): how many met their trigger, and the
    items whose answer differs from alone, among the runs that met it and among the rest. None where the design did
    not send it."""
    cell = PATTERNS[pattern]
    mine = [row for row in rows if row["cell"] == cell and row["item_id"] in alone]
    if not mine:
        return None
    counted = {"met": 0, "not met": 0, "not proven": 0}
    differs_met, differs_other, first = set(), set(), None
    for row in sorted(mine, key=lambda row: (row["item_id"], row["run"])):
        state = _trigger(row, pattern)
        counted[state] += 1
        step = first_divergence(list(row["tokens"]), list(alone[row["item_id"]]["tokens"]))
        if step is None:
            continue
        if state == "met":
            differs_met.add(row["item_id"])
            if first is None:
                first = _counterexample(row, alone[row["item_id"]], pattern, client, step)
        else:
            differs_other.add(row["item_id"])
    cannot = pattern in AT_ONCE and total_slots == 1
    return {
        "items": len({row["item_id"] for row in mine}),
        "runs": len(mine),
        "met": counted["met"],
        "not_met": counted["not met"],
        "not_proven": counted["not proven"],
        "differs_met_items": sorted(differs_met),
        "differs_trigger_not_met_items": sorted(differs_other),
        "cannot_occur": "the server has 1 slot (its /props: total_slots 1): requests wait their turn"
        if cannot
        else None,
        "counterexample": None if cannot else first,
    }


def _counterexample(row: dict, alone: dict, pattern: str, client: str, step: int) -> dict:
    def at(values) -> float | None:
        return float(values[step]) if step < len(values) else None

    return {
        "item": row["item_id"],
        "pattern": pattern,
        "client": client,
        "run": row["run"],
        "step": step,
        "margin_alone": at(alone["margins"]),
        "margin_pattern": at(row["margins"]),
    }


def client_rows(rows: list[dict], client: str) -> list[dict]:
    """One client's rows (a table written before the client column: every row is the pinned client's)."""
    return [row for row in rows if (row.get("client") or "pinned") == client]


def verdict(batteries: dict[str, dict], controls: dict[str, tuple[dict, dict]], items: int) -> dict:
    """The server's verdict from each client's patterns' counts (``batteries``: client -> pattern -> counts), each
    client's A/A control (``controls``: client -> (alone, control), each item -> its row), and its item count."""
    for client, (alone, control) in controls.items():
        for item in sorted(alone):
            step = first_divergence(list(control[item]["tokens"]), list(alone[item]["tokens"]))
            if step is not None:
                first = _counterexample({**control[item], "run": 0}, alone[item], "control", client, step)
                return {"verdict": "not deterministic alone", "counterexample": first}
    for battery in batteries.values():
        for counts in battery.values():
            if counts["counterexample"] is not None:
                return {"verdict": NOT_INDEPENDENT, "counterexample": counts["counterexample"]}

    def patterns(keep) -> list[str]:
        return sorted(
            {pattern for battery in batteries.values() for pattern, counts in battery.items() if keep(counts)},
            key=list(PATTERNS).index,
        )

    shown = patterns(lambda counts: counts["cannot_occur"] is None and counts["met"])
    # A pattern no client ever saw happen, where it could.
    not_shown = [pattern for pattern in patterns(lambda counts: counts["cannot_occur"] is None) if pattern not in shown]
    every = [counts for battery in batteries.values() for counts in battery.values()]
    runs = max((counts["runs"] // max(counts["items"], 1) for counts in every), default=0)
    result = {
        "verdict": NOT_SHOWN if not_shown or not shown else INDEPENDENT,
        "items": items,
        "clients": list(batteries),
        "patterns": shown,
        "not_shown": not_shown,
        "cannot_occur": patterns(lambda counts: counts["cannot_occur"]),
        "runs": runs,
    }
    if items and shown:
        result["upper_bound_95"] = upper_bound(0, items)
    return result


def verdict_line(entry: dict) -> str:
    """The verdict in words, for the card and the findings."""
    found = entry["verdict"]
    example = found.get("counterexample")
    if example is not None:
        margins = f"margin alone {_number(example['margin_alone'])}, {_number(example['margin_pattern'])} there"
        return (
            f"{found['verdict']}: item {example['item']}, {example['pattern']} ({example['client']} client), run"
            f" {example['run']}, first divergent step {example['step']} ({margins})"
        )
    patterns = ", ".join(found["patterns"]) or "none"
    text = f"{found['verdict']}: {found['items']} items × {len(found['patterns'])} patterns ({patterns})"
    text += f" × {len(found['clients'])} client{'s' * (len(found['clients']) != 1)} ({', '.join(found['clients'])})"
    if found["runs"] > 1:
        text += f" × up to {found['runs']} runs"
    if "upper_bound_95" in found:
        text += f"; one-sided 95% bound on the share of items that would change: {found['upper_bound_95']:.0%}"
    if found["not_shown"]:
        text += f"; trigger never met: {', '.join(found['not_shown'])}"
    if found["cannot_occur"]:
        text += f"; cannot occur with 1 slot: {', '.join(found['cannot_occur'])}"
    return text


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"
