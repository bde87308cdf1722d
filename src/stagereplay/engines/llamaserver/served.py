"""Whole requests to a llama-server as a client sends them: the engine's side of the config's ``served`` block
(``experiments.served``) and of ``stagereplay probe``.

A server is either **deployed** (the workflow starts ``llama-server -m MODEL`` with the server's own defaults and
an operator's flags: ``deployed.DeployedServer``) or **attached** (someone else's, at its URL: never started,
restarted or stopped: ``attached.AttachedServer``). On each, per item, whole greedy requests of the item's prompt
tokens (``serve_items``):

- ``alone``: sent while nothing else is in flight, without prompt reuse; ``control``: the same again, which must
  give the same tokens (the A/A control: it exercises the request path, the slot the server picks and its cache
  being rewritten, not other clients);
- ``load``: amid other clients, each sending one other item (which: the design's, ``experiments.served``),
  their arrivals drawn from a seeded schedule around the item's
  (``traffic.amid_clients``), ``load_runs`` times, each with its own schedule;
- ``hit``: the item with prompt reuse, then two other items, then the item again with prompt reuse: the server
  takes its prompt from a slot or its host prompt cache (``reused`` positions);
- ``copies``: the same request 1 + ``clients`` times at the same instant, each by a client of its own (``run``:
  the copy), so the server places the copies on its slots side by side;
- ``replay`` (E1 on the server): the prompt and the first ``boundary`` tokens of the answer alone (the stage
  boundary), sent as a new prompt without prompt reuse, so the server prefills the prefix its decoder reached and
  continues it; ``replay_control``: the same again. Its tokens are compared with the answer alone's after the
  boundary. An item whose answer alone ends within the first stage has no replay;
- ``slot`` (``design.each_slot``): the request alone, without prompt reuse, on each slot the run may use in turn
  (``run``: the slot; a deployed server's every slot, an attached one's listed slots). Does the slot a request
  lands on change its answer (upstream's "FIXME: the result is not deterministic when using other slot than slot
  0")? On a unified cache, a slot's cells follow those the other slots still hold;
- ``offset`` (``design.kv_offsets``): E6's ``kv_offset`` as served requests (``behind_filler``): the item alone on its
  slot while another slot holds C cells, idle (``run``: C).
- ``together`` and ``together_copies`` (``load_runs`` runs each): the item's prompt released at the same instant as the
  other clients' prompts, or as copies of its own, each run's trigger (its prompt prefilled in one decode call with
  another) proven from the server's batch log (``traffic.trigger``).

Each cell is sent by the clients of ``design.send_as``: ``pinned`` (the token ids above) and ``default`` (chat
messages as an OpenAI-compatible client sends them, ``default_cells``), each compared with its own answer alone.

Every item's alone, control, replays and hit are served first, then each item on each slot and behind each filler, one request at a time, and the runs amid other
clients and the copies at once after them all: what a request computes depends on where the server places its cache cells, which depends on
everything served before; a run amid others leaves them as its timing placed them, so nothing pinned follows one
(the audit reproduces the pinned cells exactly).

A deployed server is recorded from itself: ``/props`` and its startup log; an attached one from ``/props``,
``/v1/models`` and its model: the file's bytes where it is readable here, else its metadata and its spelling of
the prompts' token ids (``model_check``), which must be the checkpoint's GGUF's; and it must say the same of itself
at the end of the job (a restart under the run is one line). No torch here.
"""

from __future__ import annotations

import contextlib
import random
import sys
import tempfile

from stagereplay.engines.llamaserver.attached import AttachedServer, api_key_from
from stagereplay.engines.llamaserver.build import LlamaServerError, server_build
from stagereplay.engines.llamaserver.client import GREEDY_SAMPLING, Sampling, ServerClient
from stagereplay.engines.llamaserver.deployed import RESERVED_FLAGS, DeployedServer
from stagereplay.engines.llamaserver.model_check import check_model
from stagereplay.engines.llamaserver.process import BATCH_LOG_ENVIRONMENT
from stagereplay.engines.llamaserver.traffic import Answer, DefaultClient, PinnedClient, amid_clients, ask, at_once

HIT_OTHERS = 2  # other items sent between the item's two requests of a prompt-cache hit
# Flash attention where no -fa is given: auto, resolved at start; neither the default log nor /props says to what.
FLASH_ATTN_AUTO = "auto (resolved at start; not in the default log or /props)"


def check_server(name: str, entry: dict, served: dict) -> str | None:
    """Why a ``served.servers`` entry cannot run the ``served`` block's design (one line, with the fix), None if it
    can; no request is sent."""
    where = f"served.servers.{name}"
    clients = served["clients"]
    if "url" in entry:
        if "flags" in entry:
            return f"{where}: a server at a url runs with its own flags — give url (attached) or flags (deployed), not both"
        try:
            AttachedServer(entry["url"], slots=tuple(entry.get("slots", (0,))))
        except LlamaServerError as error:
            return f"{where}.url: {error}"
        if clients and len(entry.get("slots", (0,))) < 2:
            return (
                f"{where}.slots: {clients} other clients need a slot besides the item's — list 2 or more slots of"
                " the server that are yours to use, or set served.clients: 0"
            )
        if served.get("kv_offsets") and len(entry.get("slots", (0,))) < 2:
            return (
                f"{where}.slots: served.kv_offsets needs a second slot to hold the filler — list 2 or more slots of"
                " the server that are yours to use, or remove served.kv_offsets"
            )
        return None
    if "slots" in entry or "api_key_env" in entry:
        return f"{where}: slots and api_key_env belong to an attached server — give its url, or remove them"
    taken = [flag for flag in entry.get("flags", ()) if flag in RESERVED_FLAGS]
    if taken:
        return f"{where}.flags: {', '.join(taken)} is set by stagereplay itself (the model, a loopback address) — remove it"
    return None


def serve(
    model_record: dict,
    prompts,
    others,
    name: str,
    entry: dict,
    design,
    on_item,
    recorded: dict | None = None,
    spellings: dict[int, str] | None = None,
    messages: dict[str, list[dict]] | None = None,
):
    """Serve each item of ``others`` (item -> the other clients' items, in the design's order) on the server of
    ``entry``: (item, cell, client, run, answer) for each request, and the server's record. ``recorded`` (the
    audit's): the record the ledger holds for it; an attached server that says something else of itself is refused
    before any request is served. ``spellings``: the checkpoint's token id -> text, checked against an attached
    server's where its model file is not readable here (``model_check``). ``messages``: each item's chat messages,
    which the default client sends."""
    if "url" in entry:
        return _on_attached(
            model_record, prompts, others, name, entry, design, on_item, recorded, spellings or {}, messages
        )
    return _on_deployed(model_record, prompts, others, name, entry, design, on_item, messages)


def _default_client_prompts(server: ServerClient, name: str, prompts: dict, messages: dict | None) -> dict:
    """The record's line on the default client's prompts (checked once per item before any of its requests); the
    line is printed too where they differ."""
    if messages is None:
        return {}
    line = chat_prompts_check(server, prompts, messages)
    if "other tokens" in line:
        print(f"served {name}: {line}", file=sys.stderr, flush=True)
    return {"default_client_prompts": line}


def serve_items(server: ServerClient, prompts, others_of, design, on_item, slots=None, messages=None) -> list[tuple]:
    """(item, cell, client, run, answer) for every item of ``others_of`` on ``server``, sent by each client of
    ``design.send_as`` in turn: the pinned client's cells (``pinned_cells``), then the default client's
    (``default_cells``: ``messages``, item -> its chat messages). ``slots``: a guest's (the item's requests on the
    first, the other clients' on the rest), None: the server picks, as for any client. ``on_item(cells)`` is called
    as each item's cells of one phase are done (the job's progress lines)."""
    answers = []
    if "pinned" in design.send_as:
        cells = pinned_cells(server, prompts, others_of, design, on_item, slots)
        answers += [(item, cell, "pinned", run, answer) for item, cell, run, answer in cells]
    if "default" in design.send_as:
        cells = default_cells(server, prompts, others_of, design, on_item, messages)
        answers += [(item, cell, "default", run, answer) for item, cell, run, answer in cells]
    return answers


def pinned_cells(server: ServerClient, prompts, others_of, design, on_item, slots=None) -> list[tuple]:
    """(item, cell, run, answer) of the pinned client: token ids on ``/completion``. With ``design.each_slot``, the
    item alone on each slot the run may use, in turn (``usable_slots``).

    The pinned cells of every item come first, one request at a time (alone, control, replay, hit; then slot), then
    every item's runs amid other clients: a server's cache cells are placed by everything it served before, and runs amid
    others leave them placed as their timing decided, so nothing pinned comes after one."""
    own = slots[0] if slots else None
    others_slot = slots[1 % len(slots)] if slots else None
    # The slots the run may use, asked once (a deployed server's from /props): the slot and offset cells' slots.
    usable = sorted(server.usable_slots()) if design.each_slot or design.kv_offsets else []
    sampling = Sampling(**design.sampling)
    answers, latency = [], {}
    for item_id, following in others_of.items():
        prompt = prompts[item_id]
        alone = ask(server, prompt, design.tokens, cache_prompt=False, slot=own, sampling=sampling)
        control = ask(server, prompt, design.tokens, cache_prompt=False, slot=own, sampling=sampling)
        latency[item_id] = alone.seconds
        answers += [(item_id, "alone", 0, alone), (item_id, "control", 0, control)]
        if len(alone.tokens) > design.boundary:
            prefix = prompt + alone.tokens[: design.boundary]
            for cell in ("replay", "replay_control"):
                replayed = ask(
                    server, prefix, design.tokens - design.boundary, cache_prompt=False, slot=own, sampling=sampling
                )
                answers.append((item_id, cell, 0, replayed))
        ask(server, prompt, design.tokens, cache_prompt=True, slot=own, sampling=sampling)
        between = list(following)[:HIT_OTHERS]
        for other in between:
            ask(server, prompts[other], design.tokens, cache_prompt=True, slot=others_slot, sampling=sampling)
        hit = ask(server, prompt, design.tokens, cache_prompt=True, slot=own, sampling=sampling)
        hit.others = between
        answers.append((item_id, "hit", 0, hit))
        on_item("pinned cells")
    # Each slot in turn after every item's other pinned cells, so none of them follows a slot sweep: a request on a
    # slot leaves its cells in place, and on a unified cache the next request may land behind them.
    for item_id in others_of if design.each_slot else ():
        for slot in usable:
            answer = ask(server, prompts[item_id], design.tokens, False, slot=slot, sampling=sampling)
            answers.append((item_id, "slot", slot, answer))
        on_item("each slot")
    for item_id in others_of if design.kv_offsets else ():
        for offset in design.kv_offsets:
            answer = behind_filler(server, usable, prompts, item_id, offset, design.tokens, sampling)
            answers.append((item_id, "offset", offset, answer))
        on_item("behind a filler")
    for item_id, following in others_of.items():
        send = PinnedClient(sampling)
        answers += traffic_cells(server, prompts, item_id, following, design, latency[item_id], slots, send)
        on_item("amid other clients and at once")
    return answers


def chat_prompts_check(server: ServerClient, prompts: dict, messages: dict) -> str:
    """Whether the server turns each item's chat messages into the ledger's prompt tokens (its ``/apply-template``,
    then ``/tokenize`` as its chat endpoint tokenizes: special tokens added and parsed): one line either way, naming
    the first item and position that differ."""
    differ = []
    for item_id in sorted(messages):
        text = server.request("/apply-template", {"messages": messages[item_id]}).get("prompt", "")
        theirs = server.request("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
        ours = list(prompts[item_id])
        if theirs != ours:
            at = next((index for index, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            differ.append(
                f"item {item_id} at position {at}: the server's token"
                f" {theirs[at] if at < len(theirs) else 'none (shorter)'}, the ledger's"
                f" {ours[at] if at < len(ours) else 'none (shorter)'} ({len(theirs)} and {len(ours)} tokens)"
            )
    if not differ:
        return f"the server tokenizes every item's chat messages ({len(messages)}) to the ledger's prompt tokens"
    return (
        f"the server tokenizes {len(differ)}/{len(messages)} items' chat messages to other tokens than the ledger's"
        f" prompt (first: {differ[0]}): the default client's answers are to the server's tokens — check the chat"
        " template the server uses (--chat-template, --jinja) against the GGUF's"
    )


def default_cells(server: ServerClient, prompts, others_of, design, on_item, messages) -> list[tuple]:
    """(item, cell, run, answer) of the default client (``traffic.DefaultClient``): chat messages on
    ``/v1/chat/completions``, the server's prompt cache as it defaults, no slot; ``alone`` (nothing else in flight,
    the cache as the requests before left it), ``control`` (the same again: the same user asking twice), ``hit``
    (again after two other items), then the runs amid others and at once. No replay, slot or offset: a default client
    sends neither token ids nor a slot. The server's tokenization of each item's messages is checked first."""
    client = DefaultClient({tuple(prompts[item]): messages[item] for item in others_of}, Sampling(**design.sampling))
    answers, latency = [], {}
    for item_id, following in others_of.items():
        alone = client(server, prompts[item_id], design.tokens)
        control = client(server, prompts[item_id], design.tokens)
        latency[item_id] = alone.seconds
        answers += [(item_id, "alone", 0, alone), (item_id, "control", 0, control)]
        between = list(following)[:HIT_OTHERS]
        for other in between:
            client(server, prompts[other], design.tokens)
        hit = client(server, prompts[item_id], design.tokens)
        hit.others = between
        answers.append((item_id, "hit", 0, hit))
        on_item("default client: alone, again and after others")
    for item_id, following in others_of.items():
        answers += traffic_cells(server, prompts, item_id, following, design, latency[item_id], None, client)
        on_item("default client: amid other clients and at once")
    return answers


def traffic_cells(server, prompts, item_id, following, design, latency, slots, send) -> list[tuple]:
    """One item's cells of other traffic, sent by ``send``'s client: ``load_runs`` runs amid other clients, copies
    at once, and ``load_runs`` runs each prefilled in one step with others' prompts (``together``) and with copies
    of its own (``together_copies``), each run's trigger proven from the server's batch log."""
    prompt, others = prompts[item_id], {other: prompts[other] for other in following}
    answers = []
    for run in range(design.load_runs):
        rng = random.Random(f"{design.seed}:{item_id}:{run}")
        answers.append(
            (item_id, "load", run, amid_clients(server, prompt, others, design.tokens, latency, rng, slots, send))
        )
    copies = at_once(server, [prompt] * (1 + design.clients), design.tokens, slots, send)
    answers += [(item_id, "copies", copy, answer) for copy, answer in enumerate(copies)]
    for run in range(design.load_runs):
        together = at_once(server, [prompt, *others.values()], design.tokens, slots, send)[0]
        own = at_once(server, [prompt] * (1 + design.clients), design.tokens, slots, send)[0]
        answers += [(item_id, "together", run, together), (item_id, "together_copies", run, own)]
    return answers


def behind_filler(
    server: ServerClient,
    slots: list[int],
    prompts: dict,
    item_id: str,
    offset: int,
    budget: int,
    sampling: Sampling = GREEDY_SAMPLING,
) -> Answer:
    """E6's ``kv_offset`` as served requests: every slot the run may use (``slots``) erased (so the cache's search
    for free cells starts at cell 0 again), a filler of ``offset`` tokens (the prompts after the item's, joined) kept
    by the second of them, idle, and the item alone on the first. In a unified cache the item's cells then follow
    the filler's, where the server keeps an idle slot's cells; a server caching idle slots (its host prompt cache,
    the default) clears them when the item's task starts. Its ``others``: the filler's length, as text."""
    if len(slots) < 2:
        raise LlamaServerError(
            f"served.kv_offsets needs a second slot to hold the filler, and the llama-server at {server.address} has"
            f" {len(slots)} — start it with -np 2 or more, or remove served.kv_offsets"
        )
    own, filler_slot = slots[:2]
    order = sorted(prompts)
    after = order[order.index(item_id) + 1 :] + order[: order.index(item_id)]
    filler = [token for other in after for token in prompts[other]][:offset]
    if len(filler) < offset:
        raise LlamaServerError(f"the other items' prompts hold {len(filler)} tokens, fewer than kv_offsets' {offset}")
    for slot in slots:
        server.erase_slot(slot)
    ask(server, filler, 1, cache_prompt=True, slot=filler_slot)
    answer = ask(server, prompts[item_id], budget, cache_prompt=False, slot=own, sampling=sampling)
    answer.others = [f"{offset} cells on slot {filler_slot}"]
    return answer


def _on_deployed(model_record, prompts, others, name, entry, design, on_item, messages):
    # kv_offsets erases slots, an action the server takes only with a slot folder: a private one, written to by none.
    with contextlib.ExitStack() as stack:
        slot_dir = stack.enter_context(tempfile.TemporaryDirectory()) if design.kv_offsets else None
        server = stack.enter_context(
            DeployedServer(model_record["gguf"], tuple(entry.get("flags") or ()), log_batches=True, slot_dir=slot_dir)
        )
        props = server.props()
        record = {
            "started": "llama-server -m MODEL " + " ".join(server.flags),
            "build_info": props.get("build_info"),
            "build": server_build().describe(),
            "total_slots": props.get("total_slots"),
            "n_ctx_per_slot": props.get("default_generation_settings", {}).get("n_ctx"),
            "startup_log": server.resolved(),
            "flash_attn": _flag_value(server.flags, "-fa", "--flash-attn") or FLASH_ATTN_AUTO,
            # Logging only, the proof of each pattern's trigger: started so besides its flags.
            "batch_log": f"on: --verbose, {' and '.join(f'{key}={value}' for key, value in BATCH_LOG_ENVIRONMENT.items())}"
            " (every decode call's tokens and cells logged)",
        }
        if slot_dir is not None:
            record["slot_actions"] = "on: a private --slot-save-path, for kv_offsets' erasures (no slot file written)"
        record.update(_default_client_prompts(server, name, prompts, messages))
        answers = serve_items(server, prompts, others, design, on_item, messages=messages)
    return answers, record


def _on_attached(model_record, prompts, others, name, entry, design, on_item, recorded, spellings, messages):
    slots = tuple(entry.get("slots", (0,)))
    where = f"served.servers.{name}"
    server = AttachedServer(
        entry["url"], api_key=api_key_from(entry.get("api_key_env"), f"{where}.api_key_env"), slots=slots
    )
    server.health()
    identity = server.record_identity()
    server.check_slots(identity, f"{where}.slots")
    if design.kv_offsets and not server.slot_files_on():
        raise LlamaServerError(
            f"served.kv_offsets erases the run's slots of the llama-server at {server.url}, which takes slot actions"
            " only when started with --slot-save-path — start it so, or remove served.kv_offsets"
        )
    # Every slot listed: the server picks one per request, as for any client and as on a deployed server (the
    # same protocol, so the same flags give the same answers); some only: each request is pinned to one of them.
    pinned = slots if set(slots) != set(range(identity.total_slots)) else None
    record = {
        "attached": server.url,
        "slots": list(slots),
        "slots_pinned": pinned is not None,
        **identity.record(),
    }
    # What the server says of itself first (a server of another model or build is named as such), then its model.
    if recorded is not None:
        _check_recorded(server, record, recorded)
    token_ids = [token for prompt in prompts.values() for token in prompt]
    record.update(check_model(server, identity, model_record["gguf"], spellings, token_ids))
    if recorded is not None:
        _check_recorded(server, record, recorded)
    record.update(_default_client_prompts(server, name, prompts, messages))
    answers = serve_items(server, prompts, others, design, on_item, slots=pinned, messages=messages)
    server.check_unchanged(identity)
    return answers, record


def _changes(now: dict, recorded: dict) -> list[str]:
    """Each field of ``now`` that differs from the ledger's ``recorded``, as "name now (recorded then)"."""
    return [
        f"{key} {value!r} (recorded {recorded.get(key)!r})" for key, value in now.items() if recorded.get(key) != value
    ]


def _check_recorded(server: AttachedServer, record: dict, recorded: dict) -> None:
    """One line if a field of ``record`` (what the server says of itself now) is not what the ledger records (the
    audit's check)."""
    changed = _changes(record, recorded)
    if changed:
        raise LlamaServerError(
            f"the llama-server at {server.url} is not the one the ledger records: {'; '.join(changed)} — audit against"
            " the server the ledger records (the same build, model and flags)"
        )


def attached_still(name: str, entry: dict, record: dict) -> str | None:
    """Why the server ``entry`` attached at is not now the one ``record`` (a ledger's) says it was: nothing answers
    there, or it says something else of itself (one line); None if it is. A status request or three, nothing else.
    ``name``: a served server's name, or the config key of an attached checkpoint ("checkpoints.NAME.attach")."""
    where = name if name.startswith("checkpoints.") else f"served.servers.{name}"
    try:
        server = AttachedServer(entry["url"], api_key=api_key_from(entry.get("api_key_env"), f"{where}.api_key_env"))
        server.health()
        now = server.identity().record()
    except LlamaServerError as error:
        return f"{name}: {error}"
    changed = _changes(now, record)
    if changed:
        return (
            f"{name}: the llama-server at {server.url} is not the one the ledger records: {'; '.join(changed)} — an"
            " audit there would refuse it; attach the ledger's server again, or start a new ledger"
        )
    return None


def _flag_value(flags: tuple[str, ...], *names: str) -> str | None:
    for index, flag in enumerate(flags[:-1]):
        if flag in names:
            return flags[index + 1]
    return None


def probe_text(url: str, slots: tuple[int, ...], api_key_env: str | None, timeout: float) -> str:
    """``stagereplay probe``'s report on the server at ``url``."""
    from stagereplay.engines.llamaserver.probe import probe

    server = AttachedServer(
        url, api_key=api_key_from(api_key_env, "--api-key-env"), slots=slots, request_timeout=timeout
    )
    return probe(server).render()
