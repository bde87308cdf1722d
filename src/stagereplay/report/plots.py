"""The findings plots: PNG files a reader can follow without the text.

Counts, rates and Wilson intervals are read from summary.json, never computed
here; the tables give only the per-item points a plot draws (first divergences,
margins, per-layer differences). When its experiment has not been run (or
produced nothing to count) the PNG is still written, saying so, so the
workflow's outputs are the same whatever the config runs.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa

from stagereplay.ledger.atomic import atomic_write
from stagereplay.report.text import level_name

# File names are fixed so the Snakefile can name every output at parse time;
# matplotlib itself is imported only when drawing, to keep parsing fast.
PLOT_FILES = {
    "first_divergence": "first_divergence.png",
    "margin_at_divergence": "margin_at_divergence.png",
    "layer_cache_difference": "layer_cache_difference.png",
    "transplant_follow_donor": "transplant_follow_donor.png",
    "factor_verdicts": "factor_verdicts.png",
    "accuracy": "accuracy.png",
}
# E6's verdicts, in the order they are stacked, and their colours: none and latent (the served suffix is the
# reference's) are the quiet ones, so the bars' coloured part is what a server returns differently.
VERDICT_COLOURS = {
    "none": "lightgrey",
    "latent": "tab:gray",
    "write": "tab:orange",
    "read": "tab:blue",
    "both": "tab:purple",
    "interaction": "tab:red",
    "served": "tab:green",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: str | Path) -> Path:
    figure.tight_layout()
    # "tight" grows the canvas to hold legends placed outside the axes, where they hide no data.
    atomic_write(path, lambda temporary: figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight"))
    _pyplot().close(figure)
    return Path(path)


def _message(axes, text: str) -> None:
    """Say in the plot itself why there is nothing to draw."""
    axes.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=11, transform=axes.transAxes)
    axes.set_xticks([])
    axes.set_yticks([])


def side(label: str) -> str:
    """'prefill/fp32/rep0<-bf16' -> 'prefill'."""
    return label.split("/")[0]


def short(label: str) -> str:
    """'prefill/fp32/rep0<-bf16 -> live/bf16/rep0' -> 'prefill/fp32 -> live/bf16' (replica and prefix source dropped)."""
    return re.sub(r"/rep\d+|<-\w+", "", label)


def arm_counts(summary: dict, row: dict) -> tuple[str, str]:
    """How summary.json counts the arm of this comparison row: (its suffixes that differ, its caches), as text."""
    checkpoint, precision = row["checkpoint"], row["precision"]
    if row["experiment"] == "E1":
        e1 = summary["E1"]["checkpoints"][checkpoint]
        suffixes, caches = e1["suffixes_differ"], e1["caches_differ"]
    elif row["experiment"] == "E2":
        arm = summary["E2"]["checkpoints"][checkpoint]["precisions"][precision][
            f"incremental_vs_{row['b'].split('/')[0]}"
        ]
        suffixes, caches = arm["decoded_disagreements"], arm["caches_differ"]
    else:
        e3 = summary["E3"]["checkpoints"][checkpoint]["precisions"][precision]
        identical, exact = e3["suffixes_identical"], e3["bit_exact"]
        return f"{identical['count']}/{identical['n']} identical", f"{exact['count']}/{exact['n']} bit-exact"
    return f"{suffixes['count']}/{suffixes['n']} diverged", f"{caches['count']}/{caches['n']} differ"


def arms(comparisons: pa.Table, experiments: tuple[str, ...]) -> dict[str, list[dict]]:
    """Construction comparisons grouped by arm: 'E2 incremental vs prefill, fp32' -> rows.

    Arms never pool checkpoints (their models may differ even in layer count): with more than
    one checkpoint each arm is named with its checkpoint.
    """
    rows = comparisons.to_pylist()
    several = len({row["checkpoint"] for row in rows}) > 1
    grouped: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["relation"] == "construction" and row["experiment"] in experiments:
            where = f"{row['checkpoint']}: " if several else ""
            grouped[f"{where}{row['experiment']} {side(row['a'])} vs {side(row['b'])}, {row['precision']}"].append(row)
    return dict(sorted(grouped.items()))


def plot_first_divergence(summary: dict, comparisons: pa.Table, out_path: str | Path) -> Path:
    """One row per arm, one dot per divergent item at its first differing suffix token (stacked when tied)."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(9, 4.5))
    grouped = arms(comparisons, ("E1", "E2"))
    positions = {
        arm: [row["first_divergence"] for row in rows if row["suffix_differs"]] for arm, rows in grouped.items()
    }
    axes.set_title("First divergent suffix token, per arm and precision")
    if not grouped:
        _message(axes, "E1 and E2 not run in this ledger")
    elif not any(positions.values()):
        counts = "\n".join(f"{arm}: {arm_counts(summary, rows[0])[0]}" for arm, rows in grouped.items())
        _message(axes, f"No suffix diverged in any arm, so there is no first divergence to place.\n{counts}")
    else:
        for index, values in enumerate(positions.values()):
            seen: dict[int, int] = defaultdict(int)
            stacked = []
            for value in sorted(values):
                stacked.append(index + 0.1 * min(seen[value], 4))  # ties stack upwards, so every item shows
                seen[value] += 1
            axes.scatter(sorted(values), stacked, s=36, alpha=0.8)
        axes.set_yticks(
            range(len(positions)),
            [f"{arm}\n{arm_counts(summary, rows[0])[0]}" for arm, rows in grouped.items()],
            fontsize=8,
        )
        axes.set_ylim(-0.5, len(positions) - 0.2)
        axes.invert_yaxis()
        axes.set_xlim(left=-1)
        axes.set_xlabel("position of the first differing suffix token (0 = first token after the boundary)")
    return _save(figure, out_path)


def plot_margin_at_divergence(comparisons: pa.Table, trajectories: pa.Table, out_path: str | Path) -> Path:
    """Top-1 minus top-2 logit where the suffixes part, against every step's margin at that precision."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4.5))
    grouped = {
        arm: [row for row in rows if row["suffix_differs"]] for arm, rows in arms(comparisons, ("E1", "E2")).items()
    }
    axes.set_title("Logit margin (top-1 minus top-2) at the first divergence")
    if not any(grouped.values()):
        _message(
            axes, "No suffix diverged in E1 or E2 (or neither was run): there is no margin at a divergence to show."
        )
        return _save(figure, out_path)
    every_step: dict[str, list[float]] = defaultdict(list)
    for row in trajectories.to_pylist():
        every_step[row["precision"]].extend(row["suffix_margins"])
    divergent = {arm: rows for arm, rows in grouped.items() if rows}
    for index, rows in enumerate(divergent.values()):
        precision = rows[0]["precision"]
        reference = every_step.get(precision, [])
        if reference:
            axes.boxplot(
                [reference],
                positions=[index],
                widths=0.5,
                showfliers=False,
                boxprops={"color": "0.6"},
                whiskerprops={"color": "0.6"},
                medianprops={"color": "0.4"},
            )
        offsets = np.linspace(-0.12, 0.12, len(rows)) if len(rows) > 1 else np.zeros(1)
        for column, marker, colour in (
            ("a_margin_at_divergence", "o", "tab:blue"),
            ("b_margin_at_divergence", "s", "tab:orange"),
        ):
            axes.scatter(index + offsets, [row[column] for row in rows], marker=marker, color=colour, zorder=3)
    for column, marker, colour, which in (("a", "o", "tab:blue", "first"), ("b", "s", "tab:orange", "second")):
        names = " / ".join(sorted({side(rows[0][column]) for rows in divergent.values()}))
        axes.scatter([], [], marker=marker, color=colour, label=f"at the divergence, {which}-named side ({names})")
    axes.scatter([], [], marker="s", color="0.6", label="every suffix step at that precision (box)")
    axes.set_xticks(
        range(len(divergent)), [f"{arm}\n(n = {len(rows)} divergent)" for arm, rows in divergent.items()], fontsize=8
    )
    axes.set_yscale("symlog", linthresh=0.01)
    axes.set_ylim(bottom=-0.002)  # margins are never negative; 0 is an exact tie
    axes.set_ylabel("logit margin (symlog scale; 0 = tie)")
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    return _save(figure, out_path)


def plot_layer_cache_difference(summary: dict, comparisons: pa.Table, out_path: str | Path) -> Path:
    """Per layer, the largest |difference| between the two constructions' caches, over items, K and V."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    figure, (k_axes, v_axes) = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    grouped = arms(comparisons, ("E1", "E2", "E3"))
    figure.suptitle("Per-layer boundary-cache difference between constructions (max |Δ| over items)")
    if not grouped:
        _message(k_axes, "E1 not run in this ledger")
        _message(v_axes, "E1 not run in this ledger")
        return _save(figure, out_path)
    smallest = min(
        (
            value
            for rows in grouped.values()
            for row in rows
            for value in row["k_max_abs"] + row["v_max_abs"]
            if value > 0
        ),
        default=1e-3,
    )
    styles = {"E1": ("-", "o"), "E2": ("--", "s"), "E3": (":", "^")}
    for axes, column, name in ((k_axes, "k_max_abs", "K"), (v_axes, "v_max_abs", "V")):
        for arm, rows in grouped.items():
            per_layer = np.max(np.array([row[column] for row in rows]), axis=0)
            linestyle, marker = styles.get(rows[0]["experiment"], ("-", "o"))
            hollow = (
                rows[0]["experiment"] == "E1"
            )  # E1 often lies exactly under E2 (live == incremental): keep it visible
            axes.plot(
                range(len(per_layer)),
                per_layer,
                linestyle=linestyle,
                marker=marker,
                alpha=0.8,
                markersize=10 if hollow else 5,
                markerfacecolor="none" if hollow else None,
                label=f"{arm} (caches: {arm_counts(summary, rows[0])[1]})",
            )
        axes.set_yscale("symlog", linthresh=smallest)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_title(name)
        axes.set_xlabel("layer")
    k_axes.set_ylabel("max |Δ| (symlog; 0 = bit-exact)")
    figure.legend(
        *k_axes.get_legend_handles_labels(), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.02), ncol=2
    )
    return _save(figure, out_path)


def plot_transplant_follow_donor(e5: dict | None, out_path: str | Path, transplant_rows: int = 0) -> Path:
    """summary.json's E5 follow-donor x/N, with their Wilson intervals; ``transplant_rows``: the table's rows."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(11, 5.5))
    figure.suptitle("E5: transplanted continuations that follow the donor (divergent items only; x/N per bar)")
    if e5 is None or transplant_rows == 0:
        _message(axes, "E5 not run in this ledger")
        return _save(figure, out_path)
    bars = [(f"all layers, {key}", entry["follows_donor"]) for key, entry in e5["all_layers"].items()]
    bars += [(f"sweep {entry['subset']}", entry["follows_donor"]) for entry in e5["sweep"]]
    bars += [(f"cross precision {short(key)}", entry) for key, entry in e5["cross_precision"]["follows_donor"].items()]
    bars = [bar for bar in bars if bar[1]["n"]]
    if not bars:
        _message(
            axes,
            f"E5 ran ({transplant_rows} transplants), but no item diverged: follow-donor is counted on"
            " divergent items only, so there is nothing to count.",
        )
        return _save(figure, out_path)
    fractions = [counted["rate"] for _, counted in bars]
    errors = np.array(
        [[counted["rate"] - counted["wilson95"][0], counted["wilson95"][1] - counted["rate"]] for _, counted in bars]
    ).T
    rows = range(len(bars))
    axes.barh(rows, fractions, xerr=errors, color="tab:green", alpha=0.7, capsize=3)
    for row, (_, counted) in zip(rows, bars):
        axes.text(1.02, row, f"{counted['count']}/{counted['n']}", va="center", fontsize=8)
    axes.set_yticks(list(rows), [label for label, _ in bars], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlim(0, 1.12)
    axes.set_xlabel("fraction that follows the donor (Wilson 95% interval)")
    return _save(figure, out_path)


def plot_factor_verdicts(e6: dict | None, out_path: str | Path) -> Path:
    """summary.json's E6 verdicts, one stacked bar per factor level: where each item's divergence enters."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(11, 5.5))
    figure.suptitle("E6: where divergence enters, per factor level (items per verdict)")
    levels = [level for level in (e6 or {}).get("levels", []) if level["applicable"]]
    if not levels:
        _message(axes, "E6 not run in this ledger" if not e6 else "E6 ran, but no level could run here")
        return _save(figure, out_path)
    rows = np.arange(len(levels))
    left = np.zeros(len(levels))
    for name, colour in VERDICT_COLOURS.items():
        counts = np.array([level["verdicts"][name]["count"] for level in levels], dtype=float)
        axes.barh(rows, counts, left=left, color=colour, label=name, edgecolor="white")
        left += counts
    for row, level in zip(rows, levels):
        differ = level["caches_differ"]
        axes.text(left[row] + 0.2, row, f"caches differ {differ['count']}/{differ['n']}", va="center", fontsize=8)
    labels = [f"{level_name(level)} (ref {level['reference_level']})" for level in levels]
    axes.set_yticks(list(rows), labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, max(left) * 1.35)
    axes.set_xlabel("items")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="verdict")
    return _save(figure, out_path)


def accuracy_arms(summary: dict) -> dict[str, dict]:
    """summary.json's accuracy of each side of each E1/E2 arm, named and ordered as ``arms`` names them."""
    several = len(summary["checkpoints"]) > 1
    found: dict[str, dict] = {}
    for checkpoint, e1 in summary["E1"]["checkpoints"].items():
        if e1["items"]:
            where = f"{checkpoint}: " if several else ""
            for labeling, figures in e1["labelings"].items():
                found[f"{where}E1 live vs prefill, {e1['precision']} ({labeling})"] = {
                    "checkpoint": checkpoint,
                    "experiment": "E1",
                    "precision": e1["precision"],
                    "labeling": labeling,
                    "sides": figures["accuracy"],
                }
    for checkpoint, e2 in summary["E2"]["checkpoints"].items():
        for precision, by_arm in e2["precisions"].items():
            for arm in by_arm.values():
                sides = arm["accuracy"]
                where = f"{checkpoint}: " if several else ""
                found[f"{where}E2 {' vs '.join(sides)}, {precision}"] = {
                    "checkpoint": checkpoint,
                    "experiment": "E2",
                    "precision": precision,
                    "labeling": "parsed",  # E2's labels are the parsed answers
                    "sides": sides,
                }
    return dict(sorted(found.items()))


def plot_accuracy(summary: dict, out_path: str | Path) -> Path:
    """Accuracy of each side of each E1/E2 arm, with the Wilson intervals of summary.json."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4.5))
    grouped = accuracy_arms(summary)
    n = max((counted["n"] for arm in grouped.values() for counted in arm["sides"].values()), default=0)
    axes.set_title(f"Accuracy of each side (Wilson 95%), n = {n} items per arm")
    if not grouped:
        _message(axes, "E1 not run in this ledger")
        return _save(figure, out_path)
    labels, fractions, errors, annotations = [], [], [], []
    several = len({arm["checkpoint"] for arm in grouped.values()}) > 1
    for arm in grouped.values():
        for name, counted in arm["sides"].items():
            low, high = counted["wilson95"]
            where = f"{arm['checkpoint']}\n" if several else ""
            labels.append(f"{where}{arm['experiment']} {name}\n{arm['precision']}, {arm['labeling']}")
            fractions.append(counted["rate"])
            errors.append([counted["rate"] - low, high - counted["rate"]])
            annotations.append(f"{counted['count']}/{counted['n']}")
    positions = range(len(labels))
    axes.errorbar(positions, fractions, yerr=np.array(errors).T, fmt="o", capsize=4)
    for position, fraction, text in zip(positions, fractions, annotations):
        axes.annotate(text, (position, fraction), textcoords="offset points", xytext=(8, 0), fontsize=8)
    axes.set_xticks(list(positions), labels, fontsize=8)
    axes.set_ylim(-0.02, 1.02)
    axes.set_xlabel("side (experiment, construction, precision, labeling)")
    axes.set_ylabel("fraction correct")
    return _save(figure, out_path)


def write_plots(
    summary: dict, comparisons: pa.Table, trajectories: pa.Table, transplants: pa.Table | None, out_dir: str | Path
) -> list[Path]:
    out_dir = Path(out_dir)
    return [
        plot_first_divergence(summary, comparisons, out_dir / PLOT_FILES["first_divergence"]),
        plot_margin_at_divergence(comparisons, trajectories, out_dir / PLOT_FILES["margin_at_divergence"]),
        plot_layer_cache_difference(summary, comparisons, out_dir / PLOT_FILES["layer_cache_difference"]),
        plot_transplant_follow_donor(
            summary.get("E5"),
            out_dir / PLOT_FILES["transplant_follow_donor"],
            transplants.num_rows if transplants is not None else 0,
        ),
        plot_factor_verdicts(summary.get("E6"), out_dir / PLOT_FILES["factor_verdicts"]),
        plot_accuracy(summary, out_dir / PLOT_FILES["accuracy"]),
    ]


def item_layer_difference_png(k_max_abs, v_max_abs, k_mean_abs, v_mean_abs) -> bytes:
    """A small per-layer plot of one item's live-vs-prefill cache difference (max and mean |Δ|, K and V), as PNG
    bytes for the per-item view (inlined into the HTML card, so it is never a file of its own)."""
    import io

    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(4.6, 1.6))
    layers = range(len(k_max_abs))
    values = [value for series in (k_max_abs, v_max_abs, k_mean_abs, v_mean_abs) for value in series if value > 0]
    if not values:
        _message(axes, f"bit-exact in all {len(k_max_abs)} layers")
    else:
        for series, label, style in (
            (k_max_abs, "K max", "-o"),
            (v_max_abs, "V max", "-s"),
            (k_mean_abs, "K mean", ":o"),
            (v_mean_abs, "V mean", ":s"),
        ):
            axes.plot(layers, series, style, markersize=3, linewidth=1, label=label)
        axes.set_yscale("symlog", linthresh=min(values))
        axes.set_xlabel("layer", fontsize=7)
        axes.set_ylabel("|Δ| (symlog)", fontsize=7)
        axes.tick_params(labelsize=6)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        # Beside the axes, where it hides no point.
        axes.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    figure.tight_layout(pad=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()
