"""The card's reading: what the run shows and does not show, in sentences generated from summary.json.

Every number in a sentence is read from summary.json (itself computed from the
ledger tables); nothing here computes an interval or a test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagereplay.report.factor_reading import e6_reading, flip_margins_reading
from stagereplay.report.text import experiment_name, percent, points, under_load_text, wilson_text

if TYPE_CHECKING:
    from stagereplay.report.card_provenance import Provenance

AUDIT_HOW = "snakemake --cores N --config mode=audit"


def e1_reading(summary: dict) -> list[str]:
    lines = []
    for checkpoint, e1 in summary["E1"]["checkpoints"].items():
        lines += e1_checkpoint_reading(experiment_name("E1", (e1["precision"] or "").upper(), checkpoint, summary), e1)
    return lines or ["E1 compared no items: there is nothing to read."]


def e1_checkpoint_reading(name: str, e1: dict) -> list[str]:
    n = e1["items"]
    if not n:
        return [f"{name} compared no items: there is nothing to read."]
    differ = e1["suffixes_differ"]["count"]
    labelings = e1["labelings"]
    lines = [
        f"{name}: {differ}/{n} suffixes differ between continuing from the live cache and from a"
        f" one-shot prefill of the same tokens ({wilson_text(e1['suffixes_differ'])}); correctness labels differ on"
        f" {labelings['parsed']['labels_differ']['count']}/{n} items by the parsed 'Answer: X' and on"
        f" {labelings['readout']['labels_differ']['count']}/{n} by the forced-choice readout."
    ]
    for key, title in (("parsed", "Accuracy (parsed 'Answer: X')"), ("readout", "Accuracy (forced-choice readout)")):
        lines.append(accuracy_reading(title, labelings[key], n, differ))
    lines.append(replica_reading(e1["replicas_exact"]))
    ended = e1["stage_ended_at_eos"]["count"]
    if ended:
        lines.append(
            f"{ended}/{n} stages ended at EOS before the boundary: nothing was continued there, so those items agree"
            " by construction and are counted among the suffixes that do not differ."
        )
    live, prefill = e1["unparsable"]["live"]["count"], e1["unparsable"]["prefill"]["count"]
    if live or prefill:
        lines.append(
            f"{live}/{n} live and {prefill}/{n} prefill answers have no parsable"
            " 'Answer: X' and count as wrong in the parsed labeling; the readout labels every item."
        )
    return lines


def accuracy_reading(title: str, labeling: dict, n: int, differ: int) -> str:
    bootstrap = labeling["paired_difference"]
    boot_low, boot_high = bootstrap["ci95"]
    new_low, new_high = bootstrap["newcombe"]["ci95"]
    mcnemar = bootstrap["mcnemar"]
    live_only, prefill_only, p_value = mcnemar["live_only_correct"], mcnemar["prefill_only_correct"], mcnemar["p_value"]
    live, prefill = labeling["accuracy"]["live"]["count"], labeling["accuracy"]["prefill"]["count"]
    accuracy = (
        f"{title}: live {live}/{n}, prefill {prefill}/{n}; difference"
        f" {points(bootstrap['live_minus_prefill'])} points (bootstrap 95% [{points(boot_low)}, {points(boot_high)}],"
        f" Newcombe [{points(new_low)}, {points(new_high)}]; exact McNemar p = {p_value:.3f}, uncorrected, on"
        f" {live_only} + {prefill_only} discordant pairs)."
    )
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
        accuracy += (
            f" With only {live_only + prefill_only} discordant pair(s) the bootstrap interval rests on very"
            " few distinct resampled values; Newcombe's interval is the safer reading."
        )
    return accuracy


def replica_reading(replicas: dict) -> str:
    """Determinism is claimed only from replicas that were run and all reproduced their side."""
    unmeasured = [side for side in ("live", "prefill") if not replicas[side]["n"]]
    inexact = [side for side in ("live", "prefill") if replicas[side]["count"] < replicas[side]["n"]]
    if inexact:
        return (
            f"Replicas of {' and '.join(inexact)} are not all exact: the run is not deterministic, so the"
            " divergence figures mix replay with run-to-run noise."
        )
    if unmeasured:
        return (
            f"Replicas of {' and '.join(unmeasured)}: not measured (one run per side), so"
            " whether the run is deterministic is untested and the divergence figures may include run-to-run"
            " noise."
        )
    counted = " and ".join(f"{replicas[side]['count']}/{replicas[side]['n']} {side}" for side in ("live", "prefill"))
    return (
        f"Every replica reproduced its side exactly ({counted}; prefix, every cache layer, suffix): the run is"
        " deterministic, so any difference between the sides comes from the construction, not from noise."
    )


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
                consequence = (
                    f"with the prefix tokens held fixed, building the cache by {other} instead of token by"
                    f" token changes the continuation at {precision.upper()}"
                    if count
                    else ""
                )
                lines.append(
                    f"{name}: {count}/{n} decoded disagreements, incremental vs {other}"
                    f" ({wilson_text(counted)}){': ' + consequence if consequence else ''}."
                )
    if diverging and exact:
        lines.append(
            f"The construction changes continuations at {', '.join(sorted(set(diverging)))} but not at"
            f" {', '.join(sorted(set(exact)))} on these items: consistent with reduced-precision rounding in"
            " the cache, since E2 holds the tokens fixed."
        )
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
                lines.append(
                    f"{name}: {exact}/{n} token-by-token caches are bit-exact with the retained"
                    " live cache, so the incremental construction stands in for live."
                )
            else:
                first = figure["not_exact"][0]
                lines.append(
                    f"{name}: only {exact}/{n} token-by-token caches are bit-exact with live"
                    f" (item {first['item_id']} first differs at layer {first['first_differing_layer']}"
                    f" {first['kv']}): incremental is not a faithful stand-in for live here."
                )
    return lines


def e4_reading(e4: dict | None) -> list[str]:
    """The audit's status first, and the artifact kind it reproduced least: trajectories alone can all
    reproduce while other artifacts (E6's caches, margins) do not."""
    if e4 is None:
        return [f"E4 audit: not run ({AUDIT_HOW}): whether the saved ledger reproduces is untested here."]
    reproduced, n = e4["trajectories"]["reproduced"], e4["trajectories"]["n"]
    if not n:
        return ["E4 audit: not measured: the audit recomputed no trajectory, so nothing is shown to reproduce."]
    line = (
        f"E4 audit: {e4['status']}; {reproduced}/{n} trajectories and {e4['items']['count']}/{e4['items']['n']}"
        " items reproduced from the saved ledger"
    )
    worst = e4.get("worst_artifact")
    if "worst_artifact" not in e4:
        line += "; the worst-reproduced artifact kind is not recorded in this e4.json (written before it was)"
    elif worst["count"] < worst["n"]:
        line += f"; the worst-reproduced artifact kind is {worst['artifact']}, {worst['count']}/{worst['n']}"
    else:
        line += f"; every artifact kind reproduced in full ({len(e4['artifacts'])} kinds)"
    mismatches = len(e4.get("mismatches", [])) + e4.get("mismatches_not_listed", 0)
    line += f"; {mismatches} mismatch(es) recorded." if mismatches else ", with no mismatch."
    differences = e4.get("environment_differences", [])
    if differences:
        line += f" The audit ran in a different environment ({len(differences)} difference(s)): see audit/e4.json."
    if e4.get("under_load"):
        line += f" Apart from these, {under_load_text(e4['under_load'])}."
    return [line]


def e5_reading(e5: dict | None) -> list[str]:
    if e5 is None:
        return ["E5 transplant: not run in this ledger."]
    lines = (
        []
        if e5["all_layers"]
        else ["E5 transplant: no item diverged in E1, so there was nothing to transplant and count."]
    )
    for key, figure in e5["all_layers"].items():
        items = figure["items_follow_donor_both_ways"]
        followed, n = items["count"], items["n"]
        if not n:
            lines.append(f"E5 ({key}): no divergent item, so there is no transplant to count.")
        elif followed == n:
            lines.append(
                f"E5 ({key}): {followed}/{n} divergent items follow the donor in both directions when given the"
                f" other side's full boundary cache (Wilson 95% lower bound {percent(items['wilson95'][0])}, over"
                " items): the divergence is carried by the cache."
            )
        else:
            lines.append(
                f"E5 ({key}): {followed}/{n} divergent items follow the donor in both directions; of the"
                f" {figure['follows_donor']['n']} transplanted continuations, {figure['follows_donor']['count']} follow"
                f" the donor cache, {figure['follows_recipient']['count']} their own side,"
                f" {figure['neither']['count']} neither: the cache carries only part of the difference."
            )
    lines += sweep_reading(e5) + cross_precision_reading(e5["cross_precision"])
    if e5.get("outcome_blind_checkpoint"):
        lines.append(f"Note: {e5['outcome_blind_checkpoint']}.")
    return lines


def sweep_reading(e5: dict) -> list[str]:
    counted = [entry for entry in e5.get("sweep", []) if entry["follows_donor"]["n"]]
    if not counted:
        return []
    full = max(entry["layers"] for entry in counted)
    partial = [entry for entry in counted if entry["layers"] < full or entry["kv"] != "kv" or entry["positions"]]
    if not partial:
        return []  # only the full cache was transplanted: the E5 lines say all there is (no smaller set was tried)
    smallest = next((entry for entry in counted if entry["subset"] == e5.get("smallest_sufficient_layer_set")), None)
    if smallest is None:
        lines = ["No swept subset, not even all layers, makes every tested continuation follow its donor."]
    elif smallest["layers"] == full:
        lines = [
            f"Only the full cache ({smallest['subset']}) makes every tested continuation follow its donor: no"
            " smaller swept layer set does."
        ]
    else:
        lines = [
            f"The smallest swept layer set that makes every tested continuation follow its donor:"
            f" {smallest['subset']} ({smallest['layers']} of {full} layers)."
        ]
    if partial:
        best = max(partial, key=lambda entry: (entry["follows_donor"]["rate"], -entry["layers"]))
        followed = best["follows_donor"]
        lines.append(
            f"Of the partial transplants (fewer layers, K only, V only, last positions), {best['subset']} comes"
            f" closest: {followed['count']}/{followed['n']} follow the donor."
        )
    return lines


def cross_precision_reading(cross: dict) -> list[str]:
    lines = []
    for precision, counted in cross["divergence_survives_cast"].items():
        count, n = counted["count"], counted["n"]
        if not n:
            lines.append(f"Cross precision at {precision.upper()}: not measured (no selected item).")
            continue
        verdict = (
            "the caches still carry the difference at this precision"
            if count == n
            else "the cast erases the difference for some items"
            if count
            else "the cast erases the difference: at this precision the two caches continue alike"
        )
        lines.append(
            f"Cross precision at {precision.upper()}: continuing from the cast live and the cast prefill caches,"
            f" {count}/{n} continuations differ ({wilson_text(counted)}): {verdict}. (Whether a cast cache follows"
            " its donor's own suffix is listed apart: that suffix was decoded at the donor's precision, so it"
            " mixes the cache with the precision.)"
        )
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
        lines.append(
            "The model is randomly initialised (a test model): its accuracy is meaningless; the run exercises"
            " the mechanics of divergence only."
        )
    return lines


def reading(summary: dict, provenance: Provenance) -> list[str]:
    return (
        e1_reading(summary)
        + e2_reading(summary)
        + e3_reading(summary)
        + e4_reading(summary.get("E4"))
        + e5_reading(summary.get("E5"))
        + e6_reading(summary.get("E6"))
        + flip_margins_reading(summary)
        + limits_reading(provenance)
    )
