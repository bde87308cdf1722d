"""E6's A/A controls, fast: every factor has a control level that its checks accept and check_levels adds;
each in-process control runs the factor's test machinery (the switch, the batched path, the chunker, the
prefix store) and still gives the reference's bytes and suffix on the tiny model. The real runs are in
test_factors.py and test_llamacpp_factors.py."""

from __future__ import annotations

import pytest

from stagereplay.design.factors import FACTOR_OBJECTS, Level, LevelContext, check_levels, is_control
from stagereplay.engines.base import Runtime
from stagereplay.engines.registry import spec_named
from stagereplay.experiments.factor_settings import LevelJob, Prefix, Setting, level_setting
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.store import ObjectStore

RUNTIME = {"threads": 2, "attn_implementation": "eager", "precision": "fp16", "flash_attn": True}
# The control level of each factor on a run of RUNTIME at q8_0 with flash attention (rotation needs a quantized cache).
CONTROLS = {
    "prefix_reuse": "whole",
    "batch": "1",
    "attention": "eager",
    "threads": "2",
    "chunk": "whole",
    "kernels": "own",
    "flash_attn": "on",
    "ubatch": "whole",
    "cache_type": "q8_0",
    "rotation": "on",
}


def test_every_factor_has_a_control_level_its_checks_accept():
    assert set(CONTROLS) == set(FACTOR_OBJECTS)
    for name, factor in FACTOR_OBJECTS.items():
        control = factor.control({**RUNTIME, "precision": "q8_0"}, "AVX2")
        assert control == CONTROLS[name]
        for engine in factor.engines():
            factor.check(control, LevelContext(spec_named(engine), 4, 12, frozenset(), "cpu", "q8_0", True))
        # The summary tells a control apart from the row alone: its level and its reference level.
        reference = factor.reference({**RUNTIME, "precision": "q8_0"}, "AVX2")
        assert is_control(name, control, reference)


def test_check_levels_adds_each_factors_control_once():
    levels = check_levels(
        {"threads": [1, 2], "chunk": [5], "prefix_reuse": ["prompt"], "kernels": ["default"]},
        "transformers",
        4,
        12,
        frozenset({"avx2", "fma"}),
        runtime=RUNTIME,
    )
    named = [(level.factor, level.name, level.control) for level in levels]
    assert named == [
        ("threads", "1", False),
        ("threads", "2", True),  # listed by the user: that level is the control, not run twice
        ("chunk", "5", False),
        ("chunk", "whole", True),
        ("prefix_reuse", "prompt", False),
        ("prefix_reuse", "whole", True),
        ("kernels", "default", False),
        ("kernels", "own", True),
    ]
    llamacpp = check_levels(
        {"cache_type": ["q4_0"], "ubatch": [7]}, "llamacpp", 4, 12, None, "cpu", "q8_0", True, runtime=RUNTIME
    )
    assert [(level.name, level.control) for level in llamacpp] == [
        ("q4_0", False),
        ("q8_0", True),
        ("7", False),
        ("whole", True),
    ]


class Calls:
    """The engine methods a setting called, wrapped on the instance (monkeypatch restores them)."""

    def __init__(self, engine, monkeypatch, names):
        self.seen: list[tuple[str, tuple]] = []
        for name in names:
            method = getattr(engine, name)

            def spy(*args, _name=name, _method=method, **kwargs):
                self.seen.append((_name, args))
                return _method(*args, **kwargs)

            monkeypatch.setattr(engine, name, spy)

    def names(self) -> list[str]:
        return [name for name, _ in self.seen]


# factor -> the engine calls its control must make (the test machinery) and must not make.
MACHINERY = {
    "attention": ({"use_attention"}, set()),
    "threads": ({"use_threads"}, set()),
    "batch": ({"batch_forward", "batch_of", "batch_row"}, {"forward"}),
    "chunk": ({"forward"}, set()),
    "prefix_reuse": ({"snapshot", "to_cache"}, set()),
}


@pytest.mark.parametrize("factor", sorted(MACHINERY))
def test_in_process_controls_run_the_test_machinery_and_reproduce_the_reference(
    factor, tiny_fp32, tmp_path, monkeypatch
):
    engine = tiny_fp32
    runtime = Runtime(precision="fp32", device="cpu", threads=1)
    prefix = Prefix("item-0", tuple(range(5, 40)), 12, False)
    companion = Prefix("item-1", tuple(range(9, 30)), 8, False)
    reference = Setting(engine, 6, frozenset())
    built = reference.build(prefix)
    expected = reference.read(prefix, built.state, None)
    scratch = ObjectStore(tmp_path / "scratch")
    job = LevelJob(
        engine, runtime, 6, frozenset(), {p.item_id: p for p in (prefix, companion)}, scratch, {"fingerprint": "f"}
    )
    own = {"threads": runtime.threads, "attn_implementation": runtime.attn_implementation}
    must, must_not = MACHINERY[factor]
    calls = Calls(engine, monkeypatch, sorted(must | must_not))  # before the setting takes its switch
    test = level_setting(Level(factor, FACTOR_OBJECTS[factor].control(own), control=True), job)
    test_built = test.build(prefix)
    read = test.read(prefix, built.state, test_built)
    assert must <= set(calls.names()) and not must_not & set(calls.names()), calls.names()
    assert fingerprint_cache(test_built.state).digest == fingerprint_cache(built.state).digest
    assert read.tokens == expected.tokens
    if factor == "chunk":
        assert test_built.note == f"1 chunks of at most {len(prefix.context)} over {len(prefix.context)} positions"
    if factor == "prefix_reuse":  # the whole context went through the store and came back
        assert test_built.reused_tokens == len(prefix.context)
        assert test_built.reused_digest == fingerprint_cache(built.state).digest
        assert test_built.reused_digest in scratch.object_ids()
