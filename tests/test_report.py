"""The findings report from a real run of the workflow on config/test.yaml: card, plots, Snakemake report."""

from __future__ import annotations

import base64
import json
import math
import re
import statistics
import struct
import subprocess
import sys
from collections import defaultdict

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import xxhash
import yaml
from scipy import stats
from workflow_helpers import REPO, snakemake

from stagereplay.audit.reproduction import e4_summary
from stagereplay.inputs.checkpoints import read_model_record
from stagereplay.ledger.environment import ENVIRONMENT_COLUMNS
from stagereplay.ledger.tables import COMPARISON_SCHEMA, TRAJECTORY_SCHEMA, read_table
from stagereplay.report.card import E4_FIGURE, write_results_card
from stagereplay.report.card_provenance import provenance
from stagereplay.report.figures import OVERLAP_METHOD
from stagereplay.report.plots import PLOT_FILES, plot_transplant_follow_donor
from stagereplay.report.stats import (
    mcnemar_exact,
    paired_difference_ci,
    paired_difference_newcombe,
    paired_difference_wald,
)
from stagereplay.report.summary import summary as summarize

pytestmark = pytest.mark.slow

WILSON = "Wilson score 95%"


@pytest.fixture(scope="module")
def completed(test_run):
    return test_run


def card_sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = defaultdict(list)
    current = ""
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:]
        elif line.strip():
            sections[current].append(line)
    return sections


def card_figures(text: str) -> dict[tuple[str, str, str], tuple[str, str, str]]:
    """(experiment, figure, method) -> (count, estimate, interval), parsed from the card's tables, one per
    experiment under "Figures, per experiment" (each past its header and rule)."""
    rows = [
        line
        for line in card_sections(text)["Figures, per experiment"]
        if line.startswith("|") and not line.startswith(("| Experiment |", "|---"))
    ]
    parsed = {}
    for line in rows:
        experiment, figure, count, estimate, interval, method = (cell.strip() for cell in line.strip("|").split(" | "))
        key = (experiment, figure, method)
        assert key not in parsed, f"duplicate card row {key}"
        parsed[key] = (count, estimate, interval)
    return parsed


# --- the expected figures, recomputed from the Parquet tables without the card's code ----------


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def points(fraction: float) -> str:
    return f"{100 * fraction:+.1f}"


def wilson(k: int, n: int) -> tuple[float, float]:
    z = stats.norm.ppf(0.975)
    p = k / n
    centre = (2 * n * p + z**2) / (2 * (n + z**2))
    half = z * math.sqrt(z**2 + 4 * n * p * (1 - p)) / (2 * (n + z**2))
    return max(0.0, centre - half), min(1.0, centre + half)


def proportion(k: int, n: int) -> tuple[str, str, str]:
    if n == 0:
        return ("0/0", "—", "—")
    low, high = wilson(k, n)
    return (f"{k}/{n}", percent(k / n), f"[{percent(low)}, {percent(high)}]")


def expected_e1(comparisons: list[dict]) -> dict:
    rows = sorted(
        (r for r in comparisons if r["experiment"] == "E1" and r["relation"] == "construction"),
        key=lambda r: r["item_id"],
    )
    name, n = f"E1 matched ({rows[0]['precision']})", len(rows)
    counted = {
        "suffixes that differ, live vs prefill": sum(r["suffix_differs"] for r in rows),
        "boundary caches that differ": sum(not r["cache_exact"] for r in rows),
        "unparsable answers, live (parsed)": sum(not r["a_parsed"] for r in rows),
        "unparsable answers, prefill (parsed)": sum(not r["b_parsed"] for r in rows),
        "stages that ended at EOS before the boundary (nothing continued: their suffixes agree)": sum(
            r["boundary_reason"] == "eos" for r in rows
        ),
    }
    labelings = {"parsed": ("a_correct", "b_correct"), "readout": ("a_readout_correct", "b_readout_correct")}
    for labeling, (a, b) in labelings.items():
        counted[f"correctness labels that differ ({labeling})"] = sum(r[a] != r[b] for r in rows)
        counted[f"accuracy, live ({labeling})"] = sum(r[a] for r in rows)
        counted[f"accuracy, prefill ({labeling})"] = sum(r[b] for r in rows)
    assert counted["correctness labels that differ (parsed)"] == sum(r["label_differs"] for r in rows)
    expected = {(name, figure, WILSON): proportion(count, n) for figure, count in counted.items()}
    for side in ("live", "prefill"):
        replicas = [
            r
            for r in comparisons
            if r["experiment"] == "E1" and r["relation"] == "replica" and r["a"].startswith(side + "/")
        ]
        expected[(name, f"exact replicas, {side}", WILSON)] = proportion(
            sum(r["trajectory_exact"] for r in replicas), len(replicas)
        )
    for labeling, (a, b) in labelings.items():
        live, prefill = [r[a] for r in rows], [r[b] for r in rows]
        counts = f"({sum(live)} − {sum(prefill)})/{n}"
        label = f"accuracy difference, live − prefill ({labeling})"
        for method, (difference, low, high) in (
            ("paired percentile bootstrap, 10000 resamples, seed 0", paired_difference_ci(live, prefill)),
            ("Newcombe hybrid score 95% (1998, method 10)", paired_difference_newcombe(live, prefill)),
            ("Wald 95% for paired proportions", paired_difference_wald(live, prefill)),
        ):
            expected[(name, label, method)] = (
                counts,
                f"{points(difference)} pts",
                f"[{points(low)}, {points(high)}] pts",
            )
        live_only = sum(a and not b for a, b in zip(live, prefill))
        prefill_only = sum(b and not a for a, b in zip(live, prefill))
        p_value = stats.binomtest(live_only, live_only + prefill_only).pvalue if live_only + prefill_only else 1.0
        assert mcnemar_exact(live, prefill)[2] == pytest.approx(p_value)
        expected[
            (
                name,
                f"equal accuracy (discordant pairs live-only : prefill-only) ({labeling})",
                "exact McNemar (two-sided binomial test on the discordant pairs)",
            )
        ] = (f"{live_only} : {prefill_only}", f"p = {p_value:.3f} (uncorrected)", "—")
    return expected


def expected_e2_e3(comparisons: list[dict]) -> dict:
    expected = {}
    arms = defaultdict(list)
    for r in comparisons:
        if r["experiment"] in ("E2", "E3") and r["relation"] == "construction":
            arms[(r["experiment"], r["precision"], r["b"].split("/")[0])].append(r)
    for (experiment, precision, other), rows in arms.items():
        n = len(rows)
        if experiment == "E2":
            name = f"E2 fixed_prefix ({precision})"
            divergent = [r["first_divergence"] for r in rows if r["suffix_differs"]]
            expected[(name, f"decoded disagreements, incremental vs {other}", WILSON)] = proportion(len(divergent), n)
            expected[(name, f"labels that differ, incremental vs {other}", WILSON)] = proportion(
                sum(r["label_differs"] for r in rows), n
            )
            expected[(name, f"caches that differ, incremental vs {other}", WILSON)] = proportion(
                sum(not r["cache_exact"] for r in rows), n
            )
            if divergent:
                expected[
                    (
                        name,
                        f"median first divergent position, incremental vs {other}",
                        "median over the divergent suffixes",
                    )
                ] = (f"{len(divergent)} divergent", f"token {statistics.median(divergent):g}", "—")
        else:
            name = f"E3 bridge ({precision})"
            expected[(name, "caches bit-exact, incremental vs live", WILSON)] = proportion(
                sum(r["cache_exact"] for r in rows), n
            )
            expected[(name, "suffixes identical, incremental vs live", WILSON)] = proportion(
                sum(not r["suffix_differs"] for r in rows), n
            )
    # fp32's live-vs-prefill differences set item by item beside bf16's, E1's precision (the card's overlap rows).
    e1_precision = next(r["precision"] for r in comparisons if r["experiment"] == "E1")
    prefill = {
        (p, r["item_id"]): r for (e, p, other), group in arms.items() if (e, other) == ("E2", "prefill") for r in group
    }
    for precision in sorted({p for p, _ in prefill} - {e1_precision}):
        items = sorted(item for p, item in prefill if p == precision)
        for what, differs in (("caches", lambda r: not r["cache_exact"]), ("suffixes", lambda r: r["suffix_differs"])):
            pairs = [(differs(prefill[e1_precision, item]), differs(prefill[precision, item])) for item in items]
            key = (
                f"E2 fixed_prefix ({precision})",
                f"live vs prefill {what} differ here and at E1's precision, item by item",
                OVERLAP_METHOD,
            )
            expected[key] = (
                f"{len(items)} items",
                f"both {pairs.count((True, True))}, only E1's {pairs.count((True, False))},"
                f" only this {pairs.count((False, True))}, neither {pairs.count((False, False))}",
                "—",
            )
    return expected


def expected_e5(transplants: list[dict]) -> dict:
    name = "E5 transplant"
    rows = [r for r in transplants if r["divergent"]]
    follows = lambda group: sum(r["outcome"] == "follows_donor" for r in group)  # noqa: E731
    expected = {}
    for selection in ("selected", "outcome_blind"):
        for checkpoint in sorted({r["checkpoint"] for r in rows if r["selection"] == selection}):
            chosen = [
                r
                for r in rows
                if r["selection"] == selection
                and r["checkpoint"] == checkpoint
                and r["kv"] == "kv"
                and r["last_positions"] is None
                and len(r["layers"]) == len(r["layer_k"])
            ]
            key = f"all layers, {selection}/{checkpoint}"
            # Over items: an item counts once, when every direction it was transplanted follows the donor.
            items = sorted({r["item_id"] for r in chosen})
            both_ways = sum(all(r["outcome"] == "follows_donor" for r in chosen if r["item_id"] == i) for i in items)
            expected[(name, f"{key}: items that follow the donor both ways", WILSON)] = proportion(
                both_ways, len(items)
            )
            for outcome, label in (
                ("follows_donor", "follow the donor"),
                ("follows_recipient", "follow the recipient"),
                ("neither", "follow neither"),
            ):
                count = sum(r["outcome"] == outcome for r in chosen)
                expected[(name, f"{key}: {label}", WILSON)] = proportion(count, len(chosen))
            for direction in sorted({f"{r['donor']} -> {r['recipient']}" for r in chosen}):
                group = [r for r in chosen if f"{r['donor']} -> {r['recipient']}" == direction]
                expected[(name, f"{key}, {direction}: follow the donor", WILSON)] = proportion(
                    follows(group), len(group)
                )
    for subset in sorted({r["subset"] for r in rows if r["selection"] == "selected"}):
        group = [r for r in rows if r["selection"] == "selected" and r["subset"] == subset]
        expected[(name, f"sweep {subset}: follow the donor", WILSON)] = proportion(follows(group), len(group))
    cross = [r for r in transplants if r["selection"] == "cross_precision"]
    for precision in sorted({r["precision"] for r in cross}):
        by_item = defaultdict(list)
        for r in cross:
            if r["precision"] == precision:
                by_item[r["item_id"]].append(r["suffix_tokens"])
        differ = sum(a != b for a, b in by_item.values())
        expected[
            (
                name,
                f"cross precision, at {precision}: continuations from the cast live and cast prefill caches"
                " differ (the divergence survives the cast)",
                WILSON,
            )
        ] = proportion(differ, len(by_item))
    for direction in sorted({f"{r['donor']} -> {r['recipient']}" for r in rows if r["selection"] == "cross_precision"}):
        group = [
            r for r in rows if r["selection"] == "cross_precision" and f"{r['donor']} -> {r['recipient']}" == direction
        ]
        expected[
            (
                name,
                f"cross precision {direction}: follow the donor's own suffix (decoded at the donor's precision,"
                " so this mixes the cache with the precision)",
                WILSON,
            )
        ] = proportion(follows(group), len(group))
    return expected or {
        (name, "all layers: follow the donor", "no divergent item to transplant (counted on divergent items only)"): (
            "0/0",
            "—",
            "—",
        )
    }


# --- the tests ---------------------------------------------------------------------------------


def test_every_card_number_matches_the_ledger_tables(completed):
    _, ledger, _ = completed
    comparisons = pq.read_table(ledger / "tables" / "comparisons.parquet").to_pylist()
    transplants = pq.read_table(ledger / "tables" / "transplants.parquet").to_pylist()
    expected = {
        **expected_e1(comparisons),
        **expected_e2_e3(comparisons),
        **expected_e5(transplants),
        ("E4 audit", "not run", "snakemake --cores N --config mode=audit"): ("—", "—", "—"),
    }
    card = card_figures((ledger / "results.md").read_text())
    assert set(card) == set(expected)  # every row accounted for, none missing
    for key, value in expected.items():
        assert card[key] == value, key


def test_card_provenance_names_the_model_items_and_environment(completed):
    workdir, ledger, _ = completed
    text = (ledger / "results.md").read_text()
    provenance_lines = "\n".join(card_sections(text)["Provenance"])
    trajectories = pq.read_table(ledger / "tables" / "trajectories.parquet").to_pylist()
    record = json.loads((ledger / "models" / "tiny-qwen2" / "model.json").read_text())
    assert {r["model_fingerprint"] for r in trajectories} == {record["fingerprint"]}
    assert f"model `tiny-qwen2`: source random_qwen2, fingerprint {record['fingerprint']}" in provenance_lines
    items = (ledger / "items.jsonl").read_bytes()
    assert f"items: {len(items.splitlines())} from `data/items.jsonl`" in provenance_lines
    assert xxhash.xxh3_128(items).hexdigest() in provenance_lines
    assert f"precisions: {', '.join(sorted({r['precision'] for r in trajectories}))}" in provenance_lines
    for r in trajectories:
        # The environment columns in the schema's order (the engine's last), between the side and the model.
        cells = [r["checkpoint"], r["precision"], *(r[name] for name in ENVIRONMENT_COLUMNS), r["model_fingerprint"]]
        row = "| " + " | ".join(str(cell) for cell in cells) + " |"
        assert row in provenance_lines


def test_card_reading_follows_the_numbers(completed):
    _, ledger, _ = completed
    reading = "\n".join(
        card_sections((ledger / "results.md").read_text())["Reading: what this run shows and does not show"]
    )
    summary = json.loads((ledger / "summary.json").read_text())
    for precision, arms in summary["E2"]["checkpoints"]["tiny-qwen2"]["precisions"].items():
        counted = arms["incremental_vs_prefill"]["decoded_disagreements"]
        k, n = counted["count"], counted["n"]
        assert f"{precision.upper()} arm: {k}/{n} decoded disagreements, incremental vs prefill" in reading
        if k == 0:
            high = percent(wilson(0, n)[1])
            assert (
                f"Wilson 95% upper bound {high}: consistent with none, and rates up to {high} are not ruled out by"
                f" {n} items" in reading
            )
    assert "E4 audit: not run (snakemake --cores N --config mode=audit)" in reading
    assert "randomly initialised" in reading  # the test model's accuracy means nothing, and the card says so


def test_nothing_is_claimed_from_zero_replicas(completed, tmp_path):
    """matched.replicas: 1 leaves no replica pair: the card says not measured, never 'deterministic'."""
    _, ledger, _ = completed
    comparisons = read_table(ledger / "tables" / "comparisons.parquet", COMPARISON_SCHEMA)
    one_replica = comparisons.filter(pc.not_equal(comparisons["relation"], "replica"))
    trajectories = read_table(ledger / "tables" / "trajectories.parquet", TRAJECTORY_SCHEMA)
    summary = summarize(one_replica, trajectories, "test")
    replicas = summary["E1"]["checkpoints"]["tiny-qwen2"]["replicas_exact"]
    assert replicas["live"] == {"count": 0, "n": 0, "rate": None, "wilson95": [None, None], "measured": False}
    records = {"tiny-qwen2": read_model_record(ledger / "models" / "tiny-qwen2" / "model.json")}
    prov = provenance(summary, "data/items.jsonl", ledger / "items.jsonl", records)
    card = write_results_card(summary, prov, tmp_path / "results.md").read_text()
    figures = card_figures(card)
    for side in ("live", "prefill"):
        assert figures[("E1 matched (bf16)", f"exact replicas, {side}", "no observations (n = 0)")] == (
            "0/0",
            "not measured",
            "—",
        )
    assert "deterministic, so any difference" not in card
    assert "Replicas of live and prefill: not measured (one run per side)" in card


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def test_every_plot_is_written(completed):
    _, ledger, _ = completed
    for name in PLOT_FILES.values():
        width, height = png_size(ledger / "report" / name)
        assert width >= 600 and height >= 400, name


def test_plots_and_card_degrade_when_an_experiment_is_missing(completed, tmp_path):
    """Without E5 (transplant.enabled: false) the plot still exists and says so; with E4 the card shows it."""
    _, ledger, _ = completed
    with_e5 = ledger / "report" / PLOT_FILES["transplant_follow_donor"]
    without = plot_transplant_follow_donor(None, tmp_path / "no-e5.png")
    assert min(png_size(without)) >= 400 and without.read_bytes() != with_e5.read_bytes()

    summary = json.loads((ledger / "summary.json").read_text())
    del summary["E5"]
    # E4 as the audit computes it: 36 trajectories' caches and suffixes, one suffix not reproduced.
    audit = [
        {
            "kind": "trajectory",
            "artifact": artifact,
            "checkpoint": "tiny-qwen2",
            "item_id": f"arith-{index // 2:03d}",
            "side": ("live", "prefill")[index % 2],
            "reproduced": not (artifact == "suffix" and index == 0),
            "environment_differs": False,
            **dict.fromkeys(("saved", "audited", "first_differing_layer", "first_differing_position", "detail")),
            "environment": None,
        }
        for index in range(36)
        for artifact in ("kv_cache", "suffix")
    ]
    summary["E4"] = e4_summary(audit)
    records = {"tiny-qwen2": read_model_record(ledger / "models" / "tiny-qwen2" / "model.json")}
    prov = provenance(summary, "data/items.jsonl", ledger / "items.jsonl", records)
    card = write_results_card(summary, prov, tmp_path / "results.md").read_text()
    figures = card_figures(card)
    assert figures[("E4 audit", "trajectories reproduced from the saved ledger", WILSON)] == proportion(35, 36)
    assert figures[("E4 audit", "kv_cache fingerprints reproduced", WILSON)] == proportion(36, 36)
    assert figures[("E4 audit", "suffix fingerprints reproduced", WILSON)] == proportion(35, 36)
    assert figures[("E5 transplant", "not run", "transplant.enabled is false in the config")] == ("—", "—", "—")
    assert (
        "E4 audit: differences found; 35/36 trajectories and 17/18 items reproduced from the saved ledger; the"
        " worst-reproduced artifact kind is suffix, 35/36; 1 mismatch(es) recorded." in card
    )
    assert "| E4 audit | " + E4_FIGURE + " | differences found: worst suffix 35/36 (97.2%); trajectories" in card


def test_long_jobs_log_a_final_progress_line_with_items_and_tokens_per_second(completed):
    _, ledger, config = completed
    # Only the run's own checkpoints: the shared ledger also holds the logs of jobs the
    # bad-input catalogue made fail on purpose, which end with their one-line error.
    checkpoints = set(yaml.safe_load(config.read_text())["checkpoints"])
    logs = [
        path
        for kind in ("live", "rebuild", "transplant")
        for path in (ledger / "logs" / kind).rglob("*.log")
        if checkpoints & set(path.relative_to(ledger / "logs" / kind).parts)
    ]
    assert len(logs) >= 10
    for path in logs:
        # tqdm redraws with carriage returns and closes with a newline: the last redraw is the final state.
        final = [line for line in path.read_text().replace("\r", "\n").splitlines() if line.strip()][-1]
        # tqdm shows the rate as item/s, or s/item when an item takes longer than a second (a busy machine).
        assert re.search(r"(item/s|s/item), tok_s=\d+\.\d\]$", final), (path, final)
        counted = re.search(r"\| (\d+)/(\d+) \[", final) or re.search(
            r": (\d+)item \[", final
        )  # all done, or nothing to do
        assert counted and counted.group(1) == counted.groups()[-1], (path, final)


def plain_phrase(rst: str, length: int = 6) -> str:
    """The first run of words free of markup and punctuation that HTML rendering could change."""
    words = rst.split()
    for start in range(len(words) - length):
        window = words[start : start + length]
        if all(word.isalnum() for word in window):
            return " ".join(window)
    raise AssertionError(f"no plain phrase in {rst[:80]!r}")


def test_snakemake_report_bundles_the_card_and_plots_with_captions(completed):
    workdir, ledger, config = completed
    result = snakemake(workdir, config, "--report", "report.html")
    assert result.returncode == 0, result.stderr[-3000:]
    html = " ".join((workdir / "report.html").read_text().split())
    captions = sorted((REPO / "workflow" / "report").glob("*.rst"))
    assert {path.stem for path in captions} == {"workflow", "results_card", *PLOT_FILES}
    for caption in captions:
        phrase = plain_phrase(caption.read_text())
        assert phrase in html, (caption.name, phrase)
    for name in ["results.html", *PLOT_FILES.values()]:
        assert name in html, name
    # The card travels whole, per-item view included: the report embeds the very bytes of results.html.
    embedded = re.search(r"data:text/html;charset=utf8;filename=results\.html;base64,([A-Za-z0-9+/=]+)", html)
    assert embedded, "results.html is not embedded in the snakemake report"
    card = base64.b64decode(embedded.group(1))
    assert card == (ledger / "report" / "results.html").read_bytes()
    items = {json.loads(line)["id"] for line in (ledger / "items.jsonl").read_text().splitlines()}
    assert set(re.findall(r'class="item-entry[^"]*" [^>]*data-item="([^"]+)"', card.decode())) == items


def test_report_without_a_summary_stops_with_one_line_naming_the_fix(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagereplay",
            "report",
            "--summary",
            str(tmp_path / "summary.json"),
            "--trajectories",
            "t.parquet",
            "--comparisons",
            "c.parquet",
            "--model",
            "m",
            "m.json",
            "--vocab",
            "m",
            "v.parquet",
            "--items",
            "i.jsonl",
            "--item-source",
            "data/items.jsonl",
            "--card",
            str(tmp_path / "results.md"),
            "--plots-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "summary.json not found — run snakemake" in lines[0], result.stderr
    assert not (tmp_path / "results.md").exists()


def test_the_reading_claims_no_smaller_layer_set_only_when_one_was_tried():
    from stagereplay.report.reading import sweep_reading

    def entry(subset, layers, kv="kv", positions=None, followed=4):
        return {
            "subset": subset,
            "layers": layers,
            "kv": kv,
            "positions": positions,
            "follows_donor": {"count": followed, "n": 4, "rate": followed / 4},
        }

    full = entry("layers=0-29 kv=kv positions=all", 30)
    # Only all layers transplanted (config/all200.yaml): nothing was compared with a smaller set.
    assert sweep_reading({"sweep": [full], "smallest_sufficient_layer_set": full["subset"]}) == []
    half = entry("layers=0-14 kv=kv positions=all", 15, followed=1)
    lines = sweep_reading({"sweep": [full, half], "smallest_sufficient_layer_set": full["subset"]})
    assert lines[0].startswith("Only the full cache (layers=0-29 kv=kv positions=all)")
    assert "layers=0-14 kv=kv positions=all comes closest: 1/4 follow the donor" in lines[1]
