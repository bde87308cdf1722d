"""Where the item's cells lie in llama-server's cache, and what that does to the bytes it writes (E6's kv_offset and
kv_unified on the server): the binding's key-tile rule (tests/test_llamacpp_placement.py) holds through the server,
and concurrent load without a unified cache writes the reference's bytes.

Real llama-server and the tiny GGUF as tests/test_llamaserver_engine.py makes them, with flash attention and
150-token contexts (the tiled kernel); skipped without the server unless STAGEREPLAY_REQUIRE_LLAMASERVER=1.
"""

from __future__ import annotations

import pytest
from test_llamacpp_placement import KV_TILE, _prefixes
from test_llamaserver_engine import _same, built, tiny_gguf  # noqa: F401 - fixtures

from stagereplay.design.factors import Level
from stagereplay.engines.llamacpp.engine import load_llamacpp
from stagereplay.engines.runtime import Runtime
from stagereplay.experiments import batch_settings, factor_settings  # noqa: F401 - every setting registered
from stagereplay.experiments.batch_settings import ConcurrentLoad, KvOffset
from stagereplay.experiments.level_job import LevelJob
from stagereplay.experiments.setting import Setting, level_setting
from stagereplay.ledger.store import ObjectStore

BUDGET = 6
RUNTIME = Runtime("fp16", "cpu", 1, flash_attn=True)


@pytest.fixture(scope="module")
def engines(built, tiny_gguf):  # noqa: F811
    from stagereplay.engines.llamaserver.engine import load_llamaserver

    server, binding = load_llamaserver(tiny_gguf, RUNTIME), load_llamacpp(tiny_gguf, RUNTIME)
    yield server, binding
    server.close()
    binding.close()


def _setting(engine, factor: str, name: str, prefixes, tmp_path):
    job = LevelJob(engine, RUNTIME, BUDGET, engine.eos_ids, prefixes, ObjectStore(tmp_path), {})
    return level_setting(Level(factor, name), job)


def test_an_idle_slot_moves_the_items_cells_by_the_key_tile_rule(engines, tmp_path):
    """Slot 1 holding C idle cells: the item's cache on slot 0 is the binding's own kv_offset build, byte for byte,
    and differs from the reference exactly when C is not a multiple of 64; removed:100 is the reference."""
    server, binding = engines
    prefixes = _prefixes(150)
    item = prefixes["item-0"]
    reference = Setting(server, BUDGET, server.eos_ids).build(item).state
    for name in ("37", "64", "removed-100"):
        setting = _setting(server, "kv_offset", name, prefixes, tmp_path)
        assert isinstance(setting, KvOffset)
        made = setting.build(item)
        assert "-np 2 --kv-unified" in made.note and "--no-cache-idle-slots" in made.note
        assert _same(made.state, _setting(binding, "kv_offset", name, prefixes, tmp_path).build(item).state)
        cells = setting.cells
        assert _same(made.state, reference) == (setting.removed or cells % KV_TILE == 0), name
    assert "-np 1 --no-kv-unified" in server.build_description()  # back at the reference


def test_load_without_a_unified_cache_writes_the_reference_bytes(engines, tmp_path):
    """kv_unified off:2: one companion generating on slot 1 of a --no-kv-unified server while the item is built and
    served on slot 0, whose stream starts at cell 0: the reference's cache and continuation."""
    server, _ = engines
    prefixes = _prefixes(150)
    item = prefixes["item-0"]
    reference = Setting(server, BUDGET, server.eos_ids)
    ref_state = reference.build(item).state
    ref_read = reference.read(item, ref_state, None)
    setting = _setting(server, "kv_unified", "off-2", prefixes, tmp_path)
    assert isinstance(setting, ConcurrentLoad) and not setting.unified
    made = setting.build(item)
    assert made.note.startswith(
        "built and served in one block: 2 slots, one KV stream per slot; 1 other request generating on slot 1"
    )
    assert _same(made.state, ref_state)
    assert made.served.tokens == ref_read.tokens
    read = setting.read(item, ref_state, made)  # the reference cache restored into stream 0 of two
    assert read.tokens == ref_read.tokens
