"""E6's batch on the llamaserver engine: concurrent load, other requests generating on the server's other slots
while the item's requests run on slot 0 (``llamaserver.load``, ``batch_settings.ConcurrentLoad``).

Real llama-server and the tiny GGUF as tests/test_llamaserver_engine.py makes them; skipped without the server
unless STAGEREPLAY_REQUIRE_LLAMASERVER=1.
"""

from __future__ import annotations

import re
import time

import pytest
from test_llamaserver_engine import _same, built, tiny_gguf  # noqa: F401 - fixtures
from test_llamaserver_process import PROMPT

from stagereplay.design.factors import Level
from stagereplay.engines.runtime import Runtime
from stagereplay.experiments import batch_settings, factor_settings  # noqa: F401 - every setting registered
from stagereplay.experiments.batch_settings import ConcurrentLoad
from stagereplay.experiments.constructions import StageBoundary, build_live
from stagereplay.experiments.decode import continue_from
from stagereplay.experiments.level_job import LevelJob, Prefix
from stagereplay.experiments.setting import Setting, level_setting
from stagereplay.ledger.store import ObjectStore

BUDGET = 8
RUNTIME = Runtime("fp16", "cpu", 1)


@pytest.fixture(scope="module")
def server(built, tiny_gguf):  # noqa: F811
    from stagereplay.engines.llamaserver.engine import load_llamaserver

    engine = load_llamaserver(tiny_gguf, RUNTIME)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prefixes(server):
    """Three items: the prompt, and two others made from it, each with its live stage."""
    made = {}
    for index, prompt in enumerate((PROMPT, PROMPT[1:] + PROMPT[:1], PROMPT[::-1])):
        live = build_live(server, list(prompt), StageBoundary(10), server.eos_ids, server.tokenizer)
        made[f"item-{index}"] = Prefix(f"item-{index}", tuple(live.prefix), len(prompt), False)
    return made


def _load(server, name: str, prefixes, tmp_path) -> ConcurrentLoad:
    level = Level("batch", name, control=name == "1")
    job = LevelJob(server, RUNTIME, BUDGET, server.eos_ids, prefixes, ObjectStore(tmp_path), {})
    setting = level_setting(level, job)
    assert isinstance(setting, ConcurrentLoad)  # the server's batch is load, not a batch the engine composes
    return setting


def test_companions_generate_through_every_decode_call_of_a_read(server, prefixes):
    """While the item's request decodes its suffix, each companion decodes at least one token per step: the
    server put one of its tokens into every decode call, and cleaned its slot afterwards."""
    item = prefixes["item-0"]
    reference_state = Setting(server, BUDGET, server.eos_ids).build(item).state
    server.reconfigure(load_slots=3)
    try:
        assert "-np 3 --kv-unified" in server.build_description()
        with server.in_flight([list(prefixes["item-1"].context), list(prefixes["item-2"].context)]) as load:
            decoded = continue_from(server, reference_state, item.tokens[-1], BUDGET, server.eos_ids)
        steps = len(decoded.tokens)
        assert load.slots == (1, 2) and min(load.started) >= 1
        assert all(end - start >= steps for start, end in zip(load.started, load.ended)), (load, steps)
        slots = {state["id"]: state for state in server.server.request("/slots")}
        assert not slots[1]["is_processing"] and not slots[2]["is_processing"]
    finally:
        server.reconfigure(load_slots=0)
    assert "-np 1 --no-kv-unified" in server.build_description()


def test_the_control_goes_through_the_load_path_and_is_the_reference(server, prefixes, tmp_path):
    """Batch 1 on the server: a restart into 4 slots of one unified cache, 3 companions started and generating,
    then cancelled and erased before the item's request; every cell is the reference's cache and suffix, and the
    served cell is one request (build and read in one block). Before, the control was one slot and no companion."""
    item = prefixes["item-0"]
    reference = Setting(server, BUDGET, server.eos_ids)
    ref_state = reference.build(item).state
    ref_read = reference.read(item, ref_state, None)
    control = _load(server, "1", prefixes, tmp_path)
    pid = server.server.pid
    made = control.build(item)
    assert server.server.pid != pid and made.companions == ()
    assert made.note.startswith(
        "built and served in one block: 4 slots, one unified cache; 3 other requests started on slots 1–3, generating"
    )
    # ... and, from the server's batch log, nothing else was in the calls that built the item's prompt, whose cells
    # began at cell 0 (its KV log) as the reference's: the companions' cells were erased.
    assert made.note.endswith(
        "then cancelled and erased before the block; the prompt in 1 decode call:"
        f" {len(item.context)} positions of slot 0 alone, from cell 0"
    )
    assert _same(made.state, ref_state)
    assert (made.served.tokens, made.served.stop) == (ref_read.tokens, ref_read.stop)
    read = control.read(item, ref_state, made)
    assert (read.tokens, read.stop) == (ref_read.tokens, ref_read.stop)
    assert read.note.startswith("read in a block of its own: 4 slots, one unified cache; 3 other requests started")
    slots = {state["id"]: state for state in server.server.request("/slots")}
    assert list(slots) == [0]  # back at the reference's one slot


@pytest.mark.parametrize("name", ["2", "same-2"])
def test_a_load_level_runs_its_cells_and_records_its_companions(server, prefixes, tmp_path, name):
    item = prefixes["item-0"]
    setting = _load(server, name, prefixes, tmp_path)
    made = setting.build(item)
    expected = ("item-0",) if name.startswith("same") else ("item-1",)
    assert made.companions == expected
    assert made.note.startswith(
        "built and served in one block: 2 slots, one unified cache; 1 other request generating on slot 1 ("
    )
    assert made.state.num_positions == len(item.context)
    assert 1 <= len(made.served.tokens) <= BUDGET and made.served.stop in ("eos", "budget")
    read = setting.read(item, made.state, made)
    assert 1 <= len(read.tokens) <= BUDGET and read.stop in ("eos", "budget")
    assert read.note.startswith("read in a block of its own: 2 slots, one unified cache; 1 other request generating")
    assert "-np 1 --no-kv-unified" in server.build_description()  # back at the reference between cells


@pytest.mark.parametrize(("unified", "company"), [(True, "with 1 token of slot 1"), (False, "alone")])
def test_the_build_records_how_the_server_cut_the_prompt_into_decode_calls(
    server, prefixes, tmp_path, unified, company
):
    """From the server's own batch log: with one unified cache the item's prompt goes to the model in one call
    beside the companion's token (split_simple); with a KV stream per slot, in a call of its own (split_equal
    puts one sequence's run in a micro-batch). Every position of the prompt is accounted for. From its KV log, the
    cell of the prompt's first position: behind the companion's prompt and tokens in the unified cache, cell 0 of
    the slot's own stream."""
    item = prefixes["item-0"]
    level = Level("batch", "2") if unified else Level("kv_unified", "off-2")
    job = LevelJob(server, RUNTIME, BUDGET, server.eos_ids, prefixes, ObjectStore(tmp_path), {})
    made = level_setting(level, job).build(item)
    positions = len(item.context)
    recorded = re.search(r"; the prompt in 1 decode call: (\d+) positions of slot 0 (.*), from cell (\d+)$", made.note)
    assert recorded and (int(recorded[1]), recorded[2]) == (positions, company), made.note
    (companion,) = made.companions
    if unified:  # the companion's prompt, its generated tokens, then its token of this call come first
        assert int(recorded[3]) > len(prefixes[companion].context)
    else:
        assert int(recorded[3]) == 0


def test_the_batch_log_is_read_back_call_by_call():
    """llama-batch.cpp's ubatch_print lines, as the server logs them, read as calls of (position, sequences)."""
    from stagereplay.engines.llamaserver.batches import decode_calls, describe_split, prompt_calls

    log = "\n".join(
        [
            "0.06.552.991 D ubatch_add: added ubatch to split:",
            "0.06.552.992 D ubatch_print:   n_tokens     = 3",
            "0.06.553.002 D ubatch_print:     0: id =    260 (             the), pos =   55, n_seq_id =  1, seq_id = [.1],"
            " output = 1",
            "0.06.553.003 D ubatch_print:     1: id =    504 (             The), pos =    0, n_seq_id =  1, seq_id = [0.],"
            " output = 0",
            "0.06.553.004 D ubatch_print:     2: id =    198 (               ",  # a newline token breaks its row
            "), pos =    1, n_seq_id =  1, seq_id = [0.], output = 1",
            "0.06.553.017 D ubatch_print:   ]",
            "0.06.599.000 D init: input batch info:",  # the whole batch before its split: no call of its own
            "0.06.599.002 D ubatch_print:     0: id =    347 (              as), pos =    2, n_seq_id =  1, seq_id = [0.],"
            " output = 1",
            "0.06.600.000 D ubatch_add: added ubatch to split:",
            "0.06.600.002 D ubatch_print:     0: id =    347 (              as), pos =    2, n_seq_id =  1, seq_id = [0.],"
            " output = 1",
        ]
    )
    calls = decode_calls(log)
    assert [call.positions_of(0) for call in calls] == [[0, 1], [2]]
    assert calls[0].others(0) == {1: 1} and calls[1].others(0) == {}
    assert prompt_calls(calls, 0, 2) == calls[:1]
    assert describe_split(calls, 0, 3) == (
        "the prompt in 2 decode calls: 2 positions of slot 0 with 1 token of slot 1; 1 positions of slot 0 alone"
    )


def _kv_line(stream: int, end: int, used: int, head: int) -> str:
    """llama-kv-cache.cpp's find_slot line at LLAMA_KV_CACHE_DEBUG=1, as the server logs it."""
    return (
        f"0.04.683.254 D find_slot: stream[{stream}], n = {end:5d}, used = {used:5d}, head = {head:5d}, size =   512,"
        " n_swa =     0"
    )


@pytest.mark.parametrize(
    ("streams", "cell"),
    [
        # One unified cache, no free cell below its end: the call's tokens from cell 40, slot 1's token first.
        ([(0, 40, 40, 40), (0, 40, 40, 40)], 41),
        # The search restarts at cell 0 when head is more than twice the call past the used cells; cells 0-39 taken.
        ([(0, 40, 40, 100), (0, 40, 40, 100)], 41),
        # A stream per slot: slot 0's tokens alone in its own stream.
        ([(0, 0, 0, 0), (1, 40, 40, 40)], 0),
        # Free cells below the end (a finished request's): the log does not locate them, so no cell is said.
        ([(0, 40, 30, 40), (0, 40, 30, 40)], None),
    ],
)
def test_the_kv_log_places_the_prompt_in_its_cells(streams, cell):
    from stagereplay.engines.llamaserver.batches import decode_calls, describe_split

    row = "0.06.553.002 D ubatch_print:     {}: id =    260 (  the), pos = {:4d}, n_seq_id =  1, seq_id = [{}], output = 1"
    log = "\n".join(
        [
            "0.06.552.991 D ubatch_add: added ubatch to split:",
            row.format(0, 40, ".1"),
            row.format(1, 0, "0."),
            row.format(2, 1, "0."),
            *(_kv_line(*stream) for stream in streams),  # one line per sequence of the call, by id
            "0.06.553.009 D ubatch_add: added ubatch to split:",  # the next call, without its KV lines yet
            row.format(0, 2, "0."),
        ]
    )
    calls = decode_calls(log)
    assert calls[0].first_cell(0, 0) == cell and calls[1].first_cell(0, 2) is None
    where = "" if cell is None else f", from cell {cell}"
    assert (
        describe_split(calls[:1], 0, 2)
        == f"the prompt in 1 decode call: 2 positions of slot 0 with 1 token of slot 1{where}"
    )


@pytest.mark.parametrize(
    ("split", "predicted"),
    [
        ("the prompt in 1 decode call: 100 positions of slot 0 with 1 token of slot 1, from cell 41", True),
        ("the prompt in 1 decode call: 100 positions of slot 0 alone, from cell 37", True),
        ("the prompt in 1 decode call: 100 positions of slot 0 alone, from cell 128", False),
        ("the prompt in 1 decode call: 100 positions of slot 0 alone", None),  # no KV lines: not predicted
        ("the prompt in 1 decode call: 30 positions of slot 0 alone, from cell 37", False),  # under a tile
    ],
)
def test_the_placement_rule_predicts_a_servers_batch_from_its_record(split, predicted):
    """The placement rule (summary.json's E6.placement_rule) on a server's batch row: the recorded split, then its
    first cell against the tile."""
    from stagereplay.report.placement_rule import predicted_differs

    context = int(split.split(": ")[1].split()[0])
    row = {"factor": "batch", "level": "2", "item_id": "a", "setting": f"built and served in one block: ...; {split}"}
    assert predicted_differs(row, {"a": context}, tile=64) is predicted


def test_a_companion_that_stops_before_the_block_ends_fails_it(server, prefixes, monkeypatch):
    """A companion allowed 256 tokens is generating when the block begins and done before it ends."""
    from stagereplay.engines.llamaserver import load as llamaserver_load
    from stagereplay.engines.llamaserver.build import LlamaServerError

    monkeypatch.setattr(llamaserver_load, "COMPANION_TOKENS", 256)  # long enough to be seen generating
    item = prefixes["item-0"]
    state = Setting(server, BUDGET, server.eos_ids).build(item).state
    server.reconfigure(load_slots=2)
    try:
        with pytest.raises(LlamaServerError, match=r"^the companions on slots \[1\] were not generating .* 256 tokens"):
            with server.in_flight([list(prefixes["item-1"].context)]):
                deadline = time.monotonic() + 120
                while server.server.request("/slots")[1]["is_processing"] and time.monotonic() < deadline:
                    time.sleep(0.05)  # until the companion has finished its tokens
                continue_from(server, state, item.tokens[-1], BUDGET, server.eos_ids)
        slots = {slot["id"]: slot for slot in server.server.request("/slots")}
        assert not slots[1]["is_processing"]
    finally:
        server.reconfigure(load_slots=0)
