"""The card's reading: what the run shows and does not show, in sentences generated from summary.json.

Every number in a sentence is read from summary.json (itself computed from the
ledger tables); nothing here computes an interval or a test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagereplay.design.factors import factor_named
from stagereplay.report.text import experiment_name, level_name, percent, points, under_load_text

if TYPE_CHECKING:
    from stagereplay.report.card_provenance import Provenance

AUDIT_HOW = "snakemake --cores N audit"


def _bound(counted: dict) -> str:
    """The Wilson interval of an x/N from summary.json, read for a count of 0 as an upper bound."""
    count, n = counted["count"], counted["n"]
    low, high = counted["wilson95"]
    if count == 0:
        return f"Wilson 95% upper bound {percent(high)}: consistent with none, and rates up to {percent(high)} are not ruled out by {n} items"
    return f"Wilson 95% [{percent(low)}, {percent(high)}]"


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
        f" one-shot prefill of the same tokens ({_bound(e1['suffixes_differ'])}); correctness labels differ on"
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
                    f" ({_bound(counted)}){': ' + consequence if consequence else ''}."
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
            f" {count}/{n} continuations differ ({_bound(counted)}): {verdict}. (Whether a cast cache follows"
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


# What each verdict says of an item whose served suffix changes: which cells differ from the reference, never
# that the served continuation is a one-sided cell's (summary.json's served_equals_side counts that).
SIDE_WORDS = {
    "write": "changes in the write cell (test-ref) and not in the read cell (write side)",
    "read": "changes in the read cell (ref-test) and not in the write cell (read side)",
    "both": "changes in the write cell and in the read cell (both sides)",
    "interaction": "changes only when the level both builds and reads (interaction)",
    "served": "changes as a server runs it (its one-sided cells cannot be built, so the side is not separated)",
}
# A build-only level's one cell is its served cell and its write cell: there the verdict does say it.
BUILD_ONLY_WRITE = "is changed by the cache the level writes (build-only: its served cell is the write cell)"


def e6_reading(e6: dict | None) -> list[str]:
    """One sentence per factor level: caches, served suffixes, and where the divergence enters; and for a level
    with the full 2x2 on which some cell differs, one more: which cells differ."""
    if e6 is None:
        return []
    lines = []
    correction = e6.get("sides_compared")
    for level in e6["levels"]:
        lines.append(e6_level_reading(level, correction))
        # A build-only or server-only level has one cell, so its two patterns are its suffixes-differ figure.
        full = level["applicable"] and len(level["differing_cells"]) > 2
        if full and level["verdicts"]["none"]["count"] < level["items"]:
            lines.append(e6_pattern_reading(level))
    read = [
        level
        for level in e6["levels"]
        if level["applicable"] and level.get("first_read") and level["first_read"]["argmax_same"]["n"]
    ]
    lines += sides_correction_reading(correction)
    if read:
        lines.append(first_read_reading(read))
    return lines


def first_read_reading(levels: list[dict]) -> str:
    """The first read of each level with a ref-test cell: its first logits against the reference's."""
    parts = []
    for level in levels:
        read = level["first_read"]
        identical, same, n = read["logits_identical"]["count"], read["argmax_same"]["count"], read["argmax_same"]["n"]
        converted = " (the reference cache converted for its reader: the conversion and the read together)"
        parts.append(
            f"{level_name(level)}{converted if read['converted'] else ''}: logits bit-identical on"
            f" {identical}/{n}, argmax the same on {same}/{n}, max |Δ| {read['max_abs_difference']:.3g}"
        )
    return (
        "E6 first read (ref-test's first step against the reference's: the same boundary bytes and the same pending"
        " token, read under the level and under the reference; ref-test's suffix is the whole continuation decoded"
        " under the level, not this read alone): " + "; ".join(parts) + "."
    )


def flip_margins_reading(summary: dict) -> list[str]:
    """How many flips were near-ties: the reference's margin at the first divergent step, against one bf16 step
    of the top logit where the logits are bf16 values (E1 keeps no top logit, so its count is bounded; E6
    records the reference's), against |top|/128 under that name where they are not. E6 per test level only:
    levels repeat items and flips, so no count is pooled over them."""
    parts = []
    for checkpoint, e1 in summary["E1"]["checkpoints"].items():
        margins = e1.get("flip_margins")
        if not margins or not margins["flips"]:
            continue
        n, ties = margins["flips"], margins["tie"]["count"]
        name = experiment_name("E1", (e1["precision"] or "").upper(), checkpoint, summary)
        bound = margins["one_bf16_step_at_most"]
        parts.append(
            f"{name}, prefill side: {ties}/{n} flips are exact ties"
            + (
                f" and at most {bound['count']}/{n} within one bf16 step (a margin of 0 or a power of two; E1 keeps"
                " no top logit, so the step itself is not known)"
                if bound is not None
                else " (its logits are not bf16 values and E1 keeps no top logit: no bf16-step count)"
            )
        )
    levels = [
        level
        for level in (summary.get("E6") or {}).get("levels", [])
        if level["applicable"] and level.get("flip_margins") and level["flip_margins"]["flips"]
    ]
    if levels:
        parts.append(
            "E6, each test level's served divergences (one per item): " + ", ".join(map(_level_margins, levels))
        )
    if not parts:
        return []
    return [
        "Margins at the first divergent step (the reference's top-1 minus top-2 logit; on bf16 logits one bf16 step"
        " is 2^(floor(log2|top logit|) - 7), the gap to the top logit's neighbour; on other logits, such as"
        " llama.cpp's float32 ones, the same number is no rounding step and is named |top|/128, |top| rounded down"
        " to a power of two): " + "; ".join(parts) + "."
    ]


def _level_margins(level: dict) -> str:
    margins = level["flip_margins"]
    n, ties = margins["flips"], margins["tie"]["count"]
    within, scale = (
        (margins["within_one_bf16_step"], "within one bf16 step of the reference's top logit")
        if margins["bf16_logits"]
        else (margins.get("within_top_over_128"), "with a margin at most |top|/128")
    )
    if within is None:  # log-probabilities: margins without a top logit to scale them by
        return (
            f"{level_name(level)} {ties}/{n} exact ties, median margin {margins['median_margin']:.3g}"
            " logits (top-1 minus top-2 log-probability; no top logit to scale it)"
        )
    return f"{level_name(level)} {within['count']}/{n} {scale} ({ties}/{n} exact ties)"


def e6_level_name(level: dict) -> str:
    return f"E6 {level_name(level)} (reference {level['reference_level']})"


def e6_level_reading(level: dict, correction: dict | None = None) -> str:
    """One level's sentence; ``correction``: summary's E6.sides_compared, the family its p-value belongs to."""
    name = e6_level_name(level)
    if not level["applicable"]:
        return f"{name}: not applicable here — {level['reason']}."
    n = level["items"]
    caches = level["caches_differ"]
    cache_text = (
        f"caches differ on {caches['count']}/{n} items from layer {level['first_differing_layer']}"
        if caches["count"]
        else f"the caches it builds are bit-identical to the reference on all {n} items"
    )
    if factor_named(level["factor"]).other_cache_type and level["level"] != level["reference_level"]:
        # Another cache type never has the reference's bytes: what says something is how far its values are.
        cache_text = (
            f"its caches are another type (max |Δ| of their values from the reference's"
            f" {level['max_abs_difference']:.3g})"
        )
    served = "as built" if level["cells"] == ["test-ref"] else "as a server runs it"
    suffixes = level["suffixes_differ"]
    text = f"{name}: {cache_text}; suffixes differ on {suffixes['count']}/{n} {served} ({_bound(suffixes)})"
    verdicts = level["verdicts"]
    latent = verdicts["latent"]["count"]
    if verdicts["none"]["count"] == n:
        return f"{text}; no cell of any item continues differently from the reference (verdict none on {n}/{n})."
    # Only the items whose served suffix differs get a side; a one-sided difference alone is latent.
    latent_text = (
        f"; on {latent}/{n} items a one-sided cell differs but the served suffix does not (latent,"
        f" {_bound(verdicts['latent'])})"
        if latent
        else ""
    )
    changed = {verdict: verdicts[verdict]["count"] for verdict in SIDE_WORDS if verdicts[verdict]["count"]}
    if not changed:
        return f"{text}; no served suffix changes{latent_text}."
    if level.get("converted_cells"):
        # Each one-sided cell reads a cache converted to the other type (cache_type): test-ref the level's
        # cache dequantized for the reference reader, ref-test the reference's quantized offline. Both
        # cells then change something by construction, so the counts name cells, never a side.
        cells = ", ".join(f"{count} {verdict}" for verdict, count in changed.items())
        return (
            f"{text}; of the items whose served suffix changes: {cells} (by the cells that differ: each"
            f" one-sided cell reads a converted cache, so these do not say on which side the divergence"
            f" enters){latent_text}."
        )
    followed = _served_equals_side(level)
    if len(changed) == 1:
        ((verdict, count),) = changed.items()
        words = BUILD_ONLY_WRITE if level["cells"] == ["test-ref"] else SIDE_WORDS[verdict]
        return (
            f"{text}; every item whose served suffix changes ({count}/{n}) {words}"
            f"{_write_vs_read(level, correction)}{followed}{latent_text}."
        )
    sides = ", ".join(f"{count} {verdict}" for verdict, count in changed.items())
    return (
        f"{text}; of the items whose served suffix changes: {sides}{_write_vs_read(level, correction)}{followed}"
        f"{latent_text}."
    )


def _served_equals_side(level: dict) -> str:
    """Whether the served continuation is the one-sided cell's, for the write and read items (summary's
    served_equals_side): a write verdict alone says only that the write cell differs from the reference."""
    counted = level.get("served_equals_side") or {}
    parts = [
        f"the {verdict} cell's on {counted[verdict]['count']}/{counted[verdict]['n']} {verdict} items"
        for verdict in ("write", "read")
        if verdict in counted and counted[verdict]["n"]
    ]
    return f"; the served continuation is {' and '.join(parts)}" if parts else ""


def _write_vs_read(level: dict, correction: dict | None) -> str:
    """The exact test behind any comparison of the sides (summary's write_vs_read), its p-value uncorrected and
    set against the family's Bonferroni threshold (summary's sides_compared); without a test, why not."""
    test = level.get("write_vs_read")
    full = len(level["differing_cells"]) > 2  # a build-only or server-only level has no sides to compare
    if test is None and full and level["caches_differ"]["count"] == 0:
        return (
            "; no comparison of the sides: every cache it builds has the reference's bytes, so its write cell is"
            " the reference computation and the write side is empty by construction"
        )
    if not test or test["p_value"] is None:
        return ""
    text = (
        f"; write only {test['write_only']} against read only {test['read_only']}: exact McNemar p ="
        f" {test['p_value']:.2g}, uncorrected"
    )
    if correction and correction["tests"]:
        threshold, tests = correction["threshold"], correction["tests"]
        survives = f"{level_name(level)}" in correction["survive"]
        text += (
            f", {'below' if survives else 'not below'} the Bonferroni threshold 0.05/{tests} = {threshold:.2g}"
            f" over the {tests} level(s) tested"
        )
    return text


def sides_correction_reading(correction: dict | None) -> list[str]:
    """Which write-against-read comparisons survive the correction for their number (summary's sides_compared)."""
    if not correction or not correction["tests"]:
        return []
    tests, threshold = correction["tests"], correction["threshold"]
    survive = correction["survive"]
    verdict = (
        f"{', '.join(survive)} {'survives' if len(survive) == 1 else 'survive'} it"
        if survive
        else "none survives it: no level's write-only against read-only difference is shown beyond chance"
    )
    return [
        f"E6 write side against read side: {tests} test level(s) have an exact McNemar test"
        f" ({', '.join(correction['levels'])}); Bonferroni-corrected over them (p below 0.05/{tests} ="
        f" {threshold:.2g}), {verdict}. Not tested: levels whose caches have the reference's bytes on every item,"
        " levels whose cells read converted caches, build-only and server-only levels, and levels with no"
        " write-only or read-only item."
    ]


def e6_pattern_reading(level: dict) -> str:
    """The patterns of differing cells of a level with the full 2x2: those seen, each with its Wilson interval,
    then those not seen, with their common upper bound."""
    patterns = level["differing_cells"]
    seen = [f"{pattern} {c['count']}/{c['n']} ({_bound(c)})" for pattern, c in patterns.items() if c["count"]]
    unseen = [pattern for pattern, c in patterns.items() if not c["count"]]
    text = (
        f"{e6_level_name(level)}, by the cells whose suffix differs (exactly those, of test-ref, ref-test and"
        f" test-test): {', '.join(seen)}"
    )
    if unseen:
        n = patterns[unseen[0]]["n"]
        high = patterns[unseen[0]]["wilson95"][1]
        text += f"; 0/{n} each (Wilson upper bound {percent(high)}): {', '.join(unseen)}"
    return text + "."


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
