"""The results card: every figure of a run in the paper's terms, its provenance, and a plain reading.

The card is computed, never typed: its figures come from summary.json (itself
computed from the ledger tables) and, for the paired tests of E1, from the
per-item correctness in the comparisons table. Every x/N proportion carries a
Wilson 95% interval; every interval names the method that produced it.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import xxhash

from .atomic import atomic_write_text
from .stamp import stamp
from .stats import mcnemar_exact, paired_difference_newcombe, paired_difference_wald, wilson_interval

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


@dataclass(frozen=True)
class Provenance:
    """What a reader needs to rerun the figures: the model, the items, the environment."""

    version: str
    item_source: str
    item_count: int
    item_digest: str
    models: list[dict]  # model.json records, each with its checkpoint name
    environment: list[dict]  # summary.json's environment entries


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def points(fraction: float) -> str:
    return f"{100 * fraction:+.1f}"


NOT_MEASURED = "not measured"


def proportion(experiment: str, figure: str, count: int, n: int) -> Figure:
    if n == 0:  # nothing was observed: never a success, never a failure
        return Figure(experiment, figure, "0/0", NOT_MEASURED, "—", "no observations (n = 0)")
    low, high = wilson_interval(count, n)
    return Figure(experiment, figure, f"{count}/{n}", percent(count / n), f"[{percent(low)}, {percent(high)}]", WILSON)


def not_run(experiment: str, how: str) -> Figure:
    return Figure(experiment, NOT_RUN, "—", "—", "—", how)


# --- E1 ---------------------------------------------------------------------------------


def experiment_name(experiment: str, precision: str | None, checkpoint: str, summary: dict) -> str:
    """'E1 matched (bf16)'; with several checkpoints, 'E1 matched (bf16, tiny-b)'."""
    where = ", ".join(part for part in (precision, checkpoint if len(summary["checkpoints"]) > 1 else None) if part)
    return f"{experiment} ({where})" if where else experiment


def e1_pairs(comparisons: pa.Table, checkpoint: str) -> tuple[list[bool], list[bool]]:
    """(live correct, prefill correct) per item, over one checkpoint's E1 live-vs-prefill rows."""
    rows = sorted(
        (row for row in comparisons.to_pylist()
         if row["experiment"] == "E1" and row["relation"] == "construction" and row["checkpoint"] == checkpoint),
        key=lambda row: row["item_id"],
    )
    return [row["a_correct"] for row in rows], [row["b_correct"] for row in rows]


def e1_figures(summary: dict, comparisons: pa.Table) -> list[Figure]:
    figures = []
    for checkpoint, e1 in summary["E1"]["checkpoints"].items():
        live, prefill = e1_pairs(comparisons, checkpoint)
        name = experiment_name("E1 matched", e1["precision"], checkpoint, summary)
        n = e1["items"]
        figures += [
            proportion(name, "suffixes that differ, live vs prefill", e1["suffixes_differ"]["count"], n),
            proportion(name, "correctness labels that differ", e1["labels_differ"]["count"], n),
            proportion(name, "boundary caches that differ", e1["caches_differ"]["count"], n),
            proportion(name, "accuracy, live", e1["accuracy"]["live"]["count"], n),
            proportion(name, "accuracy, prefill", e1["accuracy"]["prefill"]["count"], n),
            proportion(name, "unparsable answers, live", e1["unparsable"]["live"], n),
            proportion(name, "unparsable answers, prefill", e1["unparsable"]["prefill"], n),
        ]
        for side in ("live", "prefill"):
            replicas = e1["replicas_exact"][side]
            figures.append(proportion(name, f"exact replicas, {side}", replicas["count"], replicas["n"]))
        if n:
            figures += paired_figures(name, e1, live, prefill)
    return figures


def paired_figures(name: str, e1: dict, live: list[bool], prefill: list[bool]) -> list[Figure]:
    """The accuracy difference live − prefill by three interval methods, and the exact McNemar test."""
    n = len(live)
    counted = f"({sum(live)} − {sum(prefill)})/{n}"
    label = "accuracy difference, live − prefill"
    bootstrap = e1["paired_difference"]
    low, high = bootstrap["ci95"]
    figures = [Figure(name, label, counted, f"{points(bootstrap['live_minus_prefill'])} pts",
                      f"[{points(low)}, {points(high)}] pts", bootstrap["method"])]
    for method, function in (("Newcombe hybrid score 95% (1998, method 10)", paired_difference_newcombe),
                             ("Wald 95% for paired proportions", paired_difference_wald)):
        difference, low, high = function(live, prefill)
        figures.append(Figure(name, label, counted, f"{points(difference)} pts", f"[{points(low)}, {points(high)}] pts",
                              method))
    live_only, prefill_only, p_value = mcnemar_exact(live, prefill)
    figures.append(Figure(name, "equal accuracy (discordant pairs live-only : prefill-only)",
                          f"{live_only} : {prefill_only}", f"p = {p_value:.3f}", "—",
                          "exact McNemar (two-sided binomial test on the discordant pairs)"))
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
                    proportion(name, f"decoded disagreements, incremental vs {other}", counted["count"], counted["n"]),
                    proportion(name, f"labels that differ, incremental vs {other}", figure["labels_differ"]["count"],
                               figure["labels_differ"]["n"]),
                    proportion(name, f"caches that differ, incremental vs {other}", figure["caches_differ"]["count"],
                               figure["caches_differ"]["n"]),
                ]
                if figure["median_first_divergence"] is not None:
                    figures.append(Figure(name, f"median first divergent position, incremental vs {other}",
                                          f"{counted['count']} divergent", f"token {figure['median_first_divergence']:g}",
                                          "—", "median over the divergent suffixes"))
    return figures or [not_run("E2 fixed_prefix", "no fixed_prefix.precisions in the config")]


def e3_figures(summary: dict) -> list[Figure]:
    figures = []
    for checkpoint, e3 in summary["E3"]["checkpoints"].items():
        for precision, figure in e3["precisions"].items():
            name = experiment_name("E3 bridge", precision, checkpoint, summary)
            figures += [
                proportion(name, "caches bit-exact, incremental vs live", figure["bit_exact"]["count"],
                           figure["bit_exact"]["n"]),
                proportion(name, "suffixes identical, incremental vs live", figure["suffixes_identical"]["count"],
                           figure["suffixes_identical"]["n"]),
            ]
    return figures or [not_run("E3 bridge", "no fixed_prefix.precisions in the config")]


# --- E4, E5 (optional: present only when their rules ran) --------------------------------

AUDIT_HOW = "snakemake --cores N audit"


def e4_figures(e4: dict | None) -> list[Figure]:
    if e4 is None:
        return [not_run("E4 audit", AUDIT_HOW)]
    name = "E4 audit"
    figures = [proportion(name, "trajectories reproduced from the saved ledger", e4["trajectories"]["reproduced"],
                          e4["trajectories"]["n"])]
    for kind, counted in sorted(e4.get("artifacts", {}).items()):
        figures.append(proportion(name, f"{kind} fingerprints reproduced", counted["reproduced"], counted["n"]))
    return figures


def e5_figures(e5: dict | None) -> list[Figure]:
    if e5 is None:
        return [not_run("E5 transplant", "transplant.enabled is false in the config")]
    name = "E5 transplant"
    figures = []
    for key, figure in e5["all_layers"].items():
        n = figure["follows_donor"]["n"]
        figures.append(proportion(name, f"all layers, {key}: follow the donor", figure["follows_donor"]["count"], n))
        figures.append(proportion(name, f"all layers, {key}: follow the recipient", figure["follows_recipient"], n))
        figures.append(proportion(name, f"all layers, {key}: follow neither", figure["neither"], n))
        for direction, fraction in figure["by_direction"].items():
            count, total = (int(part) for part in fraction.split("/"))
            figures.append(proportion(name, f"all layers, {key}, {direction}: follow the donor", count, total))
    for entry in e5["sweep"]:
        figures.append(proportion(name, f"sweep {entry['subset']}: follow the donor", entry["follows_donor"], entry["n"]))
    cross = e5["cross_precision"]
    for precision, counted in cross["divergence_survives_cast"].items():
        figures.append(proportion(
            name, f"cross precision, at {precision}: continuations from the cast live and cast prefill caches differ"
                  " (the divergence survives the cast)", counted["count"], counted["n"]))
    for direction, counted in cross["follows_donor"].items():
        figures.append(proportion(
            name, f"cross precision {direction}: follow the donor's own suffix (decoded at the donor's precision, so"
                  " this mixes the cache with the precision)", counted["count"], counted["n"]))
    return figures or [Figure(name, "all layers: follow the donor", "0/0", "—", "—",
                              "no divergent item to transplant (counted on divergent items only)")]


def all_figures(summary: dict, comparisons: pa.Table) -> list[Figure]:
    return (e1_figures(summary, comparisons) + e2_figures(summary) + e3_figures(summary)
            + e4_figures(summary.get("E4")) + e5_figures(summary.get("E5")))


# --- the plain reading --------------------------------------------------------------------


def _bound(count: int, n: int) -> str:
    low, high = wilson_interval(count, n)
    if count == 0:
        return f"Wilson upper bound {percent(high)}: consistent with none, but {n} items cannot rule out a rate below {percent(high)}"
    return f"Wilson 95% [{percent(low)}, {percent(high)}]"


def e1_reading(summary: dict, comparisons: pa.Table) -> list[str]:
    lines = []
    for checkpoint, e1 in summary["E1"]["checkpoints"].items():
        lines += e1_checkpoint_reading(experiment_name("E1", (e1["precision"] or "").upper(), checkpoint, summary),
                                       e1, *e1_pairs(comparisons, checkpoint))
    return lines or ["E1 compared no items: there is nothing to read."]


def e1_checkpoint_reading(name: str, e1: dict, live: list[bool], prefill: list[bool]) -> list[str]:
    n = e1["items"]
    if not n:
        return [f"{name} compared no items: there is nothing to read."]
    differ = e1["suffixes_differ"]["count"]
    lines = [
        f"{name}: {differ}/{n} suffixes differ between continuing from the live cache and from a"
        f" one-shot prefill of the same tokens ({_bound(differ, n)}); {e1['labels_differ']['count']}/{n} correctness"
        " labels differ."
    ]
    bootstrap = e1["paired_difference"]
    boot_low, boot_high = bootstrap["ci95"]
    _, new_low, new_high = paired_difference_newcombe(live, prefill)
    live_only, prefill_only, p_value = mcnemar_exact(live, prefill)
    accuracy = (f"Accuracy: live {sum(live)}/{n}, prefill {sum(prefill)}/{n}; difference"
                f" {points(bootstrap['live_minus_prefill'])} points (bootstrap 95% [{points(boot_low)}, {points(boot_high)}],"
                f" Newcombe [{points(new_low)}, {points(new_high)}]; exact McNemar p = {p_value:.3f} on"
                f" {live_only} + {prefill_only} discordant pairs).")
    includes_zero = [boot_low <= 0 <= boot_high, new_low <= 0 <= new_high]
    if all(includes_zero):
        accuracy += " Both intervals include 0: this run cannot tell the two sides' accuracy apart"
        accuracy += ", although their suffixes differ item by item." if differ else "."
    elif not any(includes_zero):
        accuracy += " Both intervals exclude 0: on these items replaying the prefix changes accuracy."
    else:
        accuracy += " The two intervals disagree about 0: too few items to say whether accuracy changes."
    if 0 < live_only + prefill_only < 10:
        # The percentile bootstrap resamples only the discordant pairs' signs: with a handful of
        # them its interval sits on a few values (an end exactly at 0 is typical).
        accuracy += (f" With only {live_only + prefill_only} discordant pair(s) the bootstrap interval rests on very"
                     " few distinct resampled values; Newcombe's interval is the safer reading.")
    lines.append(accuracy)
    lines.append(replica_reading(e1["replicas_exact"]))
    unparsable = e1["unparsable"]
    if unparsable["live"] or unparsable["prefill"]:
        lines.append(f"{unparsable['live']}/{n} live and {unparsable['prefill']}/{n} prefill answers have no parsable"
                     " 'Answer: X' and count as wrong.")
    return lines


def replica_reading(replicas: dict) -> str:
    """Determinism is claimed only from replicas that were run and all reproduced their side."""
    unmeasured = [side for side in ("live", "prefill") if not replicas[side]["n"]]
    inexact = [side for side in ("live", "prefill") if replicas[side]["count"] < replicas[side]["n"]]
    if inexact:
        return (f"Replicas of {' and '.join(inexact)} are not all exact: the run is not deterministic, so the"
                " divergence figures mix replay with run-to-run noise.")
    if unmeasured:
        return (f"Replicas of {' and '.join(unmeasured)}: not measured (one run per side), so"
                " whether the run is deterministic is untested and the divergence figures may include run-to-run"
                " noise.")
    counted = " and ".join(f"{replicas[side]['count']}/{replicas[side]['n']} {side}" for side in ("live", "prefill"))
    return (f"Every replica reproduced its side exactly ({counted}; prefix, every cache layer, suffix): the run is"
            " deterministic, so any difference between the sides comes from the construction, not from noise.")


def e2_reading(summary: dict) -> list[str]:
    lines, diverging, exact = [], [], []
    for checkpoint, e2 in summary["E2"]["checkpoints"].items():
        for precision, arms in e2["precisions"].items():
            name = experiment_name(f"{precision.upper()} arm", None, checkpoint, summary)
            for arm, figure in arms.items():
                other = arm.removeprefix("incremental_vs_")
                counted = figure["decoded_disagreements"]
                count, n = counted["count"], counted["n"]
                if not n:
                    lines.append(f"{name}: incremental vs {other} not measured (no items).")
                    continue
                (diverging if count else exact).append(precision.upper())
                consequence = (f"with the prefix tokens held fixed, building the cache by {other} instead of token by"
                               f" token changes the continuation at {precision.upper()}" if count else "")
                lines.append(f"{name}: {count}/{n} decoded disagreements, incremental vs {other}"
                             f" ({_bound(count, n)}){': ' + consequence if consequence else ''}.")
    if diverging and exact:
        lines.append(f"The construction changes continuations at {', '.join(sorted(set(diverging)))} but not at"
                     f" {', '.join(sorted(set(exact)))} on these items: consistent with reduced-precision rounding in"
                     " the cache, since E2 holds the tokens fixed.")
    return lines


def e3_reading(summary: dict) -> list[str]:
    lines = []
    for checkpoint, e3 in summary["E3"]["checkpoints"].items():
        for precision, figure in e3["precisions"].items():
            name = experiment_name("E3", precision.upper(), checkpoint, summary)
            exact, n = figure["bit_exact"]["count"], figure["bit_exact"]["n"]
            if not n:
                lines.append(f"{name}: not measured (no items): whether incremental stands in for live is untested.")
            elif exact == n:
                lines.append(f"{name}: {exact}/{n} token-by-token caches are bit-exact with the retained"
                             " live cache, so the incremental construction stands in for live.")
            else:
                first = figure["not_exact"][0]
                lines.append(f"{name}: only {exact}/{n} token-by-token caches are bit-exact with live"
                             f" (item {first['item_id']} first differs at layer {first['first_differing_layer']}"
                             f" {first['kv']}): incremental is not a faithful stand-in for live here.")
    return lines


def e4_reading(e4: dict | None) -> list[str]:
    if e4 is None:
        return [f"E4 audit: not run ({AUDIT_HOW}): whether the saved ledger reproduces is untested here."]
    reproduced, n = e4["trajectories"]["reproduced"], e4["trajectories"]["n"]
    if not n:
        return ["E4 audit: not measured: the audit recomputed no trajectory, so nothing is shown to reproduce."]
    line = f"E4 audit: {reproduced}/{n} trajectories reproduced from the saved ledger"
    mismatches = e4.get("mismatches", [])
    line += f"; {len(mismatches)} mismatch(es) recorded." if mismatches else ", with no mismatch."
    differences = e4.get("environment_differences", [])
    if differences:
        line += f" The audit ran in a different environment ({len(differences)} difference(s)): see summary.json."
    return [line]


def e5_reading(e5: dict | None) -> list[str]:
    if e5 is None:
        return ["E5 transplant: not run in this ledger."]
    lines = [] if e5["all_layers"] else ["E5 transplant: no item diverged in E1, so there was nothing to transplant and count."]
    for key, figure in e5["all_layers"].items():
        followed, n = figure["follows_donor"]["count"], figure["follows_donor"]["n"]
        if not n:
            lines.append(f"E5 ({key}): no divergent item, so there is no transplant to count.")
        elif followed == n:
            low, _ = wilson_interval(followed, n)
            lines.append(f"E5 ({key}): {followed}/{n} continuations given the other side's full boundary cache follow"
                         f" that donor (Wilson lower bound {percent(low)}): the divergence is carried by the cache.")
        else:
            lines.append(f"E5 ({key}): {followed}/{n} continuations follow the donor cache, {figure['follows_recipient']}"
                         f" their own side, {figure['neither']} neither: the cache carries only part of the difference.")
    lines += sweep_reading(e5) + cross_precision_reading(e5["cross_precision"])
    if e5.get("outcome_blind_checkpoint"):
        lines.append(f"Note: {e5['outcome_blind_checkpoint']}.")
    return lines


def sweep_reading(e5: dict) -> list[str]:
    counted = [entry for entry in e5.get("sweep", []) if entry["n"]]
    if not counted:
        return []
    full = max(entry["layers"] for entry in counted)
    partial = [entry for entry in counted if entry["layers"] < full or entry["kv"] != "kv" or entry["positions"]]
    smallest = next((entry for entry in counted if entry["subset"] == e5.get("smallest_sufficient_layer_set")), None)
    if smallest is None:
        lines = ["No swept subset, not even all layers, makes every tested continuation follow its donor."]
    elif smallest["layers"] == full:
        lines = [f"Only the full cache ({smallest['subset']}) makes every tested continuation follow its donor: no"
                 " smaller swept layer set does."]
    else:
        lines = [f"The smallest swept layer set that makes every tested continuation follow its donor:"
                 f" {smallest['subset']} ({smallest['layers']} of {full} layers)."]
    if partial:
        best = max(partial, key=lambda entry: (entry["fraction"], -entry["layers"]))
        lines.append(f"Of the partial transplants (fewer layers, K only, V only, last positions), {best['subset']} comes"
                     f" closest: {best['follows_donor']}/{best['n']} follow the donor.")
    return lines


def cross_precision_reading(cross: dict) -> list[str]:
    lines = []
    for precision, counted in cross["divergence_survives_cast"].items():
        count, n = counted["count"], counted["n"]
        if not n:
            lines.append(f"Cross precision at {precision.upper()}: not measured (no selected item).")
            continue
        verdict = ("the caches still carry the difference at this precision" if count == n
                   else "the cast erases the difference for some items" if count else
                   "the cast erases the difference: at this precision the two caches continue alike")
        lines.append(f"Cross precision at {precision.upper()}: continuing from the cast live and the cast prefill caches,"
                     f" {count}/{n} continuations differ ({_bound(count, n)}): {verdict}. (Whether a cast cache follows"
                     " its donor's own suffix is listed apart: that suffix was decoded at the donor's precision, so it"
                     " mixes the cache with the precision.)")
    return lines


def limits_reading(provenance: Provenance) -> list[str]:
    sources = sorted({model["source"] for model in provenance.models})
    devices = sorted({f"{entry['device']} ({entry['device_name']})" for entry in provenance.environment})
    threads = sorted({entry["threads"] for entry in provenance.environment})
    attention = sorted({entry["attn_implementation"] for entry in provenance.environment})
    lines = [
        f"What this run does not show: it covers {provenance.item_count} items, {len(provenance.models)} model(s)"
        f" ({', '.join(sources)}), device {', '.join(devices)}, {', '.join(map(str, threads))} thread(s), attention"
        f" {', '.join(attention)}, greedy decoding at batch size 1. It says nothing about other models, devices,"
        " thread counts, batch sizes or sampling; each interval is 95% for its own figure, with no correction for"
        " the number of figures."
    ]
    if sources == ["random_qwen2"]:
        lines.append("The model is randomly initialised (a test model): its accuracy is meaningless; the run exercises"
                     " the mechanics of divergence only.")
    return lines


def reading(summary: dict, comparisons: pa.Table, provenance: Provenance) -> list[str]:
    return (e1_reading(summary, comparisons) + e2_reading(summary) + e3_reading(summary)
            + e4_reading(summary.get("E4")) + e5_reading(summary.get("E5")) + limits_reading(provenance))


# --- provenance and the markdown ----------------------------------------------------------


def provenance(summary: dict, item_source: str, items_path: str | Path, model_records: dict[str, dict]) -> Provenance:
    items = Path(items_path).read_bytes()
    return Provenance(
        version=summary["stagereplay_version"],
        item_source=item_source,
        item_count=sum(1 for line in items.splitlines() if line.strip()),
        item_digest=xxhash.xxh3_128(items).hexdigest(),
        models=[{"checkpoint": name, **record} for name, record in model_records.items()],
        environment=summary["environment"],
    )


ENVIRONMENT_COLUMNS = [
    ("checkpoint", "checkpoint"), ("precision", "precision"), ("device", "device"), ("device_name", "device name"),
    ("cpu_capability", "CPU kernels"), ("threads", "threads"), ("attn_implementation", "attention"), ("tf32", "TF32"),
    ("bf16_reduced_precision_reduction", "bf16 reduced-precision reduction"),
    ("fp16_reduced_precision_reduction", "fp16 reduced-precision reduction"), ("sdpa_backends", "SDPA backends"),
    ("float32_matmul_precision", "fp32 matmul precision"), ("deterministic", "deterministic"),
    ("torch_version", "torch"), ("transformers_version", "transformers"), ("model_fingerprint", "model fingerprint"),
]
FIGURE_COLUMNS = ["Experiment", "Figure", "Count / N", "Estimate", "95% interval", "Method"]


# The card is one document written twice: Markdown (results.md, for the ledger and
# for diffs) and HTML (shown inside the Snakemake report, which displays only HTML
# and images). Blocks are ("heading", level, text), ("paragraph", text),
# ("bullets", [text]) and ("table", header, rows); `code` spans are marked with backticks.
def document(figures: list[Figure], prov: Provenance, lines_of_reading: list[str]) -> list[tuple]:
    return [
        ("heading", 1, "stagereplay results card"),
        ("paragraph", "Live KV cache versus one-shot prefill of the same tokens. Every number below is computed from"
                      " this ledger (summary.json and tables/*.parquet) by `stagereplay report`; nothing is typed in."),
        ("heading", 2, "Figures"),
        ("table", FIGURE_COLUMNS, [[f.experiment, f.figure, f.count, f.estimate, f.interval, f.method] for f in figures]),
        ("heading", 2, "Reading: what this run shows and does not show"),
        ("bullets", lines_of_reading),
        ("heading", 2, "Provenance"),
        ("bullets", [
            f"stagereplay {prov.version}",
            f"items: {prov.item_count} from `{prov.item_source}` (normalised items.jsonl, xxh3-128 {prov.item_digest})",
            *[f"model `{model['checkpoint']}`: source {model['source']}, fingerprint {model['fingerprint']}"
              for model in prov.models],
            f"precisions: {', '.join(sorted({entry['precision'] for entry in prov.environment}))}",
        ]),
        ("table", [title for _, title in ENVIRONMENT_COLUMNS],
         [[entry[key] for key, _ in ENVIRONMENT_COLUMNS] for entry in prov.environment]),
    ]


def _markdown_cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[tuple]) -> str:
    out: list[str] = []
    for kind, *body in blocks:
        if kind == "heading":
            out.append("#" * body[0] + " " + body[1])
        elif kind == "paragraph":
            out.append(body[0])
        elif kind == "bullets":
            out.append("\n".join(f"- {item}" for item in body[0]))
        else:
            header, rows = body
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(_markdown_cell(value) for value in row) + " |" for row in rows]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _html_text(value: object) -> str:
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(str(value)))


def to_html(blocks: list[tuple]) -> str:
    out = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8"><title>stagereplay results card</title>',
           "<style>body{font-family:sans-serif;max-width:70em;margin:1em auto}table{border-collapse:collapse}"
           "td,th{border:1px solid #bbb;padding:2px 6px;text-align:left;font-size:90%}</style></head><body>"]
    for kind, *body in blocks:
        if kind == "heading":
            out.append(f"<h{body[0]}>{_html_text(body[1])}</h{body[0]}>")
        elif kind == "paragraph":
            out.append(f"<p>{_html_text(body[0])}</p>")
        elif kind == "bullets":
            out.append("<ul>" + "".join(f"<li>{_html_text(item)}</li>" for item in body[0]) + "</ul>")
        else:
            header, rows = body
            out.append("<table><tr>" + "".join(f"<th>{_html_text(cell)}</th>" for cell in header) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{_html_text(cell)}</td>" for cell in row) + "</tr>"
                                 for row in rows) + "</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def results_card(summary: dict, comparisons: pa.Table, prov: Provenance) -> list[tuple]:
    return document(all_figures(summary, comparisons), prov, reading(summary, comparisons, prov))


def write_results_card(summary: dict, comparisons: pa.Table, prov: Provenance, markdown_path: str | Path,
                       html_path: str | Path | None = None, summary_bytes: bytes | None = None) -> Path:
    """Both cards, stamped with the summary.json bytes they come from (unstamped without them:
    `stagereplay verify` then says so), so an edited or outdated card is caught."""
    blocks = results_card(summary, comparisons, prov)

    def stamped(text: str) -> str:
        return text if summary_bytes is None else stamp(text, summary_bytes)

    if html_path is not None:
        atomic_write_text(html_path, stamped(to_html(blocks)))
    return atomic_write_text(markdown_path, stamped(to_markdown(blocks)))
