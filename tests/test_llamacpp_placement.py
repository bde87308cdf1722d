"""Where an item's cells lie in llama.cpp's cache, and what that does to the bytes it writes (E6's kv_offset and
kv_unified on the binding): the rule the findings rest on, pinned on a tiny random GGUF.

The rule, from the vendored ggml-cpu (``ggml_compute_forward_flash_attn_ext_tiled`` in ``ggml-cpu/ops.cpp``,
tile sizes ``GGML_FA_TILE_Q`` and ``GGML_FA_TILE_KV`` in ``ggml-cpu/common.h``): a flash-attention call with at
least 64 queries over an fp16 or fp32 cache runs the tiled kernel, which cuts the *key* axis into 64-cell tiles
counted from cell 0 of the cache view, skips a tile whose cells are all masked, and merges the running softmax at
each tile edge. So an item whose cells start at cell c is summed in other pieces than at cell 0 unless c is a
multiple of 64; a call with fewer queries (a decode step) takes the per-query kernel, which skips masked cells one
by one, wherever they are.

Skips with the reason when llama_cpp is not importable; STAGEREPLAY_REQUIRE_LLAMACPP=1 (.ci/run) fails instead.
"""

from __future__ import annotations

import pytest
from test_llamacpp import _binding_problem
from workflow_helpers import skip_unless_required

from stagereplay.design.factors import Level
from stagereplay.engines.runtime import Runtime
from stagereplay.experiments import batch_settings, factor_settings  # noqa: F401 - every setting registered
from stagereplay.experiments.batch_settings import Batch, KvOffset
from stagereplay.experiments.level_job import LevelJob, Prefix
from stagereplay.experiments.setting import Setting, level_setting
from stagereplay.inputs.checkpoints import build_random_qwen2
from stagereplay.inputs.tiny_gguf import write_qwen2_gguf
from stagereplay.ledger.store import ObjectStore

KV_TILE = 64  # GGML_FA_TILE_KV of the vendored ggml-cpu: the key tile of the tiled flash-attention kernel
BUDGET = 6


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    skip_unless_required(_binding_problem(), "STAGEREPLAY_REQUIRE_LLAMACPP")
    folder = build_random_qwen2(tmp_path_factory.mktemp("placement") / "model", seed=0, layers=2, hidden=64)
    return write_qwen2_gguf(folder, tmp_path_factory.mktemp("gguf") / "placement.gguf")


def _engine(gguf, flash_attn: bool):
    from stagereplay.engines.llamacpp.engine import load_llamacpp

    return load_llamacpp(gguf, Runtime("fp16", "cpu", 1, flash_attn=flash_attn))


def _prefixes(context: int) -> dict[str, Prefix]:
    """Two items whose contexts hold ``context`` tokens (byte ids the vocabulary has), the last token pending."""
    made = {}
    for index, step in enumerate((17, 29)):
        tokens = tuple((step * position + 5) % 250 + 3 for position in range(context + 1))
        made[f"item-{index}"] = Prefix(f"item-{index}", tokens, 4, False)
    return made


def _setting(engine, factor: str, name: str, prefixes, tmp_path):
    job = LevelJob(engine, Runtime("fp16", "cpu", 1), BUDGET, engine.eos_ids, prefixes, ObjectStore(tmp_path), {})
    return level_setting(Level(factor, name), job)


def _same(a, b) -> bool:
    return all(x.equal(y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)))


@pytest.fixture(scope="module")
def flash(tiny_gguf):
    engine = _engine(tiny_gguf, flash_attn=True)
    yield engine
    engine.close()


def test_an_offset_changes_the_written_cache_unless_it_is_a_whole_number_of_key_tiles(flash, tmp_path):
    """150 queries in one call (the tiled kernel): the item's cache differs from the one it writes at cell 0 exactly
    when the filler is not a multiple of 64 cells; the control (the filler decoded, then removed) reproduces it."""
    prefixes = _prefixes(150)
    item = prefixes["item-0"]
    reference = Setting(flash, BUDGET, flash.eos_ids).build(item).state
    for cells in (1, 37, 63, 64, 65, 100, 128):
        setting = _setting(flash, "kv_offset", str(cells), prefixes, tmp_path)
        assert isinstance(setting, KvOffset) and setting.filler("item-0") == list(prefixes["item-1"].context[:cells])
        built = setting.build(item)
        assert built.note.startswith(f"the item's cells from cell {cells}, behind {cells} idle cells")
        assert _same(built.state, reference) == (cells % KV_TILE == 0), cells
    control = _setting(flash, "kv_offset", "removed-100", prefixes, tmp_path).build(item)
    assert control.note.startswith("a 100-cell filler sequence decoded and removed before the item")
    assert _same(control.state, reference)


def test_fewer_queries_than_a_tile_are_not_moved(flash, tmp_path):
    """A 40-token build (the per-query kernel) writes the same bytes at any offset: the rule is the tiled kernel's,
    not the cache's. (Without flash attention nothing is claimed: on an AVX-512 CPU the build behind 37 cells wrote
    other bytes on the tiny GGUF too, a placement effect of its own, not traced: docs/findings.md.)"""
    short = _prefixes(40)
    reference = Setting(flash, BUDGET, flash.eos_ids).build(short["item-0"]).state
    built = _setting(flash, "kv_offset", "37", short, tmp_path).build(short["item-0"])
    assert _same(built.state, reference)


def test_reading_behind_an_offset_is_the_reference_read(flash, tmp_path):
    """The read side: the reference cache restored behind 37 filler cells continues with the same first logits,
    bit for bit, and the same tokens (each decode step is one query: the per-query kernel)."""
    prefixes = _prefixes(150)
    item = prefixes["item-0"]
    reference = Setting(flash, BUDGET, flash.eos_ids)
    state = reference.build(item).state
    alone = reference.read(item, state, None)
    behind = _setting(flash, "kv_offset", "37", prefixes, tmp_path).read(item, state, None)
    assert behind.tokens == alone.tokens and behind.first_logits.equal(alone.first_logits)


def test_a_batch_with_one_stream_per_sequence(flash, tmp_path):
    """kv_unified off:2 on the binding: the batch runs in a context of one KV stream per sequence, and the item,
    sequence 0, is at cell 0 of its stream as in the unified batch: the same bytes as the reference."""
    prefixes = _prefixes(150)
    item = prefixes["item-0"]
    setting = _setting(flash, "kv_unified", "off-2", prefixes, tmp_path)
    assert isinstance(setting, Batch) and not setting.unified
    built = setting.build(item)
    assert built.note == "batch of 2 with item-1, one KV stream per sequence"
    assert _same(built.state, Setting(flash, BUDGET, flash.eos_ids).build(item).state)
    with setting.active():
        assert "n_seq_max=2; kv_unified=off" in flash.build_description()
    assert "kv_unified" not in flash.build_description()  # back to the one-sequence context


def test_one_stream_per_sequence_splits_a_longer_item_at_its_companions_length(flash, tmp_path):
    """The split rule (``split_equal`` in llama-batch.cpp): with one KV stream per sequence, a micro-batch takes the
    same number of tokens from each sequence, so an item of 150 tokens beside a companion of 120 is prefilled in two
    calls (120, then 30: other bytes), while the 120-token item beside the 150-token one is prefilled whole."""
    prefixes = {**_prefixes(150)}
    prefixes["item-1"] = Prefix("item-1", prefixes["item-1"].tokens[:121], 4, False)
    reference = Setting(flash, BUDGET, flash.eos_ids)
    setting = _setting(flash, "kv_unified", "off-2", prefixes, tmp_path)
    longer, shorter = prefixes["item-0"], prefixes["item-1"]
    assert not _same(setting.build(longer).state, reference.build(longer).state)
    assert _same(setting.build(shorter).state, reference.build(shorter).state)
    unified = _setting(flash, "batch", "2", prefixes, tmp_path)  # one unified cache: one micro-batch, split_simple
    assert _same(unified.build(longer).state, reference.build(longer).state)
