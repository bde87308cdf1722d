"""The results card: every figure of a run in the paper's terms, its provenance, and a plain reading.

The card is rendered, never typed and never computed: its figures, their Wilson
95% intervals and E1's paired tests are read from summary.json (itself computed
from the ledger tables); every interval names the method that produced it. The
reading is generated in reading.py, the Markdown and HTML written in render.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from stagereplay.atomic import atomic_write_text
from stagereplay.design.factors import VERDICTS
from stagereplay.engines.registry import SPECS
from stagereplay.report.factor_view import factor_item_blocks
from stagereplay.report.item_view import ItemRecord
from stagereplay.report.provenance import Provenance
from stagereplay.report.reading import AUDIT_HOW, reading
from stagereplay.report.render import to_html, to_markdown
from stagereplay.report.stamp import stamp
from stagereplay.report.text import experiment_name, percent, points

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


def proportion(experiment: str, figure: str, counted: dict) -> Figure:
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


def e1_figures(summary: dict) -> list[Figure]:
    figures = []
    for checkpoint, e1 in summary["E1"]["checkpoints"].items():
        name = experiment_name("E1 matched", e1["precision"], checkpoint, summary)
        figures += [
            proportion(name, "suffixes that differ, live vs prefill", e1["suffixes_differ"]),
            proportion(name, "boundary caches that differ", e1["caches_differ"]),
        ]
        for key, labeling in e1["labelings"].items():
            label = LABELING_NAMES[key]
            figures += [
                proportion(name, f"correctness labels that differ ({label})", labeling["labels_differ"]),
                proportion(name, f"accuracy, live ({label})", labeling["accuracy"]["live"]),
                proportion(name, f"accuracy, prefill ({label})", labeling["accuracy"]["prefill"]),
            ]
            if key == "parsed":  # the readout always yields a letter: only the parsed labeling has unparsable answers
                figures += [
                    proportion(name, "unparsable answers, live (parsed)", e1["unparsable"]["live"]),
                    proportion(name, "unparsable answers, prefill (parsed)", e1["unparsable"]["prefill"]),
                ]
        for side in ("live", "prefill"):
            figures.append(proportion(name, f"exact replicas, {side}", e1["replicas_exact"][side]))
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
            f"p = {mcnemar['p_value']:.3f}",
            "—",
            mcnemar["method"],
        )
    )
    return figures


# --- E2, E3 -----------------------------------------------------------------------------


def e2_figures(summary: dict) -> list[Figure]:
    figures = []
    for checkpoint, e2 in summary["E2"]["checkpoints"].items():
        for precision, arms in e2["precisions"].items():
            name = experiment_name("E2 fixed_prefix", precision, checkpoint, summary)
            for arm, figure in arms.items():
                other = arm.removeprefix("incremental_vs_")
                counted = figure["decoded_disagreements"]
                figures += [
                    proportion(name, f"decoded disagreements, incremental vs {other}", counted),
                    proportion(name, f"labels that differ, incremental vs {other}", figure["labels_differ"]),
                    proportion(name, f"caches that differ, incremental vs {other}", figure["caches_differ"]),
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
    return figures or [not_run("E2 fixed_prefix", "no fixed_prefix.precisions in the config")]


def e3_figures(summary: dict) -> list[Figure]:
    figures = []
    for checkpoint, e3 in summary["E3"]["checkpoints"].items():
        for precision, figure in e3["precisions"].items():
            name = experiment_name("E3 bridge", precision, checkpoint, summary)
            figures += [
                proportion(name, "caches bit-exact, incremental vs live", figure["bit_exact"]),
                proportion(name, "suffixes identical, incremental vs live", figure["suffixes_identical"]),
            ]
    return figures or [not_run("E3 bridge", "no fixed_prefix.precisions in the config")]


# --- E4, E5 (optional: present only when their rules ran) --------------------------------


def e4_figures(e4: dict | None) -> list[Figure]:
    if e4 is None:
        return [not_run("E4 audit", AUDIT_HOW)]
    name = "E4 audit"
    figures = [proportion(name, "trajectories reproduced from the saved ledger", e4["trajectories"])]
    for kind, counted in sorted(e4.get("artifacts", {}).items()):
        figures.append(proportion(name, f"{kind} fingerprints reproduced", counted))
    return figures


def e5_figures(e5: dict | None) -> list[Figure]:
    if e5 is None:
        return [not_run("E5 transplant", "transplant.enabled is false in the config")]
    name = "E5 transplant"
    figures = []
    for key, figure in e5["all_layers"].items():
        figures.append(proportion(name, f"all layers, {key}: follow the donor", figure["follows_donor"]))
        figures.append(proportion(name, f"all layers, {key}: follow the recipient", figure["follows_recipient"]))
        figures.append(proportion(name, f"all layers, {key}: follow neither", figure["neither"]))
        for direction, counted in figure["by_direction"].items():
            figures.append(proportion(name, f"all layers, {key}, {direction}: follow the donor", counted))
    for entry in e5["sweep"]:
        figures.append(proportion(name, f"sweep {entry['subset']}: follow the donor", entry["follows_donor"]))
    cross = e5["cross_precision"]
    for precision, counted in cross["divergence_survives_cast"].items():
        figures.append(
            proportion(
                name,
                f"cross precision, at {precision}: continuations from the cast live and cast prefill caches differ"
                " (the divergence survives the cast)",
                counted,
            )
        )
    for direction, counted in cross["follows_donor"].items():
        figures.append(
            proportion(
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


def e6_figures(e6: dict | None) -> list[Figure]:
    if e6 is None:
        return []
    figures = []
    for level in e6["levels"]:
        name = f"E6 factors ({level['factor']} {level['level']}, reference {level['reference_level']})"
        if not level["applicable"]:
            figures.append(Figure(name, "not applicable", "—", "—", "—", level["reason"]))
            continue
        figures.append(proportion(name, "built caches differ from the reference (bytes)", level["caches_differ"]))
        figures.append(proportion(name, "suffixes differ from the reference", level["suffixes_differ"]))
        for verdict, counted in level["verdicts"].items():
            figures.append(proportion(name, f"verdict {verdict}", counted))
    return figures


def all_figures(summary: dict) -> list[Figure]:
    return (
        e1_figures(summary)
        + e2_figures(summary)
        + e3_figures(summary)
        + e4_figures(summary.get("E4"))
        + e5_figures(summary.get("E5"))
        + e6_figures(summary.get("E6"))
    )


FACTOR_COLUMNS = ["Factor", "Level", "Reference", "Cells", "Caches differ", "Suffixes differ", *VERDICTS]


def _with_bounds(counted: dict) -> str:
    low, high = counted["wilson95"]
    return f"{counted['count']}/{counted['n']} [{percent(low)}, {percent(high)}]" if counted["n"] else NOT_MEASURED


def factor_blocks(summary: dict) -> list[tuple]:
    """E6's one table: per factor level, caches and suffixes that differ and each verdict x/N (Wilson 95%)."""
    e6 = summary.get("E6")
    if e6 is None:
        return []
    rows = []
    for level in e6["levels"]:
        head = [level["factor"], level["level"], level["reference_level"], ", ".join(level["cells"])]
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
            " Suffixes differ counts test-test (test-ref for a build-only factor). Verdicts are defined in docs/experiments.md (E6); x/N with Wilson 95% intervals.",
        ),
        ("table", FACTOR_COLUMNS, rows),
    ]


# --- provenance and the document ----------------------------------------------------------


ENVIRONMENT_COLUMNS = [
    ("checkpoint", "checkpoint"),
    ("precision", "precision"),
    ("device", "device"),
    ("device_name", "device name"),
    ("cpu_capability", "CPU kernels"),
    ("threads", "threads"),
    ("attn_implementation", "attention"),
    ("tf32", "TF32"),
    ("bf16_reduced_precision_reduction", "bf16 reduced-precision reduction"),
    ("fp16_reduced_precision_reduction", "fp16 reduced-precision reduction"),
    ("sdpa_backends", "SDPA backends"),
    ("float32_matmul_precision", "fp32 matmul precision"),
    ("deterministic", "deterministic"),
    ("torch_version", "torch version"),
    ("transformers_version", "transformers version"),
    ("engine", "engine"),
    ("engine_version", "engine version"),
    ("engine_build", "engine build"),
    ("model_fingerprint", "model fingerprint"),
]
# The columns every row has, whatever its engine; the others are each engine's own (EngineSpec.environment_fields).
ROW_COLUMNS = ("checkpoint", "model_fingerprint")


def environment_table(entries: list[dict]) -> tuple:
    """The environment of every (checkpoint, precision) as a table: the fields the engines that ran declare, a
    field another engine's row does not have shown as a dash."""

    def fields_of(entry: dict) -> set[str]:
        spec = SPECS.get(entry.get("engine"))
        return set(spec.environment_fields if spec else (key for key, _ in ENVIRONMENT_COLUMNS)) | set(ROW_COLUMNS)

    shown = set().union(*(fields_of(entry) for entry in entries)) if entries else set(ROW_COLUMNS)
    columns = [(key, title) for key, title in ENVIRONMENT_COLUMNS if key in shown]
    rows = [[entry[key] if key in fields_of(entry) else "—" for key, _ in columns] for entry in entries]
    return ("table", [title for _, title in columns], rows)


FIGURE_COLUMNS = ["Experiment", "Figure", "Count / N", "Estimate", "95% interval", "Method"]


# The paper's figure for the same design (200 GPQA items, a Qwen2.5-derived reasoning model, BF16 E1;
# the abstract of arXiv 2607.28495), beside each experiment's answer on the card's first panel.
PAPER_FIGURES = {
    "E1": "166/200 suffixes differ (BF16), replicas exact",
    "E2": "0/200 FP32 decoded disagreements (Wilson 95% upper bound 1.88%)",
    "E3": "12/12 bit-exact",
    "E4": "every retained trajectory and comparison fingerprint reproduced (all 200)",
    "E5": "24/24 selected, 43/43 outcome-blind follow the donor (all 48 layers)",
}
PANEL_COLUMNS = ["Experiment", "The figure that answers it", "This run", "The paper"]


def _counted(counted: dict) -> str:
    return NOT_MEASURED if counted["n"] == 0 else f"{counted['count']}/{counted['n']} ({percent(counted['rate'])})"


def answer_panel(summary: dict) -> list[list[str]]:
    """Per experiment, the one figure that answers it, as summary.json (and e4.json) hold it."""
    primary = summary["checkpoints"][0]
    e1 = summary["E1"]["checkpoints"][primary]
    rows = [
        [
            "E1 matched",
            f"suffixes that differ, live vs prefill ({e1['precision']})",
            _counted(e1["suffixes_differ"]),
            PAPER_FIGURES["E1"],
        ]
    ]
    fp32 = summary["E2"]["checkpoints"].get(primary, {}).get("precisions", {}).get("fp32")
    rows.append(
        [
            "E2 fixed prefix",
            "FP32 decoded disagreements, incremental vs prefill",
            _counted(fp32["incremental_vs_prefill"]["decoded_disagreements"])
            if fp32
            else "not run (fp32 is not in fixed_prefix.precisions)",
            PAPER_FIGURES["E2"],
        ]
    )
    bridge = summary["E3"]["checkpoints"].get(primary, {}).get("precisions", {})
    rows.append(
        [
            "E3 bridge",
            "caches bit-exact, incremental vs live",
            "; ".join(f"{precision}: {_counted(arm['bit_exact'])}" for precision, arm in bridge.items()) or "not run",
            PAPER_FIGURES["E3"],
        ]
    )
    e4 = summary.get("E4")
    rows.append(
        [
            "E4 audit",
            "trajectories reproduced from the saved ledger",
            _counted(e4["trajectories"]) if e4 else f"not run yet ({AUDIT_HOW})",
            PAPER_FIGURES["E4"],
        ]
    )
    e5 = summary.get("E5")
    transplants = (
        "; ".join(f"{key}: {_counted(figure['follows_donor'])}" for key, figure in e5["all_layers"].items())
        if e5
        else "not run (transplant.enabled is false)"
    )
    rows.append(
        [
            "E5 transplant",
            "divergent continuations that follow the donor cache (all layers)",
            transplants or "no divergent item to transplant",
            PAPER_FIGURES["E5"],
        ]
    )
    e6 = summary.get("E6")
    if e6 is not None:
        ran = [level for level in e6["levels"] if level["applicable"]]
        changed = [f"{level['factor']} {level['level']}" for level in ran if level["suffixes_differ"]["count"]]
        rows.append(
            [
                "E6 factors",
                "factor levels whose suffixes differ from the reference (per level: the E6 table)",
                f"{len(changed)} of {len(ran)} levels run" + (f" ({', '.join(changed)})" if changed else ""),
                "beyond the paper",
            ]
        )
    return rows


def grouped_figures(figures: list[Figure]) -> list[tuple]:
    """The detailed figures, one collapsible section per experiment (E1 .. E5), in the card's order."""
    groups: dict[str, list[Figure]] = {}
    for figure in figures:
        groups.setdefault(figure.experiment.split(" ")[0], []).append(figure)
    return [
        (
            "details",
            f"{experiment}: {len(chosen)} figure(s)",
            [
                (
                    "table",
                    FIGURE_COLUMNS,
                    [[f.experiment, f.figure, f.count, f.estimate, f.interval, f.method] for f in chosen],
                )
            ],
        )
        for experiment, chosen in groups.items()
    ]


# The card's blocks, written as Markdown and as HTML by render.py.
def document(
    panel: list[list[str]], figures: list[Figure], prov: Provenance, lines_of_reading: list[str]
) -> list[tuple]:
    return [
        ("heading", 1, "stagereplay results card"),
        (
            "paragraph",
            "Live KV cache versus one-shot prefill of the same tokens. Every number below is computed from"
            " this ledger (summary.json and tables/*.parquet) by `stagereplay report`; nothing is typed in.",
        ),
        ("heading", 2, "The answer, per experiment"),
        ("panel", PANEL_COLUMNS, panel),
        ("heading", 2, "Reading: what this run shows and does not show"),
        ("bullets", lines_of_reading),
        ("heading", 2, "Figures, per experiment"),
        *grouped_figures(figures),
        ("heading", 2, "Provenance"),
        (
            "bullets",
            [
                f"stagereplay {prov.version}",
                f"items: {prov.item_count} from `{prov.item_source}` (normalised items.jsonl, xxh3-128 {prov.item_digest})",
                *[
                    f"model `{model['checkpoint']}`: source {model['source']}, fingerprint {model['fingerprint']}"
                    for model in prov.models
                ],
                f"precisions: {', '.join(sorted({entry['precision'] for entry in prov.environment}))}",
                *[
                    f"`{checkpoint}` ran on {version}: {SPECS[engine].precision_note}"
                    for checkpoint, version, engine in sorted(
                        {
                            (entry["checkpoint"], entry["engine_version"], entry["engine"])
                            for entry in prov.environment
                            if entry.get("engine") in SPECS and SPECS[entry["engine"]].precision_note
                        }
                    )
                ],
            ],
        ),
        environment_table(prov.environment),
    ]


def results_card(summary: dict, prov: Provenance) -> list[tuple]:
    blocks = document(answer_panel(summary), all_figures(summary), prov, reading(summary, prov))
    # E6's table right after the reading, before the detailed figures.
    after_reading = next(
        index for index, block in enumerate(blocks) if block[:3] == ("heading", 2, "Figures, per experiment")
    )
    return blocks[:after_reading] + factor_blocks(summary) + blocks[after_reading:]


# The card's plots (plots.PLOT_FILES), in the order shown, with what each one shows.
PLOT_CAPTIONS = {
    "first_divergence": "First divergent suffix position, per arm and precision",
    "margin_at_divergence": "Top-1 minus top-2 logit margin at the first divergence",
    "layer_cache_difference": "Per-layer boundary-cache difference between constructions",
    "transplant_follow_donor": "E5: fraction of transplants that follow the donor, per layer subset",
    "factor_verdicts": "E6: where divergence enters — items per verdict, per factor level",
    "accuracy": "Accuracy of each side (parsed and readout labelings), Wilson 95%",
}


def plot_blocks(plots: dict[str, Path], card_path: str | Path) -> list[tuple]:
    """The plots as ("image", caption, PNG bytes, path relative to the card) blocks."""
    if not plots:
        return []
    folder = Path(card_path).resolve().parent
    return [("heading", 2, "Plots")] + [
        ("image", PLOT_CAPTIONS.get(name, name), Path(path).read_bytes(), os.path.relpath(Path(path).resolve(), folder))
        for name, path in plots.items()
    ]


def item_blocks(records: list[ItemRecord], summary: dict) -> list[tuple]:
    """The per-item view, one section per checkpoint: its records with their per-layer plots (the counts are
    summary.json's)."""
    from stagereplay.report.plots import item_layer_difference_png

    if not records:
        return []
    blocks: list[tuple] = [("heading", 2, "Per item: where the live and prefill continuations part")]
    for checkpoint in dict.fromkeys(record.checkpoint for record in records):
        chosen = [record for record in records if record.checkpoint == checkpoint]
        differ = summary["E1"]["checkpoints"][checkpoint]["suffixes_differ"]
        blocks.append(
            (
                "paragraph",
                f"E1 live vs prefill ({chosen[0].precision}, checkpoint `{checkpoint}`): {differ['count']}/{differ['n']}"
                " items whose suffixes differ, earliest first divergence first; then the"
                f" {differ['n'] - differ['count']}/{differ['n']} whose suffixes agree. Labels: parsed `Answer: X` and"
                " the forced-choice readout, as in the figures.",
            )
        )
        plots = {
            record.item_id: item_layer_difference_png(
                record.k_max_abs, record.v_max_abs, record.k_mean_abs, record.v_mean_abs
            )
            for record in chosen
            if record.divergent
        }
        blocks.append(("items", chosen, plots))
    return blocks


def write_results_card(
    summary: dict,
    prov: Provenance,
    markdown_path: str | Path,
    html_path: str | Path | None = None,
    summary_bytes: bytes | None = None,
    plots: dict[str, Path] | None = None,
    items: list[ItemRecord] | None = None,
    factor_items: list[list[str]] | None = None,
) -> Path:
    """Both cards, stamped with the summary.json bytes they come from (unstamped without them:
    `stagereplay verify` then says so), so an edited or outdated card is caught. ``plots`` (written
    before) are linked from the Markdown and inlined into the HTML; ``items`` is the per-item view, ``factor_items``
    E6's (factor_view.factor_item_rows)."""
    blocks = results_card(summary, prov) + plot_blocks(plots or {}, markdown_path) + item_blocks(items or [], summary)
    blocks += factor_item_blocks(factor_items or [])

    def stamped(text: str) -> str:
        return text if summary_bytes is None else stamp(text, summary_bytes)

    if html_path is not None:
        atomic_write_text(html_path, stamped(to_html(blocks)))
    return atomic_write_text(markdown_path, stamped(to_markdown(blocks)))
