"""E6's first read and margins at divergence, fast, on cases whose answer is known: the first read of
attention eager against the reference (sdpa) equals what the model itself gives for the pending token on that
cache; the control's is bit-identical; a test level that leaves the reference suffix at a hand-set step records
that step's margins and the reference's own top logit there; one bf16 step and the flip-margin counts on
hand-built rows; and a factor table without the new columns gets one verify line naming its migration."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from stagereplay.audit.faults import Report
from stagereplay.audit.verify import verify_tables
from stagereplay.design.factors import Level
from stagereplay.engines.base import Runtime
from stagereplay.engines.registry import spec_named
from stagereplay.experiments import batch_settings, factor_settings  # noqa: F401 - every setting registered
from stagereplay.experiments.cell_logits import first_read
from stagereplay.experiments.decode import Decoded
from stagereplay.experiments.factor_job import LevelSettings, ReferenceItem, item_cells
from stagereplay.experiments.level_job import Built, LevelJob, Prefix
from stagereplay.experiments.setting import Setting, level_setting
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState, to_host
from stagereplay.ledger.store import ObjectStore
from stagereplay.ledger.tables import FACTOR_LOGIT_COLUMNS, FACTOR_SCHEMA, LedgerError, read_table, write_table
from stagereplay.report.factor_reading import flip_margins_reading
from stagereplay.report.margins import (
    bf16_logits,
    bf16_step,
    e1_flip_margins,
    e6_flip_margins,
    first_read_figures,
    one_bf16_step_at_most_for_some_top,
    within_one_bf16_step,
)
from stagereplay.report.stats import share

PREFIX = Prefix("item-0", tuple(range(5, 40)), 12, False)
BUDGET = 6


def reference_item(engine, budget: int = BUDGET):
    """The reference setting, the item as the job holds it (its row built by that setting), and its decode."""
    reference = Setting(engine, budget, frozenset())
    state = to_host(reference.build(PREFIX).state)
    decoded = reference.read(PREFIX, state, None)
    fingerprint = fingerprint_cache(state)
    row = {
        "suffix_tokens": list(decoded.tokens),
        "suffix_margins": list(decoded.margins),
        "cache_object": fingerprint.digest,
        "layer_k": list(fingerprint.keys),
        "layer_v": list(fingerprint.values),
    }
    return reference, ReferenceItem(PREFIX, row, state), decoded


def cells_of(engine, level: Level, test=None, tmp_path=None, item: ReferenceItem | None = None) -> dict[str, dict]:
    """Each cell's row of ``level`` (run by ``test``, or by its own setting) over the item (by default, built
    here by the reference setting)."""
    reference = Setting(engine, BUDGET, frozenset())
    item = item or reference_item(engine)[1]
    if test is None:
        runtime = Runtime(precision="fp32", device="cpu", threads=1)
        job = LevelJob(engine, runtime, BUDGET, frozenset(), {PREFIX.item_id: PREFIX}, ObjectStore(tmp_path), {})
        test = level_setting(level, job)
    return {row["cell"]: row for row in item_cells(LevelSettings(level, reference, test), item, {})}


def read_by_the_model(folder, state: KVState, pending: int, attention: str) -> torch.Tensor:
    """The pending token's logits on the boundary cache, from transformers alone (no engine code)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attention)
    cache = DynamicCache(config=model.config)
    for layer, (key, value) in enumerate(zip(state.keys, state.values)):
        cache.update(key.clone(), value.clone(), layer)
    with torch.inference_mode():
        return model(input_ids=torch.tensor([[pending]]), cache=cache, use_cache=True).logits[0, -1].float()


def test_first_read_of_eager_is_the_models_own_read_against_sdpa(tiny_fp32, tiny_qwen2_folder, tmp_path):
    assert tiny_fp32.environment.attn_implementation == "sdpa"  # the reference reads with sdpa
    rows = cells_of(tiny_fp32, Level("attention", "eager"), tmp_path=tmp_path)
    _, item, _ = reference_item(tiny_fp32)
    eager = read_by_the_model(tiny_qwen2_folder, item.state, PREFIX.tokens[-1], "eager")
    sdpa = read_by_the_model(tiny_qwen2_folder, item.state, PREFIX.tokens[-1], "sdpa")
    read = rows["ref-test"]
    assert read["first_logits_identical"] is torch.equal(eager, sdpa) is False  # the two kernels round apart
    assert read["first_logits_max_abs"] == float((eager - sdpa).abs().max()) > 0
    assert read["first_argmax_same"] is (int(eager.argmax()) == int(sdpa.argmax()))


def test_first_read_of_the_control_is_bit_identical(tiny_fp32, tmp_path):
    rows = cells_of(tiny_fp32, Level("attention", "sdpa", control=True), tmp_path=tmp_path)
    for row in rows.values():
        assert (row["first_logits_identical"], row["first_argmax_same"], row["first_logits_max_abs"]) == (
            True,
            True,
            0.0,
        )
        assert row["first_divergence"] is None
        assert [row[c] for c in FACTOR_LOGIT_COLUMNS[:3]] == [None, None, None]  # no divergence, no margins


class LeavesAtStepTwo(Setting):
    """A test level that builds the reference's bytes and reads them into a suffix that leaves the reference's
    at step 2, with hand-set margins and first logits one logit off the reference's."""

    def __init__(self, engine, state, reference: Decoded):
        super().__init__(engine, BUDGET, frozenset())
        self.state, self.reference = state, reference

    def build(self, prefix):
        return Built(self.state, "the reference's own bytes")

    def first_logits(self) -> torch.Tensor:
        first = self.reference.first_logits.clone()
        first[0] += 0.5
        return first

    def read(self, prefix, state, built):
        tokens = list(self.reference.tokens)
        tokens[2] += 1
        first = self.first_logits()
        return Decoded(tuple(tokens[:3]), (1.5, 1.25, 0.0625), "budget", first_logits=first, top_logits=(9, 9, 9))


def test_margins_at_the_first_divergent_step_of_a_hand_built_level(tiny_fp32):
    _, item, decoded = reference_item(tiny_fp32)
    item.row["suffix_margins"] = [2.0, 1.0, 0.125, 3.0, 3.0, 3.0]  # the job reads the reference's from its row
    test = LeavesAtStepTwo(tiny_fp32, item.state, decoded)
    before = tiny_fp32.fed_positions
    rows = cells_of(tiny_fp32, Level("attention", "eager"), test, item=item)
    write, read, served = rows["test-ref"], rows["ref-test"], rows["test-test"]
    assert write["first_divergence"] is None and write["margin_at_divergence"] is None
    assert write["first_logits_identical"] is True  # the same bytes read by the reference itself
    for row in (read, served):
        assert row["first_divergence"] == 2
        assert row["margin_at_divergence"] == 0.0625
        assert row["reference_margin_at_divergence"] == 0.125
        # the reference's own top logit at step 2, from reading it again (not the test's 9)
        assert row["reference_top_logit_at_divergence"] == decoded.top_logits[2] != 9
        assert row["first_logits_identical"] is False and row["first_logits_max_abs"] == 0.5
        assert row["first_argmax_same"] is (int(test.first_logits().argmax()) == int(decoded.first_logits.argmax()))
    # The reference was read again only as far as step 2 (the pending token and two decoded tokens), after the
    # write cell's reference read.
    assert tiny_fp32.fed_positions - before == BUDGET + 3


def test_first_read_ignores_equal_infinities_and_ties_go_to_the_lowest_index():
    reference = torch.tensor([1.0, 3.0, -math.inf, 3.0])
    same = first_read(reference.clone(), reference)
    assert same == {"first_logits_identical": True, "first_argmax_same": True, "first_logits_max_abs": 0.0}
    moved = first_read(torch.tensor([1.0, 3.0, -math.inf, 3.25]), reference)
    assert moved == {"first_logits_identical": False, "first_argmax_same": False, "first_logits_max_abs": 0.25}
    assert first_read(None, reference)["first_logits_identical"] is None


def bf16_values(low: float, high: float) -> list[float]:
    """Every bf16 number in [low, high]."""
    start = torch.tensor(low, dtype=torch.bfloat16).view(torch.int16).item()
    stop = torch.tensor(high, dtype=torch.bfloat16).view(torch.int16).item()
    bits = torch.arange(start, stop + 1, dtype=torch.int16)
    return bits.view(torch.bfloat16).float().tolist()


def test_one_bf16_step_is_the_gap_to_the_next_bf16_number():
    assert [bf16_step(top) for top in (16.0, 20.0, 31.9, 32.0, -40.0, 15.99)] == [0.125] * 3 + [0.25, 0.25, 0.0625]
    for top in bf16_values(1.0, 80.0):
        above = torch.tensor(top, dtype=torch.bfloat16).view(torch.int16) + 1
        assert above.view(torch.bfloat16).item() - top == bf16_step(top)
    assert bf16_step(0.0) == 0.0 and within_one_bf16_step(0.0, 0.0) and not within_one_bf16_step(1e-30, 0.0)


def test_a_margin_within_one_bf16_step_is_zero_or_a_power_of_two():
    values = bf16_values(12.0, 40.0)
    for top in values:
        for runner_up in values:
            margin = top - runner_up
            if 0 <= margin and within_one_bf16_step(margin, top):
                assert one_bf16_step_at_most_for_some_top(margin), (top, runner_up)
    assert not one_bf16_step_at_most_for_some_top(0.375) and one_bf16_step_at_most_for_some_top(0.125)


def e1_pair(margin: float | None, differs: bool = True) -> dict:
    return {"suffix_differs": differs, "b_margin_at_divergence": margin}


def test_e1_flip_margins_count_ties_and_bound_the_bf16_steps():
    pairs = [e1_pair(0.0), e1_pair(0.125), e1_pair(0.375), e1_pair(None), e1_pair(0.5, differs=False)]
    assert e1_flip_margins(pairs, bf16=True) == {
        "side": "prefill",
        "flips": 3,
        "tie": share(1, 3),
        "one_bf16_step_at_most": share(2, 3),
    }
    assert e1_flip_margins(pairs, bf16=False)["one_bf16_step_at_most"] is None
    # Only a weight dtype of bf16 makes bf16 logits: llama.cpp's precision is its cache type, its logits float32.
    transformers, llamacpp, llamaserver = (spec_named(name) for name in ("transformers", "llamacpp", "llamaserver"))
    assert bf16_logits(transformers, "bf16") and not bf16_logits(transformers, "fp32")
    assert not bf16_logits(llamacpp, "fp16") and not bf16_logits(llamaserver, "q8_0")
    assert not bf16_logits(None, "bf16")  # an engine no spec names: not known to be bf16


def factor_row(cell: str, divergence: int | None, margin: float | None = None, top: float | None = None, **logits):
    return {
        "cell": cell,
        "first_divergence": divergence,
        "reference_margin_at_divergence": margin,
        "reference_top_logit_at_divergence": top,
        "converted_digest": None,
        **{"first_logits_identical": None, "first_argmax_same": None, "first_logits_max_abs": None, **logits},
    }


def test_e6_flip_margins_and_first_read_of_hand_built_rows():
    served = [
        factor_row("test-test", 3, 0.0, 20.0),  # a tie
        factor_row("test-test", 0, 0.125, 20.0),  # one step at [16, 32)
        factor_row("test-test", 5, 0.125, 15.5),  # two steps at [8, 16)
        factor_row("test-test", 1, 0.25, -40.0),  # one step at [32, 64)
        factor_row("test-test", None),  # no flip
    ]
    assert e6_flip_margins(served, bf16=True) == {
        "flips": 4,
        "bf16_logits": True,
        "tie": share(1, 4),
        "median_margin": 0.125,
        "within_one_bf16_step": share(3, 4),
    }
    # On float32 logits the same count is a scale of |top|, under its own name: never a bf16 step.
    assert e6_flip_margins(served, bf16=False) == {
        "flips": 4,
        "bf16_logits": False,
        "tie": share(1, 4),
        "median_margin": 0.125,
        "within_top_over_128": share(3, 4),
    }
    # Log-probabilities (llama-server): margins and ties, no top logit to scale them by.
    logprobs = [factor_row("test-test", 2, 0.5), factor_row("test-test", 0, 0.0), factor_row("test-test", 4, 1.5)]
    assert e6_flip_margins(logprobs, bf16=False) == {
        "flips": 3,
        "bf16_logits": False,
        "tie": share(1, 3),
        "median_margin": 0.5,
        "within_top_over_128": None,
    }
    read = [
        factor_row("ref-test", None, first_logits_identical=True, first_argmax_same=True, first_logits_max_abs=0.0),
        factor_row("ref-test", 2, first_logits_identical=False, first_argmax_same=True, first_logits_max_abs=0.25),
        factor_row("ref-test", 0, first_logits_identical=False, first_argmax_same=False, first_logits_max_abs=0.5),
        factor_row("ref-test", None),  # the stage ended the answer: nothing read
        factor_row("test-ref", 0, first_logits_identical=False, first_argmax_same=False, first_logits_max_abs=9.0),
    ]
    figures = first_read_figures(read, (("test", "ref"), ("ref", "test"), ("test", "test")))
    assert figures == {
        "cell": "ref-test",
        "converted": False,
        "logits_identical": share(1, 3),
        "argmax_same": share(2, 3),
        "max_abs_difference": 0.5,
    }
    assert first_read_figures(read, (("test", "ref"),)) is None  # a build-only factor reads as the reference


def test_the_card_reads_the_flip_margins():
    def level(name: str, bf16: bool, served: list[dict]) -> dict:
        flips = e6_flip_margins(served, bf16=bf16)
        return {"factor": "batch", "level": name, "applicable": True, "flip_margins": flips}

    summary = {
        "checkpoints": ["tiny"],
        "E1": {
            "checkpoints": {
                "tiny": {
                    "precision": "bf16",
                    "flip_margins": e1_flip_margins([e1_pair(0.0), e1_pair(0.125), e1_pair(0.375)], bf16=True),
                }
            }
        },
        "E6": {
            "levels": [
                level("2", True, [factor_row("test-test", 3, 0.0, 20.0), factor_row("test-test", 0, 0.25, 20.0)]),
                level("4", False, [factor_row("test-test", 1, 0.125, 20.0)]),
                level("8", True, [factor_row("test-test", None)]),  # no flip: not listed
                level("3", False, [factor_row("test-test", 2, 0.5), factor_row("test-test", 0, 0.0)]),  # no top
            ]
        },
    }
    (line,) = flip_margins_reading(summary)
    assert "E1 (BF16), prefill side: 1/3 flips are exact ties and at most 2/3 within one bf16 step" in line
    assert (
        "E6, each test level's served divergences (one per item): batch 2 1/2 within one bf16 step of the"
        " reference's top logit (1/2 exact ties), batch 4 1/1 with a margin at most |top|/128 (0/1 exact ties),"
        " batch 3 1/2 exact ties, median margin 0.25 logits (top-1 minus top-2 log-probability; no top logit to"
        " scale it)."
    ) in line
    assert "batch 8" not in line


# A factor table as E6 wrote it before the logit columns (and so before the run column too), and as it wrote
# it after the logit columns, before the run column.
BEFORE_LOGITS = pa.schema([f for f in FACTOR_SCHEMA if f.name not in (*FACTOR_LOGIT_COLUMNS, "run")])
BEFORE_RUNS = pa.schema([f for f in FACTOR_SCHEMA if f.name != "run"])


def test_a_factor_table_without_the_logit_columns_gets_one_line_naming_its_migration(tmp_path):
    root = tmp_path / "ledger"
    for relative in ("tables/factors.parquet", "runs/factor/a/0.parquet", "runs/factor/b/0.parquet"):
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(BEFORE_LOGITS.empty_table(), path)
    pq.write_table(BEFORE_RUNS.empty_table(), root / "runs" / "factor" / "a" / "1.parquet")
    write_table([], FACTOR_SCHEMA, root / "runs" / "factor" / "c" / "0.parquet")  # today's: no fault
    report = Report()
    verify_tables(root, report)
    assert sorted(str(fault) for fault in report.faults) == [
        "runs/factor/a/1.parquet: written before E6 recorded the run of a cell under load (no run): only the"
        " factor jobs compute them — migrate it: rerun snakemake --forcerun factor (the factor jobs rewrite every"
        " E6 row with them; gathering, summary.json and the card follow)",
        "tables/factors.parquet and 2 more factor tables: written before E6 recorded the first read and the"
        " margins at divergence and the run of a cell under load (no " + ", ".join(FACTOR_LOGIT_COLUMNS) + ", run):"
        " only the factor jobs compute them — migrate it: rerun snakemake --forcerun factor (the factor jobs"
        " rewrite every E6 row with them; gathering, summary.json and the card follow)",
    ]


@pytest.mark.parametrize("columns", [FACTOR_LOGIT_COLUMNS[:1], ()])
def test_a_factor_table_of_another_shape_is_not_taken_for_the_old_one(tmp_path, columns):
    schema = pa.schema([f for f in FACTOR_SCHEMA if f.name not in FACTOR_LOGIT_COLUMNS or f.name in columns])
    schema = schema if columns else pa.schema([*schema, ("stray", pa.int32())])
    path = tmp_path / "tables" / "factors.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(schema.empty_table(), path)
    report = Report()
    verify_tables(tmp_path, report)
    assert [fault.problem for fault in report.faults] == [
        "unreadable Parquet, or not the schema of its place in the ledger"
    ]


@pytest.mark.parametrize(
    ("schema", "recorded"),
    [(BEFORE_LOGITS, "the first read and the margins at divergence and the run"), (BEFORE_RUNS, "the run")],
)
def test_reading_an_older_factor_table_names_its_migration(tmp_path, schema, recorded):
    pq.write_table(schema.empty_table(), tmp_path / "factors.parquet")
    with pytest.raises(
        LedgerError, match=f"written before E6 recorded {recorded} .* rerun snakemake --forcerun factor"
    ):
        read_table(tmp_path / "factors.parquet", FACTOR_SCHEMA)
