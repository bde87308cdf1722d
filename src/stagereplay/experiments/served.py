"""Served requests: does another client's traffic, or a prompt-cache hit, change a greedy answer on a server as it
is deployed? An operator's question, asked per item of each server the config's ``served`` block lists.

The servers are the serving engine's (``registry.serving_spec``: llama-server), each deployed by the workflow
with an operator's flags or attached at its URL; the engine's server module sends the requests
(``serve``: per item, ``alone`` twice, amid other clients ``load_runs`` times, and as a prompt-cache hit) and says
what the server was. This module reads the item's prompt tokens from the primary checkpoint's prompts table, and
writes one row per (server, item, cell, run) (``ledger.tables.SERVED_SCHEMA``) atomically. The figures are
``report.served_summary``'s. No torch here.
"""

from __future__ import annotations

import collections
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from stagereplay.design.served import sampling_json
from stagereplay.engines.registry import serving_spec
from stagereplay.inputs.items import items_after, load_items
from stagereplay.inputs.messages import build_messages
from stagereplay.ledger.tables import PROMPT_SCHEMA, SERVED_SCHEMA, read_table, read_vocabulary, write_table


@dataclass(frozen=True)
class ServedDesign:
    tokens: int  # greedy tokens per request
    clients: int  # other clients amid which the item is served
    seed: int  # the load schedule's seed
    load_runs: int  # schedules per item
    boundary: int  # the stage boundary: answer tokens a replay sends back as its prompt's end (E1 on the server)
    each_slot: bool = False  # the request alone on each slot in turn (cell ``slot``, run: the slot)
    kv_offsets: tuple[int, ...] = ()  # the request alone behind another slot's C idle cells (cell ``offset``, run: C)
    send_as: tuple[str, ...] = ("pinned",)  # the clients that send every cell: pinned, default (an OpenAI client)
    # How each token is picked: {} or temperature 0 is greedy; else temperature, seed, and top_k / top_p where given.
    sampling: dict = field(default_factory=dict)


def run_served(
    model_record: dict,
    prompts_path: str | Path,
    server_name: str,
    entry: dict,
    design: ServedDesign,
    out_path,
    recorded_table: str | Path | None = None,
    vocab_path: str | Path | None = None,
    items_path: str | Path | None = None,
) -> Path:
    """Serve every item of the prompts table on the server ``entry`` describes and write its rows.
    ``recorded_table`` (the audit's): the saved table of this server, whose record the server must still match.
    ``vocab_path``: the checkpoint's vocabulary table, whose spellings an attached server's must match where its
    model file is not readable here. ``items_path``: the run's items, whose chat messages the default client sends."""
    prompts = {
        row["item_id"]: list(row["prompt_tokens"]) for row in read_table(prompts_path, PROMPT_SCHEMA).to_pylist()
    }
    order = sorted(prompts)
    # The other clients of an item: the items after it, by id, wrapping round (a fixed function of the item list).
    others = {item: list(itertools.islice(items_after(order, item), design.clients)) for item in order}
    done = collections.Counter()

    def on_item(cells: str) -> None:
        """One line per item and phase of the job: its pinned cells run first, for every item, then the rest."""
        done[cells] += 1
        print(f"served {server_name}: {cells} {done[cells]}/{len(order)} items", file=sys.stderr, flush=True)

    recorded = None
    if recorded_table is not None:
        rows = read_table(recorded_table, SERVED_SCHEMA).to_pylist()
        recorded = json.loads(rows[0]["server_record"]) if rows else None
    spellings = None
    if vocab_path is not None:
        spellings = read_vocabulary(vocab_path)
    messages = None
    if "default" in design.send_as:
        if items_path is None:
            raise ValueError("served: the default client needs the run's items (--items) for its chat messages")
        by_id = {item.item_id: item for item in load_items(items_path)}
        messages = {item_id: build_messages(by_id[item_id]) for item_id in order}
    protocol = serving_spec().server_protocol()
    answers, record = protocol.serve(
        model_record, prompts, others, server_name, entry, design, on_item, recorded, spellings, messages
    )
    rows = served_rows(server_name, answers, record, model_record["fingerprint"], sampling_json(design.sampling))
    return write_table(rows, SERVED_SCHEMA, out_path)


def served_rows(server_name: str, answers, server_record: dict, model_fingerprint: str, sampling: str) -> list[dict]:
    """The served table's rows: one per (item, cell, client, run, answer) of ``answers``, each with the requests'
    ``sampling`` (``design.served.sampling_json``)."""
    record = json.dumps(server_record, sort_keys=True)
    return [
        {
            "server": server_name,
            "item_id": item_id,
            "cell": cell,
            "client": client,
            "run": run,
            "tokens": answer.tokens,
            "margins": answer.margins,
            "reused": answer.reused,
            "decoded": answer.decoded,
            "seconds": answer.seconds,
            "others": answer.others,
            "arrivals": answer.arrivals,
            "others_generated": answer.others_generated,
            "others_seconds": answer.others_seconds,
            "slot": answer.slot,
            "trigger": answer.trigger,
            "sampling": sampling,
            "server_record": record,
            "model_fingerprint": model_fingerprint,
        }
        for item_id, cell, client, run, answer in answers
    ]
