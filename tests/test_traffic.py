"""The traffic battery's trigger proof, on a real llama-server as people start it (the tiny GGUF, 4 slots each with a
KV stream of its own): prompts released at once are prefilled in one step, which the server's own batch log shows;
the same prompts sent one after another are not, and the log says so too; a server that keeps no batch log proves
nothing. A served job sampled with a seed records it on every row. Skipped without the built server unless
STAGEREPLAY_REQUIRE_LLAMASERVER=1."""

from __future__ import annotations

import pytest
from test_llamaserver_engine import built  # noqa: F401 - fixture

from stagereplay.engines.llamaserver.deployed import DeployedServer
from stagereplay.engines.llamaserver.traffic import NO_BATCH_LOG, ask, at_once, trigger

BUDGET = 4
BURSTS = 5


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The served tests' random GGUF (no near ties): its answers are whole characters, so the server returns a
    log-probability for every token (it drops those of a token that ends inside a character)."""
    from stagereplay.inputs.checkpoints import build_random_qwen2
    from stagereplay.inputs.tiny_gguf import write_qwen2_gguf

    folder = build_random_qwen2(tmp_path_factory.mktemp("tiny") / "model", seed=2, layers=2, hidden=64)
    return write_qwen2_gguf(folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def streams(built, tiny_gguf):  # noqa: F811
    with DeployedServer(tiny_gguf, ("-np", "4", "--no-kv-unified"), log_batches=True) as server:
        yield server


@pytest.fixture(scope="module")
def items(tiny_gguf):
    """The first three items' chat messages and prompt tokens (of three lengths), as the prompts job makes them."""
    return _items_and_prompts(tiny_gguf, 3)


def test_prompts_released_at_once_share_a_prefill_step_and_sent_apart_do_not(streams, items):
    prompts = list(items[1].values())  # the item's first
    assert len({len(prompt) for prompt in prompts}) == 3
    triggers = [at_once(streams, prompts, BUDGET)[0].trigger for _ in range(BURSTS)]
    # Released by a barrier, the prompts reach the server within its step at least once in a few bursts; each
    # burst's proof is the log's, whatever the schedule meant.
    assert any(found.startswith("met: the prompt in") for found in triggers), triggers
    met = next(found for found in triggers if found.startswith("met: "))
    # How the server cut the prompt: its positions, in one call or more, with the other prompts' tokens.
    assert " positions of slot " in met and " tokens of slot " in met
    mark = streams.batch_log_mark()
    apart = [ask(streams, prompt, BUDGET, cache_prompt=False) for prompt in prompts]
    found = trigger(streams, mark, apart[0], len(prompts[0]), prompt_step=True)
    # Alone, and (the server's KV log) from cell 0 of the slot's own stream, erased by the request before it.
    assert found.startswith("not met: the prompt in") and found.endswith("alone, from cell 0"), found


def test_copies_released_at_once_are_proven_per_copy(streams, items):
    prompts = list(items[1].values())
    copies = at_once(streams, [prompts[0]] * 3, BUDGET)
    assert len({answer.slot for answer in copies}) == 3  # each copy on a slot of its own
    assert all(answer.trigger.startswith(("met: ", "not met: ")) for answer in copies)


def test_a_server_without_a_batch_log_proves_nothing(built, tiny_gguf, items):  # noqa: F811
    prompts = list(items[1].values())
    with DeployedServer(tiny_gguf, ("-np", "2")) as server:
        answers = at_once(server, prompts[:2], BUDGET)
    assert [answer.trigger for answer in answers] == [NO_BATCH_LOG, NO_BATCH_LOG]


def _items_and_prompts(gguf, count: int = 2):
    """The first items' chat messages and their prompt tokens as the prompts job makes them (the GGUF's own chat
    template through llama.cpp's binding)."""
    from workflow_helpers import REPO

    from stagereplay.engines.llamacpp.engine import gguf_tokenizer
    from stagereplay.experiments.prompts import encode_prompt
    from stagereplay.inputs.items import load_items
    from stagereplay.inputs.messages import build_messages

    tokenizer, _ = gguf_tokenizer(gguf)
    items = load_items(REPO / "data" / "items.jsonl", limit=count)
    prompts = {item.item_id: encode_prompt(tokenizer, item, use_chat_template=True) for item in items}
    return {item.item_id: build_messages(item) for item in items}, prompts


def test_the_default_clients_messages_are_checked_against_the_ledgers_prompt(built, tiny_gguf):  # noqa: F811
    from stagereplay.engines.llamaserver.served import chat_prompts_check

    messages, prompts = _items_and_prompts(tiny_gguf)
    with DeployedServer(tiny_gguf, ("-np", "2")) as server:
        assert chat_prompts_check(server, prompts, messages) == (
            "the server tokenizes every item's chat messages (2) to the ledger's prompt tokens"
        )
    # Another chat template on the server: the same messages are other tokens, and the line says where.
    with DeployedServer(tiny_gguf, ("-np", "2", "--chat-template", "llama2")) as server:
        line = chat_prompts_check(server, prompts, messages)
    first = sorted(prompts)[0]
    assert line.startswith(
        f"the server tokenizes 2/2 items' chat messages to other tokens than the ledger's prompt"
        f" (first: item {first} at position "
    )
    assert line.endswith("check the chat template the server uses (--chat-template, --jinja) against the GGUF's")


def test_the_default_client_sends_chat_messages_and_reads_tokens_margins_and_slots(streams, tiny_gguf):  # noqa: F811
    from stagereplay.engines.llamaserver.served import default_cells
    from stagereplay.experiments.served import ServedDesign

    messages, prompts = _items_and_prompts(tiny_gguf)
    first, second = sorted(prompts)
    design = ServedDesign(tokens=BUDGET, clients=1, seed=0, load_runs=1, boundary=2, send_as=("default",))
    phases = []
    cells = default_cells(streams, prompts, {first: [second], second: [first]}, design, phases.append, messages)
    assert sorted({cell for _, cell, _, _ in cells}) == sorted(
        ["alone", "control", "hit", "load", "copies", "together", "together_copies"]
    )
    for _, cell, _, answer in cells:
        assert 0 < len(answer.tokens) <= BUDGET and len(answer.margins) == len(answer.tokens), cell
        assert answer.slot is not None, cell  # from the server's own answer (--verbose)
        if cell in ("load", "copies", "together", "together_copies"):
            assert answer.trigger.startswith(("met: ", "not met: ")), answer.trigger
    # Its prompt is the ledger's, so alone it answers as the pinned client does (the cache held nothing of it).
    pinned_alone = ask(streams, prompts[first], BUDGET, cache_prompt=False)
    (alone,) = [answer for item, cell, _, answer in cells if (item, cell) == (first, "alone")]
    assert alone.tokens == pinned_alone.tokens


def test_a_sampled_served_job_records_its_seed_on_every_row_and_answers_alike_alone(built, tiny_gguf, tmp_path):  # noqa: F811
    """Sampled as llama.cpp's own server tests send their requests (temperature 1.0, seed 42): every row records
    how its tokens were picked, the seeded answer alone is the same twice, and it is not the greedy answer."""
    from stagereplay.experiments.served import ServedDesign, run_served
    from stagereplay.ledger.tables import PROMPT_SCHEMA, SERVED_SCHEMA, read_table, write_table

    _, prompts = _items_and_prompts(tiny_gguf)
    table = tmp_path / "prompts.parquet"
    rows = [
        {"item_id": item, "prompt_tokens": tokens, "prompt_fingerprint": "", "readout_cue_tokens": [],
         "readout_letter_tokens": []}
        for item, tokens in prompts.items()
    ]  # fmt: skip
    write_table(rows, PROMPT_SCHEMA, table)
    sampling = {"temperature": 1.0, "seed": 42}
    design = ServedDesign(tokens=8, clients=1, seed=0, load_runs=1, boundary=2, sampling=sampling)
    record = {"gguf": str(tiny_gguf), "fingerprint": "tiny"}
    out = run_served(record, table, "np-2", {"flags": ["-np", "2"]}, design, tmp_path / "served.parquet")
    served = read_table(out, SERVED_SCHEMA).to_pylist()
    assert {row["sampling"] for row in served} == {'{"seed": 42, "temperature": 1.0}'}
    answer = {(row["item_id"], row["cell"]): row["tokens"] for row in served if row["run"] == 0}
    with DeployedServer(tiny_gguf, ("-np", "2")) as server:
        greedy = {item: ask(server, tokens, 8, cache_prompt=False).tokens for item, tokens in prompts.items()}
    for item in prompts:
        assert answer[(item, "alone")] == answer[(item, "control")], item  # the seed replays the draws
    assert any(answer[(item, "alone")] != greedy[item] for item in prompts), greedy  # and they were drawn
