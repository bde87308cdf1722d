"""The card's figure rows: every x/N of summary.json (and e4.json) as a row with its estimate, its 95%
interval and the method that produced the interval, per experiment, and E6's table per factor level."""

from __future__ import annotations

from dataclasses import dataclass

from stagereplay.design.cells import FULL, VERDICTS, cell_patterns
from stagereplay.report.controls import controls_blocks
from stagereplay.report.placement_rule import placement_blocks
from stagereplay.report.reading import AUDIT_HOW
from stagereplay.report.text import experiment_name, level_name, percent, points

WILSON = "Wilson score 95%"
NOT_RUN = "not run"


@dataclass(frozen=True)
class Figure:
    """One row of the card's table."""

    experiment: str  # "E1 matched (bf16)"
    figure: str  # what is counted, in the paper's terms
    count: str  # "3/4" (or the counts a difference is made of)
    estimate: str  # "75.0%", "+25.0 pts", "p = 1.000"
    interval: str  # "[30.1%, 95.4%]"
    method: str  # how the estimate and interval were computed


NOT_MEASURED = "not measured"


def count_row(experiment: str, figure: str, counted: dict) -> Figure:
    """A row for one x/N of summary.json (count, n, rate, wilson95)."""
    count, n = counted["count"], counted["n"]
    if n == 0:  # nothing was observed: never a success, never a failure
        return Figure(experiment, figure, "0/0", NOT_MEASURED, "—", "no observations (n = 0)")
    low, high = counted["wilson95"]
    return Figure(
        experiment, figure, f"{count}/{n}", percent(counted["rate"]), f"[{percent(low)}, {percent(high)}]", WILSON
    )


def not_run(experiment: str, how: str) -> Figure:
    return Figure(experiment, NOT_RUN, "—", "—", "—", how)


# --- E1 ---------------------------------------------------------------------------------


# The two labelings of summary.json's E1 `labelings`, in its order, as the card names them.
LABELING_NAMES = {"parsed": "parsed", "readout": "readout"}


def e1_rows(summary: dict) -> list[Figure]:
    figures = []
    for checkpoint, e1 in summary["E1"]["checkpoints"].items():
        name = experiment_name("E1 matched", e1["precision"], checkpoint, summary)
        figures += [
            count_row(name, "suffixes that differ, live vs prefill", e1["suffixes_differ"]),
            count_row(name, "boundary caches that differ", e1["caches_differ"]),
        ]
        for key, labeling in e1["labelings"].items():
            label = LABELING_NAMES[key]
            figures += [
                count_row(name, f"correctness labels that differ ({label})", labeling["labels_differ"]),
                count_row(name, f"accuracy, live ({label})", labeling["accuracy"]["live"]),
                count_row(name, f"accuracy, prefill ({label})", labeling["accuracy"]["prefill"]),
            ]
            if key == "parsed":  # the readout always yields a letter: only the parsed labeling has unparsable answers
                figures += [
                    count_row(name, "unparsable answers, live (parsed)", e1["unparsable"]["live"]),
                    count_row(name, "unparsable answers, prefill (parsed)", e1["unparsable"]["prefill"]),
                ]
        for side in ("live", "prefill"):
            figures.append(count_row(name, f"exact replicas, {side}", e1["replicas_exact"][side]))
        figures.append(
            count_row(
                name,
                "stages that ended at EOS before the boundary (nothing continued: their suffixes agree)",
                e1["stage_ended_at_eos"],
            )
        )
        if e1["items"]:
            for key, labeling in e1["labelings"].items():
                figures += paired_figures(name, e1["items"], labeling, LABELING_NAMES[key])
    return figures


def paired_figures(name: str, n: int, labeling: dict, label: str) -> list[Figure]:
    """One labeling's accuracy difference live − prefill by three interval methods, and the exact McNemar test."""
    counted = f"({labeling['accuracy']['live']['count']} − {labeling['accuracy']['prefill']['count']})/{n}"
    figure = f"accuracy difference, live − prefill ({label})"
    paired = labeling["paired_difference"]
    figures = []
    for method in (paired, paired["newcombe"], paired["wald"]):
        low, high = method["ci95"]
        figures.append(
            Figure(
                name,
                figure,
                counted,
                f"{points(method['live_minus_prefill'])} pts",
                f"[{points(low)}, {points(high)}] pts",
                method["method"],
            )
        )
    mcnemar = paired["mcnemar"]
    figures.append(
        Figure(
            name,
            f"equal accuracy (discordant pairs live-only : prefill-only) ({label})",
            f"{mcnemar['live_only_correct']} : {mcnemar['prefill_only_correct']}",
            # One test per labeling and checkpoint, none corrected for the others.
            f"p = {mcnemar['p_value']:.3f} (uncorrected)",
            "—",
            mcnemar["method"],
        )
    )
    return figures


# --- E2, E3 -----------------------------------------------------------------------------


def e2_rows(summary: dict) -> list[Figure]:
    figures = []
    for checkpoint, e2 in summary["E2"]["checkpoints"].items():
        for precision, arms in e2["precisions"].items():
            name = experiment_name("E2 fixed_prefix", precision, checkpoint, summary)
            for arm, figure in arms.items():
                other = arm.removeprefix("incremental_vs_")
                counted = figure["decoded_disagreements"]
                figures += [
                    count_row(name, f"decoded disagreements, incremental vs {other}", counted),
                    count_row(name, f"labels that differ, incremental vs {other}", figure["labels_differ"]),
                    count_row(name, f"caches that differ, incremental vs {other}", figure["caches_differ"]),
                ]
                if figure["median_first_divergence"] is not None:
                    figures.append(
                        Figure(
                            name,
                            f"median first divergent position, incremental vs {other}",
                            f"{counted['count']} divergent",
                            f"token {figure['median_first_divergence']:g}",
                            "—",
                            "median over the divergent suffixes",
                        )
                    )
        figures += overlap_rows(e2, checkpoint, summary)
    return figures or [not_run("E2 fixed_prefix", "no fixed_prefix.precisions in the config")]


OVERLAP_METHOD = "the same E1 prefix at both precisions (incremental is live: E3)"


def overlap_rows(e2: dict, checkpoint: str, summary: dict) -> list[Figure]:
    """Whether another precision's live-vs-prefill differences sit on the E1 precision's items (one row each; the
    first differing layers of the caches that differ in both are in summary.json)."""
    rows = []
    for overlap in e2.get("precision_overlap", []):
        rows.append(
            Figure(
                experiment_name("E2 fixed_prefix", overlap["precision"], checkpoint, summary),
                f"live vs prefill {overlap['what']} differ here and at E1's precision, item by item",
                f"{overlap['items']} items",
                f"both {overlap['both']}, only E1's {overlap['only_e1_precision']},"
                f" only this {overlap['only_this_precision']}, neither {overlap['neither']}",
                "—",
                OVERLAP_METHOD,
            )
        )
    return rows


def e3_rows(summary: dict) -> list[Figure]:
    figures = []
    for checkpoint, e3 in summary["E3"]["checkpoints"].items():
        for precision, figure in e3["precisions"].items():
            name = experiment_name("E3 bridge", precision, checkpoint, summary)
            figures += [
                count_row(name, "caches bit-exact, incremental vs live", figure["bit_exact"]),
                count_row(name, "suffixes identical, incremental vs live", figure["suffixes_identical"]),
            ]
    return figures or [not_run("E3 bridge", "no fixed_prefix.precisions in the config")]


# --- E4, E5 (optional: present only when their rules ran) --------------------------------


def e4_rows(e4: dict | None) -> list[Figure]:
    if e4 is None:
        return [not_run("E4 audit", AUDIT_HOW)]
    name = "E4 audit"
    figures = [count_row(name, "trajectories reproduced from the saved ledger", e4["trajectories"])]
    for kind, counted in sorted(e4.get("artifacts", {}).items()):
        figures.append(count_row(name, f"{kind} fingerprints reproduced", counted))
    return figures


def e5_rows(e5: dict | None) -> list[Figure]:
    if e5 is None:
        return [not_run("E5 transplant", "transplant.enabled is false in the config")]
    name = "E5 transplant"
    figures = []
    for key, figure in e5["all_layers"].items():
        figures.append(
            count_row(
                name,
                f"all layers, {key}: items that follow the donor both ways",
                figure["items_follow_donor_both_ways"],
            )
        )
        figures.append(count_row(name, f"all layers, {key}: follow the donor", figure["follows_donor"]))
        figures.append(count_row(name, f"all layers, {key}: follow the recipient", figure["follows_recipient"]))
        figures.append(count_row(name, f"all layers, {key}: follow neither", figure["neither"]))
        for direction, counted in figure["by_direction"].items():
            figures.append(count_row(name, f"all layers, {key}, {direction}: follow the donor", counted))
    for entry in e5["sweep"]:
        figures.append(count_row(name, f"sweep {entry['subset']}: follow the donor", entry["follows_donor"]))
    cross = e5["cross_precision"]
    for precision, counted in cross["divergence_survives_cast"].items():
        figures.append(
            count_row(
                name,
                f"cross precision, at {precision}: continuations from the cast live and cast prefill caches differ"
                " (the divergence survives the cast)",
                counted,
            )
        )
    for direction, counted in cross["follows_donor"].items():
        figures.append(
            count_row(
                name,
                f"cross precision {direction}: follow the donor's own suffix (decoded at the donor's precision, so"
                " this mixes the cache with the precision)",
                counted,
            )
        )
    return figures or [
        Figure(
            name,
            "all layers: follow the donor",
            "0/0",
            "—",
            "—",
            "no divergent item to transplant (counted on divergent items only)",
        )
    ]


def e6_rows(e6: dict | None) -> list[Figure]:
    if e6 is None:
        return []
    figures = []
    for level in e6["levels"]:
        name = f"E6 factors ({level_name(level)}, reference {level['reference_level']})"
        if not level["applicable"]:
            figures.append(Figure(name, "not applicable", "—", "—", "—", level["reason"]))
            continue
        figures.append(count_row(name, "built caches differ from the reference (bytes)", level["caches_differ"]))
        figures.append(
            count_row(
                name, f"suffixes differ from the reference as served ({level['served_cell']})", level["suffixes_differ"]
            )
        )
        read = level.get("first_read")
        if read:  # the reference cache's bytes read under the level, first step only
            figures.append(
                count_row(name, "first read (ref-test step 0): logits bit-identical", read["logits_identical"])
            )
            figures.append(count_row(name, "first read (ref-test step 0): argmax the same", read["argmax_same"]))
        for pattern, counted in level["differing_cells"].items():
            figures.append(count_row(name, f"cells whose suffix differs: {pattern}", counted))
        for verdict, counted in level["verdicts"].items():
            figures.append(count_row(name, f"verdict {verdict}", counted))
    return figures


def all_figures(summary: dict) -> list[Figure]:
    return (
        e1_rows(summary)
        + e2_rows(summary)
        + e3_rows(summary)
        + e4_rows(summary.get("E4"))
        + e5_rows(summary.get("E5"))
        + e6_rows(summary.get("E6"))
    )


FACTOR_COLUMNS = ["Factor", "Level", "Reference", "Cells", "Caches differ", "Suffixes differ (served)", *VERDICTS]
FULL_PATTERNS = cell_patterns(FULL)
PATTERN_COLUMNS = ["Factor", "Level", *FULL_PATTERNS]


def _with_bounds(counted: dict) -> str:
    low, high = counted["wilson95"]
    return f"{counted['count']}/{counted['n']} [{percent(low)}, {percent(high)}]" if counted["n"] else NOT_MEASURED


def factor_blocks(summary: dict) -> list[tuple]:
    """E6's two tables: per factor level, caches and suffixes that differ and each verdict x/N (Wilson 95%); then,
    for the levels with the full 2x2, each pattern of differing cells x/N (the others' patterns in a sentence)."""
    e6 = summary.get("E6")
    if e6 is None:
        return []
    rows = []
    for level in e6["levels"]:
        head = [level["factor"], _level_column(level), level["reference_level"], ", ".join(level["cells"])]
        if not level["applicable"]:
            rows.append(head + [f"not applicable: {level['reason']}"] + [""] * (len(FACTOR_COLUMNS) - 5))
            continue
        caches = _with_bounds(level["caches_differ"])
        if level["caches_differ"]["count"]:
            caches += f", from layer {level['first_differing_layer']}"
        rows.append(
            head
            + [caches, _with_bounds(level["suffixes_differ"])]
            + [_with_bounds(level["verdicts"][verdict]) for verdict in VERDICTS]
        )
    return [
        ("heading", 2, "E6: where divergence enters, per factor level"),
        (
            "paragraph",
            f"Checkpoint `{e6['checkpoint']}` at {e6['precision']}; the reference cell is {e6['reference']}. Cells"
            " are (build, read): test-ref is the write side, ref-test the read side, test-test the level as a"
            " server runs it; a build-only factor has test-ref alone, a server-only one (rotation) test-test alone."
            " Suffixes differ counts the served cell: test-test (test-ref for a build-only factor). The verdicts"
            " write, read, both and interaction (and served, for a server-only factor) classify only the items"
            " whose served suffix differs; latent counts those where a one-sided cell differs but the served"
            " suffix does not, none those where no cell differs. Verdicts are defined in docs/experiments.md"
            " (E6); x/N with Wilson 95% intervals.",
        ),
        ("table", FACTOR_COLUMNS, rows),
        *load_blocks(e6),
        *placement_blocks(e6),
        *pattern_blocks(e6),
        *controls_blocks(e6),
    ]


def _level_column(level: dict) -> str:
    """The level as the factor tables' Level column shows it: '2', or one run of a level under load, '2 run 1/3'."""
    return level_name(level).removeprefix(f"{level['factor']} ")


LOAD_COLUMNS = [
    "Factor",
    "Level",
    "Runs",
    "Served differently in all R runs",
    "In some of R runs, not others (unstable under load)",
    "In no run",
    "Built cache differs in some runs only",
]


def load_blocks(e6: dict) -> list[tuple]:
    """Per level under load, over its runs (each with fresh companions): the items whose served suffix differs
    in every run, in some runs only (unstable under load) and in none, x/N (Wilson 95%)."""
    levels = e6.get("under_load") or []
    if not levels:
        return []
    rows = [
        [
            level["factor"],
            level["level"],
            str(level["runs"]),
            _with_bounds(level["every_run"]),
            _with_bounds(level["unstable"])
            + (f" ({', '.join(level['unstable_items'])})" if level["unstable_items"] else ""),
            _with_bounds(level["no_run"]),
            _with_bounds(level["cache_unstable"]),
        ]
        for level in levels
    ]
    return [
        ("heading", 3, "E6 under load: the same item over several runs"),
        (
            "paragraph",
            "Nothing pins how far the other requests have got when the item's request arrives, so each level"
            " under load runs every item R times (Runs), each with freshly started companions (load_runs). An"
            " item differs in all R runs, in some of R runs and not others (unstable under load), or in none;"
            " x/N with Wilson 95% intervals. R runs bound the spread from below: an item that differed in none of"
            " R runs, or in all of them, may differ otherwise in a further run.",
        ),
        ("table", LOAD_COLUMNS, rows),
    ]


def pattern_blocks(e6: dict) -> list[tuple]:
    """Per level with the full 2x2, the items of each pattern of differing cells, x/N (Wilson 95%). A build-only or
    server-only level has one cell, its served one, so its two patterns are said in a sentence."""
    ran = [level for level in e6["levels"] if level["applicable"]]
    full = [level for level in ran if tuple(level["differing_cells"]) == FULL_PATTERNS]
    one_cell = [level for level in ran if tuple(level["differing_cells"]) != FULL_PATTERNS]
    blocks: list[tuple] = [("heading", 3, "E6: which cells' suffixes differ, per factor level")]
    if full:
        rows = [
            [level["factor"], _level_column(level)] + [_with_bounds(level["differing_cells"][p]) for p in FULL_PATTERNS]
            for level in full
        ]
        blocks += [
            (
                "paragraph",
                "Each column counts the items on which exactly the cells it names (joined by +) continue"
                " differently from the reference and the level's other cells do not; the first four keep the"
                " served suffix (none, and latent's three), the last four change it (interaction, write, read,"
                " both).",
            ),
            ("table", PATTERN_COLUMNS, rows),
        ]
    if one_cell:
        blocks.append(
            (
                "paragraph",
                "One cell, the served one, so two patterns each: "
                + "; ".join(
                    f"{level_name(level)} ({level['served_cell']} alone): "
                    + ", ".join(f"{p} {_with_bounds(c)}" for p, c in level["differing_cells"].items())
                    for level in one_cell
                )
                + ".",
            )
        )
    return blocks if len(blocks) > 1 else []
