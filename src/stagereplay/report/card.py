"""The results card: every figure of a run in the paper's terms, its provenance, and a plain reading.

The card is rendered, never typed and never computed: its figures, their Wilson
95% intervals and E1's paired tests are read from summary.json (itself computed
from the ledger tables); every interval names the method that produced it. The
reading is generated in reading.py, the Markdown and HTML written in render.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from stagereplay.design.factors import is_control
from stagereplay.engines.registry import SPECS
from stagereplay.ledger.atomic import atomic_write_text
from stagereplay.ledger.environment import ENVIRONMENT_TITLES
from stagereplay.report.card_provenance import Provenance
from stagereplay.report.controls import controls_card_row
from stagereplay.report.factor_view import factor_item_blocks
from stagereplay.report.figures import NOT_MEASURED, Figure, all_figures, factor_blocks
from stagereplay.report.item_view import ItemRecord
from stagereplay.report.reading import AUDIT_HOW, reading
from stagereplay.report.render import to_html, to_markdown
from stagereplay.report.served_view import served_blocks, verdict_blocks
from stagereplay.report.stamp import stamp
from stagereplay.report.text import level_name, percent, under_load_text

# --- provenance and the document ----------------------------------------------------------


ENVIRONMENT_COLUMNS = [
    ("checkpoint", "checkpoint"),
    ("precision", "precision"),
    *(entry for entry in ENVIRONMENT_TITLES if entry[0] != "precision"),
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


# The paper's figure for the same design, as its abstract (arXiv 2607.28495) states it, beside each
# experiment's answer on the card's first panel. What the abstract does not state is marked inferred: it
# says "a Qwen2.5-derived system" and "200 items" (GPQA is inferred from its references, a model size from
# its 48 K/V layers; neither is shown), and "FP32 produces no decoded disagreement" over "all 200 token
# states" (0/200 is inferred from the two).
PAPER_FIGURES = {
    "E1": "166 of 200 suffixes differ (BF16); replicas remain exact",
    "E2": "FP32: no decoded disagreement (Wilson 95% upper bound 1.88%; 0/200 inferred)",
    "E3": "12/12 rows bit-exact",
    "E4": "every retained trajectory and comparison fingerprint reproduced (all 200)",
    "E5": "24/24 selected divergent continuations follow the donor (all 48 K/V layers, primary checkpoint)",
    "E5 outcome-blind": "43/43 at a later checkpoint",
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
    rows.append(e4_panel(summary.get("E4")))
    rows += e5_panel(summary.get("E5"), primary)
    e6 = summary.get("E6")
    if e6 is not None:
        # The controls have their own line: each must reproduce the reference, so none counts as a finding.
        ran = [level for level in e6["levels"] if level["applicable"] and not _is_control(level)]
        changed = [f"{level_name(level)}" for level in ran if level["suffixes_differ"]["count"]]
        rows.append(
            [
                "E6 factors",
                "test levels whose suffixes differ from the reference (controls apart; per level: the E6 table)",
                f"{len(changed)} of {len(ran)} test levels run" + (f" ({', '.join(changed)})" if changed else ""),
                "beyond the paper",
            ]
        )
        controls = controls_card_row(e6)
        if controls:
            rows.append(controls)
    return rows


E4_FIGURE = "the audit's status, its worst-reproduced artifact kind, trajectories and items reproduced"
# e4.json files written before the audit named its worst artifact kind (audit.reproduction.worst_artifact).
E4_REWRITE = "snakemake --cores N --config mode=audit --forcerun audit_ledger"


def e4_panel(e4: dict | None) -> list[str]:
    """E4's row: the audit's status and the artifact kind it reproduced least, before any count over
    trajectories, which can read 40/40 while E6's caches reproduce 56/72 (all from e4.json)."""
    if e4 is None:
        return ["E4 audit", E4_FIGURE, f"not run yet ({AUDIT_HOW})", PAPER_FIGURES["E4"]]
    if "worst_artifact" not in e4:
        worst = f"worst artifact kind not recorded in this e4.json ({E4_REWRITE} rewrites it)"
    elif e4["worst_artifact"] is None:
        worst = "no artifact audited"
    elif e4["worst_artifact"]["count"] == e4["worst_artifact"]["n"]:
        worst = f"every artifact kind in full ({len(e4['artifacts'])} kinds)"
    else:
        entry = e4["worst_artifact"]
        worst = f"worst {entry['artifact']} {_counted(entry)}"
    mismatches = len(e4.get("mismatches", [])) + e4.get("mismatches_not_listed", 0)
    parts = [
        f"{e4['status']}: {worst}",
        f"trajectories {_counted(e4['trajectories'])}",
        f"items {_counted(e4['items'])}",
    ]
    if mismatches:
        parts.append(f"{mismatches} mismatch(es)")
    if e4.get("under_load"):
        parts.append(under_load_text(e4["under_load"]))
    return ["E4 audit", E4_FIGURE, "; ".join(parts), PAPER_FIGURES["E4"]]


def e5_panel(e5: dict | None, primary: str) -> list[list[str]]:
    """E5's rows of the panel, counted over items (both directions of an item are one observation). The
    outcome-blind sample sits beside the paper's replication only when it ran on another checkpoint, as the
    paper's did (a later one); on the primary checkpoint it is a repeat on a seeded sample, and says so."""
    # The unit beside the paper's: its figures count continuations (24/24, 43/43), these count items.
    figure = "divergent items whose continuation follows the donor cache both ways (all layers)"
    unit = "unit: items, an item's two directions one observation; the paper's unit: continuations"
    if e5 is None:
        return [["E5 transplant", figure, "not run (transplant.enabled is false)", PAPER_FIGURES["E5"]]]
    rows = []
    for key, counted in e5["all_layers"].items():
        selection, checkpoint = key.split("/", 1)
        items = _counted(counted["items_follow_donor_both_ways"])
        if selection == "selected":
            rows.append(["E5 transplant", f"{figure}, selected; {unit}", items, PAPER_FIGURES["E5"]])
        elif checkpoint == primary:
            rows.append(
                [
                    "E5 outcome-blind",
                    f"{figure}, a seeded sample at the same checkpoint; {unit}",
                    items,
                    "not comparable: the paper's replication is at a later checkpoint",
                ]
            )
        else:
            rows.append(
                [
                    "E5 outcome-blind",
                    f"{figure}, at checkpoint {checkpoint}; {unit}",
                    items,
                    PAPER_FIGURES["E5 outcome-blind"],
                ]
            )
    return rows or [["E5 transplant", figure, "no divergent item to transplant", PAPER_FIGURES["E5"]]]


def _is_control(level: dict) -> bool:
    return is_control(level["factor"], level["level"], level["reference_level"])


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


def attached_note(model: dict) -> str:
    """Of a checkpoint run on someone else's server: which server, and how its model was proven to be the GGUF."""
    if "attach" not in model:
        return ""
    server = model["server"]
    return (
        f"; run on the llama-server attached at {model['attach']['url']} (slot {model['attach']['slot']}, build"
        f" {server['build']}, never started or restarted by the run): {model['model_check']}"
    )


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
                    + attached_note(model)
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
    blocks = blocks[:after_reading] + factor_blocks(summary) + served_blocks(summary) + blocks[after_reading:]
    # The operator's answer opens the card, right after its introduction, where a run served requests.
    return blocks[:2] + verdict_blocks(summary) + blocks[2:]


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
