"""E6's A/A controls, fast: every factor has a control level that its checks accept and check_levels adds;
each in-process control runs the factor's test machinery (the switch, the batched path, the chunker, the
prefix store) and still gives the reference's bytes and suffix on the tiny model; and a control that does
not reproduce the reference stops summarize and report in one line naming the path. The real runs are in
test_factors.py and test_llamacpp_factors.py."""

from __future__ import annotations

import json
import re

import pytest

from stagereplay.cli import main
from stagereplay.design.factors import FACTOR_OBJECTS, Level, LevelContext, check_levels, is_control
from stagereplay.engines.base import Runtime
from stagereplay.engines.registry import SPECS, spec_named
from stagereplay.experiments import batch_settings, factor_settings  # noqa: F401 - every setting registered
from stagereplay.experiments.level_job import LevelJob, Prefix
from stagereplay.experiments.setting import Setting, level_setting
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import FACTOR_SCHEMA, write_table
from stagereplay.report.controls import ControlFailed, check_controls, controls_card_row
from stagereplay.report.factor_summary import e6_controls

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
    "kv_offset": "removed-100",
    "kv_unified": "off-1",
}


def test_every_factor_has_a_control_level_its_checks_accept():
    assert set(CONTROLS) == set(FACTOR_OBJECTS)
    for name, factor in FACTOR_OBJECTS.items():
        control = factor.control({**RUNTIME, "precision": "q8_0"}, "AVX2")
        assert control == CONTROLS[name]
        for engine in factor.engines(SPECS.values()):
            factor.check(control, LevelContext(spec_named(engine), 4, 12, frozenset(), "cpu", "q8_0", True))
        # The summary tells a control apart from the row alone: its level and its reference level.
        reference = factor.reference({**RUNTIME, "precision": "q8_0"}, "AVX2")
        assert is_control(name, control, reference)


def test_check_levels_adds_each_factors_control_once():
    levels = check_levels(
        {"threads": [1, 2], "chunk": [5], "prefix_reuse": ["prompt"], "kernels": ["default"]},
        spec_named("transformers"),
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
        {"cache_type": ["q4_0"], "ubatch": [7]},
        spec_named("llamacpp"),
        4,
        12,
        None,
        "cpu",
        "q8_0",
        True,
        runtime=RUNTIME,
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


def _rows(level: str, reference: str, suffix_of) -> list[dict]:
    """A hand-built factor table of batch level ``level`` over two items, three cells each."""
    rows = []
    for item in ("a-0", "a-1"):
        for build, read in (("test", "ref"), ("ref", "test"), ("test", "test")):
            cache = f"cache-{item}"
            rows.append(
                {
                    "checkpoint": "tiny",
                    "precision": "bf16",
                    "factor": "batch",
                    "level": level,
                    "reference_level": reference,
                    "item_id": item,
                    "cell": f"{build}-{read}",
                    "build": build,
                    "read": read,
                    "applicable": True,
                    "reference_cache": cache,
                    "reference_suffix": f"suffix-{item}",
                    "cache_digest": cache,
                    "cache_differs": False,
                    "suffix_object": suffix_of(item, build, read),
                }
            )
    return rows


def _same(item, build, read):
    return f"suffix-{item}"


def _perturbed(item, build, read):  # the harness changes what it reads: the control's reads differ on a-1
    return "other" if (item, read) == ("a-1", "test") else f"suffix-{item}"


def test_controls_section_counts_identical_paths():
    rows = _rows("1", "1", _same) + _rows("3", "1", _perturbed)  # level 3 is a test level: it may differ
    controls = e6_controls(rows)
    assert (controls["paths"], controls["identical"], controls["without_control"]) == (1, 1, [])
    assert controls["levels"][0]["factor"] == "batch" and controls["levels"][0]["identical"]
    check_controls(controls)
    assert controls_card_row({"controls": controls})[2] == "1/1 paths identical on every item"
    old = e6_controls(_rows("3", "1", _same))  # a ledger written before controls
    assert controls_card_row({"controls": old})[2] == "0/0 paths identical on every item; no control run for batch"


FAILED_LINE = (
    "E6 control failed: batch 1 (the reference setting through the batch test path) gave another suffix on 1 of 2"
    " items (a-1); a verdict other than none on 1 of 2 items (a-1) — the E6 harness is broken"
)


def test_a_failed_control_stops_summarize_and_report(tmp_path, capsys):
    rows = _rows("1", "1", _perturbed)
    with pytest.raises(ControlFailed, match=re.escape(FAILED_LINE)):
        check_controls(e6_controls(rows))
    table = write_table(rows, FACTOR_SCHEMA, tmp_path / "factors.parquet")
    missing = str(tmp_path / "absent.parquet")  # never read: the controls are checked first
    out = tmp_path / "summary.json"
    code = main(
        ["summarize", "--trajectories", missing, "--comparisons", missing, "--factors", str(table), "--out", str(out)]
    )
    error = capsys.readouterr().err.strip()
    assert code != 0 and not out.exists()
    assert error.count("\n") == 0 and FAILED_LINE in error
    summary = tmp_path / "edited.json"
    summary.write_text(json.dumps({"E6": {"controls": e6_controls(rows)}}))
    args = ["--trajectories", missing, "--comparisons", missing, "--items", missing, "--item-source", "x"]
    args += ["--model", "tiny", missing, "--vocab", "tiny", missing]
    code = main(["report", "--summary", str(summary), *args, "--card", str(tmp_path / "c.md"), "--plots-dir", "p"])
    error = capsys.readouterr().err.strip()
    assert code != 0 and error.count("\n") == 0 and FAILED_LINE in error
