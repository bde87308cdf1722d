"""E6 (factors): the cells, verdicts and config checks, end to end on the tiny random model.

The run extends a copy of the session's finished test ledger with a factors block, so it also shows
that adding E6 schedules only its own jobs. Cells are checked against independent computations: a
level equal to the reference must give bit-identical caches and ``none`` everywhere, a chunked or
prefix-reused build must equal the cache built directly with the model, and the batched build must
equal a batch the test feeds through the model itself.
"""

from __future__ import annotations

import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, DynamicCache
from workflow_helpers import copy_run, job_counts, snakemake, stagereplay

from stagereplay.audit.rerun import audit_factors
from stagereplay.design.factors import FactorError, check_levels
from stagereplay.engines.registry import SPECS, spec_named
from stagereplay.experiments.kernel_worker import onednn_isa
from stagereplay.inputs.checkpoints import read_model_record
from stagereplay.ledger.fingerprint import fingerprint_cache
from stagereplay.ledger.kvstate import KVState
from stagereplay.ledger.store import ObjectStore
from stagereplay.report.stamp import stamp

pytestmark = pytest.mark.slow

# The CPU kernel level torch picks on this machine is the kernels factor's reference (it differs between
# machines, so it is read here, never written down); "default" runs on every x86-64 CPU.
OWN_KERNELS = torch.backends.cpu.get_cpu_capability().lower()
MKL = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "unpinned")  # the control leaves MKL as this process has it
FACTORS = {
    "kernels": ["default"],
    "threads": [1, 2],  # 1 is the reference: a known answer, and this factor's control (listed, so run once)
    "attention": ["eager", "flash_attention_2"],  # flash_attention_2 is not installed here: not applicable
    "chunk": [5],
    "prefix_reuse": ["prompt", "block:16"],
    "batch": [1, 3],  # 1 is the reference computed through the batched path (the control, listed)
}
# The control levels the workflow adds: each factor's reference setting through its test machinery.
ADDED_CONTROLS = {"kernels": "own", "attention": "sdpa", "chunk": "whole", "prefix_reuse": "whole"}


@pytest.fixture(scope="module")
def factor_run(test_run, tmp_path_factory):
    workdir, _, _ = test_run
    ledger, config = copy_run(workdir, tmp_path_factory.mktemp("factors") / "run")
    data = yaml.safe_load(config.read_text())
    data["factors"] = FACTORS
    config.write_text(yaml.safe_dump(data))
    dry = snakemake(ledger.parent, config, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    result = snakemake(ledger.parent, config)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = pq.read_table(ledger / "tables" / "factors.parquet").to_pylist()
    return ledger, config, rows, job_counts(dry)


def _rows(rows, factor, level, cell=None):
    return [r for r in rows if r["factor"] == factor and r["level"] == level and (cell is None or r["cell"] == cell)]


def _references(ledger):
    trajectories = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    return {
        r["item_id"]: r
        for r in trajectories
        if r["construction"] == "prefill" and r["replica"] == 0 and r["precision"] == r["prefix_precision"] == "bf16"
    }


def test_adding_factors_schedules_only_their_jobs(factor_run):
    _, _, _, counts = factor_run
    # one shard per level, the added controls among them
    assert counts["factor"] == sum(len(levels) for levels in FACTORS.values()) + len(ADDED_CONTROLS)
    for rule in ("live", "rebuild", "transplant", "compare"):
        assert rule not in counts


def test_a_level_equal_to_the_reference_gives_none_with_identical_caches(factor_run):
    ledger, _, rows, _ = factor_run
    references = _references(ledger)
    summary = json.loads((ledger / "summary.json").read_text())["E6"]
    for factor, level in (("threads", "1"), ("batch", "1"), ("kernels", "own"), ("attention", "sdpa")):
        cells = _rows(rows, factor, level)
        assert len(cells) == 3 * len(references)
        for row in cells:
            assert row["cache_digest"] == references[row["item_id"]]["cache_object"]
            assert row["suffix_object"] == references[row["item_id"]]["suffix_object"]
            assert row["cache_differs"] is False
        figures = next(f for f in summary["levels"] if (f["factor"], f["level"]) == (factor, level))
        assert figures["verdicts"]["none"]["count"] == len(references)
        assert figures["caches_differ"]["count"] == 0


def test_every_control_reproduces_the_reference_and_the_card_says_so(factor_run):
    ledger, _, rows, _ = factor_run
    references = _references(ledger)
    controls = json.loads((ledger / "summary.json").read_text())["E6"]["controls"]
    assert (controls["paths"], controls["identical"], controls["without_control"]) == (6, 6, [])
    assert {(c["factor"], c["level"]) for c in controls["levels"]} == {
        *ADDED_CONTROLS.items(),
        ("threads", "1"),
        ("batch", "1"),
    }
    for factor, level in ADDED_CONTROLS.items():
        cells = [r for r in _rows(rows, factor, level) if r["applicable"]]
        assert len({r["item_id"] for r in cells}) == len(references), factor
        for row in cells:
            assert row["cache_digest"] == references[row["item_id"]]["cache_object"], factor
            assert row["suffix_object"] == references[row["item_id"]]["suffix_object"], factor
    store = ObjectStore(ledger / "objects")
    for row in _rows(rows, "prefix_reuse", "whole"):  # the whole context went through the store, none on top
        context = len(store.get_tokens(references[row["item_id"]]["prefix_object"])) - 1
        assert row["reused_tokens"] == context and row["reused_digest"] == row["reference_cache"]
    own_notes = {r["setting"] for r in _rows(rows, "kernels", "own", "test-ref")}
    assert own_notes == {
        f"built in the kernels=own worker: ATen {OWN_KERNELS.upper()}, oneDNN {onednn_isa()}, MKL {MKL}"
        f" (ATEN_CPU_CAPABILITY={OWN_KERNELS})"
    }
    card = (ledger / "results.md").read_text()
    assert "6/6 paths identical on every item" in card and card.count("E6 controls") == 1


def test_a_failed_control_stops_the_summary(factor_run, tmp_path):
    """The factor table of the run with the batch control's read side perturbed on one item, as a harness
    that reads a batch otherwise than the reference would leave it."""
    ledger, config, rows, _ = factor_run
    changed = [dict(row) for row in rows]
    target = next(r for r in changed if (r["factor"], r["level"], r["cell"]) == ("batch", "1", "ref-test"))
    target["suffix_object"] = "0" * 32
    table = tmp_path / "factors.parquet"
    pq.write_table(pa.Table.from_pylist(changed, schema=pq.read_schema(ledger / "tables" / "factors.parquet")), table)
    tables = ledger / "tables"
    result = stagereplay(
        "summarize",
        "--trajectories",
        tables / "trajectories.parquet",
        "--comparisons",
        tables / "comparisons.parquet",
        "--factors",
        table,
        "--out",
        tmp_path / "summary.json",
    )
    assert result.returncode != 0 and not (tmp_path / "summary.json").exists()
    assert (
        "E6 control failed: batch 1 (the reference setting through the batch test path) gave another suffix on 1 of"
        in result.stderr
    )
    assert f"({target['item_id']})" in result.stderr and "the E6 harness is broken" in result.stderr


def test_first_reads_and_margins_at_divergence(factor_run):
    """The controls that switch nothing read the reference's bytes into the reference's first logits, bit for
    bit (batch 1 is left out: its padding path may round otherwise and still give the reference's tokens); every
    cell of the kernels worker brought its first logits back; every divergent cell names the reference's margin
    from its E2 row and a top logit; and summary.json and the card carry them."""
    ledger, _, rows, _ = factor_run
    references = _references(ledger)
    summary = json.loads((ledger / "summary.json").read_text())["E6"]
    ran = [r for r in rows if r["applicable"] and references[r["item_id"]]["boundary_reason"] != "eos"]
    for factor, level in (("threads", "1"), ("kernels", "own"), ("attention", "sdpa")):
        cells = [r for r in ran if (r["factor"], r["level"]) == (factor, level)]
        assert cells and all(r["first_logits_identical"] and r["first_logits_max_abs"] == 0.0 for r in cells), factor
        figures = next(f for f in summary["levels"] if (f["factor"], f["level"]) == (factor, level))
        read = figures["first_read"]
        assert read["logits_identical"]["count"] == read["argmax_same"]["count"] == read["logits_identical"]["n"] > 0
        assert read["max_abs_difference"] == 0.0 and read["converted"] is False
    assert all(r["first_logits_max_abs"] is not None for r in ran if r["factor"] == "kernels")
    for row in ran:
        step = row["first_divergence"]
        margins = [row[c] for c in ("margin_at_divergence", "reference_margin_at_divergence")]
        if step is None:
            assert margins == [None, None] and row["reference_top_logit_at_divergence"] is None
            continue
        reference_margins = references[row["item_id"]]["suffix_margins"]
        assert row["reference_margin_at_divergence"] == reference_margins[step]
        assert row["reference_top_logit_at_divergence"] is not None and row["margin_at_divergence"] is not None
    assert all(f["first_read"] is None for f in summary["levels"] if f["applicable"] and f["cells"] == ["test-ref"])
    # Per level only (levels repeat items and flips): at most one flip per item whose served suffix differs.
    assert all(
        f["flip_margins"]["flips"] <= f["suffixes_differ"]["count"] for f in summary["levels"] if f["applicable"]
    )
    assert "E6 first read (ref-test's first step against the reference's" in (ledger / "results.md").read_text()


def test_build_only_factors_have_two_cells(factor_run):
    _, _, rows, _ = factor_run
    for factor in ("chunk", "prefix_reuse"):
        assert {r["cell"] for r in rows if r["factor"] == factor} == {"test-ref"}
    assert {r["cell"] for r in _rows(rows, "attention", "eager")} == {"test-ref", "ref-test", "test-test"}


def test_chunked_and_reused_builds_equal_the_model_built_directly(factor_run, test_run):
    ledger, _, rows, _ = factor_run
    record = read_model_record(ledger / "models" / "tiny-qwen2" / "model.json")
    model = AutoModelForCausalLM.from_pretrained(record["folder"], dtype=torch.bfloat16, attn_implementation="sdpa")
    store = ObjectStore(ledger / "objects")
    references = _references(ledger)
    for item_id, reference in references.items():
        context = store.get_tokens(reference["prefix_object"])[:-1]

        def built(pieces):
            cache = DynamicCache(config=model.config)
            with torch.inference_mode():
                for piece in pieces:
                    model(input_ids=torch.tensor([piece]), cache=cache, use_cache=True)
            return fingerprint_cache(
                KVState(tuple(layer.keys for layer in cache.layers), tuple(layer.values for layer in cache.layers))
            ).digest

        chunked = _rows(rows, "chunk", "5", "test-ref")
        (row,) = [r for r in chunked if r["item_id"] == item_id]
        assert row["cache_digest"] == built([context[i : i + 5] for i in range(0, len(context), 5)])
        # the build's positions and the continuation's (pending token, then all but the last token)
        assert row["forward_positions"] == len(context) + len(row["suffix_tokens"])
        (hit,) = [r for r in _rows(rows, "prefix_reuse", "prompt") if r["item_id"] == item_id]
        assert hit["reused_tokens"] == reference["prompt_length"]
        k = hit["reused_tokens"]
        assert hit["cache_digest"] == built([context[:k], context[k:]])
        (block,) = [r for r in _rows(rows, "prefix_reuse", "block-16") if r["item_id"] == item_id]
        assert block["reused_tokens"] == len(context) // 16 * 16 > 0


def test_batched_build_is_the_items_row_of_a_left_padded_batch(factor_run):
    ledger, _, rows, _ = factor_run
    record = read_model_record(ledger / "models" / "tiny-qwen2" / "model.json")
    model = AutoModelForCausalLM.from_pretrained(record["folder"], dtype=torch.bfloat16, attn_implementation="sdpa")
    store = ObjectStore(ledger / "objects")
    contexts = {i: store.get_tokens(r["prefix_object"])[:-1] for i, r in _references(ledger).items()}
    for row in _rows(rows, "batch", "3", "test-ref"):
        members = [row["item_id"], *row["companions"]]
        assert len(members) == 3 and len(set(members)) == 3
        width = max(len(contexts[m]) for m in members)
        ids = torch.zeros(3, width, dtype=torch.long)
        mask = torch.zeros(3, width, dtype=torch.long)
        for index, member in enumerate(members):
            ids[index, width - len(contexts[member]) :] = torch.tensor(contexts[member])
            mask[index, width - len(contexts[member]) :] = 1
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache)
        start = width - len(contexts[row["item_id"]])
        state = KVState(
            tuple(layer.keys[:1, :, start:] for layer in cache.layers),
            tuple(layer.values[:1, :, start:] for layer in cache.layers),
        )
        assert row["cache_digest"] == fingerprint_cache(state).digest
        # three padded rows built, then the item alone continued at batch 1 (the reference read)
        assert row["forward_positions"] == 3 * width + len(row["suffix_tokens"])


def test_default_kernels_run_in_a_process_of_their_own(factor_run):
    _, _, rows, _ = factor_run
    cells = _rows(rows, "kernels", "default")
    assert cells and all(r["reference_level"] == OWN_KERNELS for r in cells)
    pinned = "ATEN_CPU_CAPABILITY=default, ONEDNN_MAX_CPU_ISA=SSE41, MKL_ENABLE_INSTRUCTIONS=SSE4_2"
    assert {r["setting"] for r in cells if r["build"] == "test"} == {
        f"built in the kernels=default worker: ATen DEFAULT, oneDNN Intel SSE4.1, MKL SSE4_2 ({pinned})"
    }
    if OWN_KERNELS != "default":  # scalar kernels reduce in another order than vector ones (seen in every cache)
        assert any(r["cache_differs"] for r in cells if r["build"] == "test")


def test_flash_attention_without_its_package_is_not_applicable(factor_run):
    ledger, _, rows, _ = factor_run
    cells = _rows(rows, "attention", "flash_attention_2")
    assert cells and all(not r["applicable"] and "FlashAttention2" in r["reason"] for r in cells)
    summary = json.loads((ledger / "summary.json").read_text())["E6"]
    figures = next(f for f in summary["levels"] if f["level"] == "flash_attention_2")
    assert figures["applicable"] is False and "verdicts" not in figures


def test_the_card_reads_each_level_from_the_summary(factor_run):
    ledger, _, rows, _ = factor_run
    card = (ledger / "results.md").read_text()
    summary = json.loads((ledger / "summary.json").read_text())["E6"]
    assert "## E6: where divergence enters, per factor level" in card
    assert (ledger / "report" / "factor_verdicts.png").stat().st_size > 0
    for level in summary["levels"]:
        name = f"E6 {level['factor']} {level['level']} (reference {level['reference_level']})"
        if not level["applicable"]:
            assert f"{name}: not applicable here" in card
            continue
        differ = level["suffixes_differ"]
        assert f"{name}: " in card and f"suffixes differ on {differ['count']}/{differ['n']}" in card
    # the per-item view: one row per item and level that ran
    ran = {(r["factor"], r["level"], r["item_id"]) for r in rows if r["applicable"]}
    assert card.count("| arith-") >= len(ran)


def test_show_prints_the_items_cells(factor_run):
    ledger, _, rows, _ = factor_run
    result = stagereplay("show", ledger, "arith-000")
    assert result.returncode == 0, result.stderr
    ran = sorted({f"{r['factor']} {r['level']}" for r in rows if r["applicable"] and r["item_id"] == "arith-000"})
    assert "E6 factors (item arith-000)" in result.stdout
    for level in ran:
        assert f"  {level}: " in result.stdout
    # Each level's first read and each divergent cell's margins, as the rows recorded them.
    mine = [r for r in rows if r["applicable"] and r["item_id"] == "arith-000"]
    for row in mine:
        if row["cell"] == "ref-test" and row["first_logits_identical"] is not None:
            first = "logits bit-identical" if row["first_logits_identical"] else "max |Δlogit| "
            assert f"  {row['factor']} {row['level']}: " in result.stdout
            assert any(
                line.startswith(f"  {row['factor']} {row['level']}: ") and f"first read: {first}" in line
                for line in result.stdout.splitlines()
            )
    margins = [r for r in mine if r["margin_at_divergence"] is not None]
    assert all(f"cell {r['margin_at_divergence']:.3g})" in result.stdout for r in margins)


def test_verify_recomputes_e6_from_the_tables(factor_run, tmp_path):
    ledger, config, _, _ = factor_run
    assert stagereplay("verify", ledger).returncode == 0
    copy, _ = copy_run(ledger.parent, tmp_path / "copy")
    summary_path = copy / "summary.json"
    summary = json.loads(summary_path.read_text())
    level = next(f for f in summary["E6"]["levels"] if f["factor"] == "chunk")
    level["verdicts"]["write"]["count"] += 1
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    result = stagereplay("verify", copy)
    assert result.returncode != 0
    assert "E6.levels" in result.stdout + result.stderr


def test_a_summary_of_the_old_e6_shape_gets_one_line_naming_its_migration(factor_run, tmp_path):
    """A ledger whose summary.json was written before the verdicts were served first: verify names the cause and
    the command once (not the first key that differs), and that command makes the ledger verify."""
    ledger, _, _, _ = factor_run
    copy, config = copy_run(ledger.parent, tmp_path / "old")
    path = copy / "summary.json"
    summary = json.loads(path.read_text())
    for level in summary["E6"]["levels"]:
        if level["applicable"]:
            del level["served_cell"], level["differing_cells"], level["verdicts"]["latent"]
    old = (json.dumps(summary, indent=2) + "\n").encode()
    path.write_bytes(old)
    # The cards an old run drew carry the stamp of its summary.json.
    for card in (copy / "results.md", copy / "report" / "results.html"):
        card.write_text(stamp(card.read_text().rsplit("<!-- stagereplay stamp:", 1)[0], old))
    result = stagereplay("verify", copy)
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if line.startswith("stagereplay: fault:")] == [
        "stagereplay: fault: summary.json: its E6 levels are in the shape written before the verdicts were served"
        " first (no cell patterns, no verdict latent): they count an item write, read or both whenever a one-sided"
        " cell differs, even where the served suffix does not — migrate it: rerun snakemake --forcerun summary"
        " report (it rewrites summary.json and the card from the tables)"
    ], result.stderr
    migrated = snakemake(copy.parent, config, "--forcerun", "summary", "report")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    assert stagereplay("verify", copy).returncode == 0
    assert json.loads(path.read_text()) == json.loads((ledger / "summary.json").read_text())


def test_the_audit_names_a_cell_that_does_not_reproduce(factor_run):
    ledger, _, rows, _ = factor_run
    saved = pq.read_table(ledger / "tables" / "factors.parquet")
    assert all(check.reproduced for check in audit_factors(saved, saved))
    changed = [dict(row) for row in rows]
    target = next(row for row in changed if row["applicable"] and row["cell"] == "ref-test")
    target["suffix_tokens"] = target["suffix_tokens"][:-1] + [target["suffix_tokens"][-1] + 1]
    target["suffix_object"] = "0" * 32
    failed = [c for c in audit_factors(saved, pa.Table.from_pylist(changed, schema=saved.schema)) if not c.reproduced]
    assert [(c.artifact, c.item_id) for c in failed] == [("factor_suffix", target["item_id"])]
    assert failed[0].side == f"{target['factor']}={target['level']} ref-test"


@pytest.mark.parametrize(
    ("factors", "engine", "flags", "needle"),
    [
        ({"speed": [1]}, "transformers", None, "unknown factor 'speed' — use one of prefix_reuse"),
        ({"batch": [9]}, "transformers", None, "a batch of 9 needs 9 items, the run has 4 — use at most 4"),
        (
            {"kernels": ["avx2"]},
            "llamacpp",
            None,
            "not supported on the llamacpp engine — run it on a checkpoint of the transformers engine",
        ),
        (
            {"flash_attn": ["off"]},
            "transformers",
            None,
            "not supported on the transformers engine — run it on a checkpoint of the llamacpp, llamaserver engine",
        ),
        ({"prefix_reuse": ["half"]}, "transformers", None, "use prompt (the cached prompt), block:N"),
        ({"kernels": ["avx512"]}, "transformers", frozenset({"avx2", "fma"}), "lacks avx512f"),
        ({"attention": ["flash"]}, "transformers", None, "use sdpa, eager, flash_attention_2"),
        ({"chunk": [0]}, "transformers", None, "is not a positive integer"),
        ({"prefix_reuse": ["block:64"]}, "transformers", None, "shortest prompt (12 tokens), so a hit could reuse"),
    ],
)
def test_bad_levels_get_one_line(factors, engine, flags, needle):
    with pytest.raises(FactorError, match=re.escape(needle)):
        check_levels(factors, spec_named(engine), 4, 12, flags, engines=SPECS.values())


def test_cpu_settings_are_refused_on_a_gpu_run():
    with pytest.raises(FactorError, match="factors.kernels: sets how the CPU computes, but runtime.device is cuda"):
        check_levels({"kernels": ["default"]}, spec_named("transformers"), 4, 12, frozenset({"avx2"}), "cuda")


def test_a_bad_factor_stops_snakemake_before_any_job(factor_run, tmp_path):
    ledger, config, _, _ = factor_run
    data = yaml.safe_load(config.read_text())
    data["factors"] = {"batch": [2, 16]}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    result = snakemake(ledger.parent, bad, "-n")
    assert result.returncode != 0
    assert "factors.batch: a batch of 16 needs 16 items, the run has 4 — use at most 4" in result.stdout + result.stderr
