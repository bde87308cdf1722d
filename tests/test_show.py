"""`stagereplay show LEDGER ITEM_ID` on a real finished run: the item's two suffixes with the divergence marked,
the margins there, both labelings and the transplant outcomes, all as the ledger tables hold them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer
from workflow_helpers import stagereplay

from stagereplay.inputs.checkpoints import read_model_record
from stagereplay.ledger.layout import LedgerLayout
from stagereplay.ledger.text import spelling
from stagereplay.report.item_view import visible

pytestmark = pytest.mark.slow


def e1_pairs(ledger):
    rows = pq.read_table(ledger / "tables" / "comparisons.parquet").to_pylist()
    return [r for r in rows if r["experiment"] == "E1" and r["relation"] == "construction"]


def test_show_prints_the_item_as_the_ledger_holds_it(test_run):
    _, ledger, _ = test_run
    pairs = e1_pairs(ledger)
    divergent = [r for r in pairs if r["suffix_differs"]]
    assert divergent, "config/test.yaml is meant to diverge on some items"
    trajectories = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    transplants = pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(
        read_model_record(ledger / "models" / "tiny-qwen2" / "model.json")["folder"]
    )
    for pair in pairs:
        result = stagereplay("show", ledger, pair["item_id"])
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert out.startswith(f"item {pair['item_id']} (tiny-qwen2, E1 live vs prefill, {pair['precision']})")
        at = pair["first_divergence"]
        sides = {
            r["construction"]: r
            for r in trajectories
            if r["item_id"] == pair["item_id"]
            and r["construction"] in ("live", "prefill")
            and r["precision"] == pair["precision"]
            and r["replica"] == 0
            and r["prefix_precision"] == pair["precision"]
        }
        for side, row in sides.items():
            tokens = [visible(spelling(tokenizer, token)) for token in row["suffix_tokens"]]
            if at is not None:
                tokens[at] = f"⟦{tokens[at]}⟧"
            line = next(line for line in out.splitlines() if line.startswith(f"{side} "))
            assert line.endswith(": " + "".join(tokens)), line
            assert ("⟦" in line) == (at is not None)
            readout = "correct" if row["readout_correct"] else "wrong"
            assert f"readout {row['readout_answer']} ({readout}, letter margin {row['readout_margin']:.4g})" in out
        if at is None:
            assert "suffixes agree" in out
        else:
            n = max(len(row["suffix_tokens"]) for row in sides.values())
            assert f"first divergence at suffix token {at} (of {n});" in out
            assert f"live {pair['a_margin_at_divergence']:.4g}, prefill {pair['b_margin_at_divergence']:.4g}" in out
        moved = [t for t in transplants if t["item_id"] == pair["item_id"]]
        for t in moved:
            assert f"  {t['selection']}: {t['donor']} -> {t['recipient']} [{t['subset']}]: {t['outcome']}" in out
        assert (f"transplants ({len(moved)}:" in out) if moved else ("transplants: none for this item" in out)


def test_an_unknown_item_is_one_line_naming_where_the_ids_are(test_run):
    _, ledger, _ = test_run
    result = stagereplay("show", ledger, "no-such-item")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "item 'no-such-item' is not in" in lines[0] and str(ledger / "items.jsonl") in lines[0]
    first = sorted(r["item_id"] for r in e1_pairs(ledger))[0]
    assert first in lines[0]


def test_control_characters_are_shown_not_obeyed():
    # A random model emits such bytes: a record separator would split a terminal line, a tab vanish.
    assert visible("a\x1eb\n\tc\u2028 d") == "a‹U+001E›b↵⇥c‹U+2028› d"


# Runs one CLI command in this interpreter, then reports which engines the command imported: transformers,
# llama_cpp, or the module of any engine class the registry names (the torch-free specs do not count: the
# design reads them without loading an engine).
LOADED_ENGINES = (
    "import json, sys; from stagereplay.cli import main; code = main(sys.argv[1:]);"
    " from stagereplay.engines.registry import SPECS;"
    " classes = {spec.engine_class_path.split(':')[0] for spec in SPECS.values()};"
    " engines = sorted(m for m in sys.modules if m in ('transformers', 'llama_cpp') or m in classes);"
    " print(json.dumps({'code': code, 'engines': engines}), file=sys.stderr)"
)


def engines_loaded_by(*args) -> list[str]:
    result = subprocess.run([sys.executable, "-c", LOADED_ENGINES, *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stderr.strip().splitlines()[-1])
    assert report["code"] == 0, result.stderr
    return report["engines"]


def test_show_and_the_report_spell_tokens_without_loading_an_engine(test_run, tmp_path):
    """They read the prompts job's vocabulary table: no tokenizer, no transformers, no llama_cpp is imported."""
    _, ledger, config = test_run
    item = sorted(r["item_id"] for r in e1_pairs(ledger))[0]
    assert engines_loaded_by("show", ledger, item) == []

    layout, copy = LedgerLayout(ledger), LedgerLayout(tmp_path)  # the card and plots laid out as the workflow's
    names = json.loads(Path(layout.summary).read_text())["checkpoints"]
    per_checkpoint = []
    for name in names:
        per_checkpoint += ["--model", name, layout.model_record(name), "--vocab", name, layout.vocab(name)]
    report = [
        *("report", "--summary", layout.summary, "--items", layout.items, "--item-source", item_source(config)),
        *("--trajectories", layout.table("trajectories"), "--comparisons", layout.table("comparisons")),
        *("--transplants", layout.table("transplants"), *per_checkpoint),
        *("--card", copy.card, "--card-html", copy.card_html, "--plots-dir", Path(copy.card_html).parent),
    ]
    assert engines_loaded_by(*report) == []
    # The same card as the workflow's report rule wrote, per-item view and spelled tokens included.
    assert Path(copy.card).read_text() == Path(layout.card).read_text()


def item_source(config: Path) -> str:
    from stagereplay.design.schema import load_config

    return load_config(config)["items"]["source"]  # the schema's default where the config names none
