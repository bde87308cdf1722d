"""E6's batch, decomposed: a batch of other items (rows of other lengths: left padding and a mask) against
a batch of the item repeated (same:B, rows of one length: no padding), beside batch 1 through the same path.
The levels' checks, and what the repeated batch feeds, on the tiny model."""

from __future__ import annotations

import pytest

from stagereplay.design.factors import FactorError, Level, check_levels
from stagereplay.engines.base import Runtime
from stagereplay.engines.registry import spec_named
from stagereplay.experiments import batch_settings, factor_settings  # noqa: F401 - every setting registered
from stagereplay.experiments.level_job import LevelJob, Prefix
from stagereplay.experiments.setting import Setting, level_setting
from stagereplay.ledger.store import ObjectStore


def _levels(given, item_count=2):
    return [
        (level.name, level.control)
        for level in check_levels({"batch": given}, spec_named("transformers"), item_count, 8)
    ]


def test_same_b_is_a_level_of_its_own_and_needs_no_other_items():
    # A repeated batch needs only the item: same:8 on a run of 2 items; the control (batch 1) is added.
    assert _levels(["same:8", 2]) == [("same-8", False), ("2", False), ("1", True)]
    with pytest.raises(FactorError, match=r"a batch of 8 needs 8 items, the run has 2 .* or same:8"):
        _levels([8])
    with pytest.raises(FactorError, match="same:1 is a batch of the item alone"):
        _levels(["same:1"])
    with pytest.raises(FactorError, match="is not a positive integer"):
        _levels(["same:x"])


def _job(engine, tmp_path, prefixes):
    runtime = Runtime(precision="fp32", device="cpu", threads=1)
    return LevelJob(engine, runtime, 6, frozenset(), {p.item_id: p for p in prefixes}, ObjectStore(tmp_path), {})


@pytest.mark.parametrize(("level", "padded"), [("same-3", False), ("3", True)])
def test_a_repeated_batch_feeds_rows_of_one_length(level, padded, tiny_fp32, tmp_path, monkeypatch):
    prefix = Prefix("item-0", tuple(range(5, 40)), 12, False)
    others = [Prefix("item-1", tuple(range(9, 30)), 8, False), Prefix("item-2", tuple(range(3, 20)), 8, False)]
    fed = []
    batch_forward = tiny_fp32.batch_forward

    def spy(batch, rows):
        fed.append([len(row) for row in rows])
        return batch_forward(batch, rows)

    monkeypatch.setattr(tiny_fp32, "batch_forward", spy)
    setting = level_setting(Level("batch", level), _job(tiny_fp32, tmp_path, [prefix, *others]))
    built = setting.build(prefix)
    read = setting.read(prefix, Setting(tiny_fp32, 6, frozenset()).build(prefix).state, built)
    assert len(fed[0]) == 3 and len(read.tokens) == 6
    if padded:
        assert built.companions == ("item-1", "item-2") and len(set(fed[0])) == 3
    else:
        assert built.companions == ("item-0", "item-0") and fed[0] == [len(prefix.context)] * 3
        assert built.note == "batch of 3: the item repeated, rows of one length (no padding)"
    assert all(len(set(lengths)) == 1 for lengths in fed[1:])  # each step feeds one token per row
