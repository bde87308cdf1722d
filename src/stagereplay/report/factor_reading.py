"""The card's reading of E6: per factor level, what its caches and served suffixes show and where a divergence
enters (``e6_reading``), the cells that differ, the sides compared, and the margins at each flip (``flip_margins_reading``,
E1's included). Every number is read from summary.json."""

from __future__ import annotations

from stagereplay.design.factors import factor_named
from stagereplay.report.text import experiment_name, level_name, percent, wilson_text

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
    text = f"{name}: {cache_text}; suffixes differ on {suffixes['count']}/{n} {served} ({wilson_text(suffixes)})"
    verdicts = level["verdicts"]
    latent = verdicts["latent"]["count"]
    if verdicts["none"]["count"] == n:
        return f"{text}; no cell of any item continues differently from the reference (verdict none on {n}/{n})."
    # Only the items whose served suffix differs get a side; a one-sided difference alone is latent.
    latent_text = (
        f"; on {latent}/{n} items a one-sided cell differs but the served suffix does not (latent,"
        f" {wilson_text(verdicts['latent'])})"
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
    seen = [f"{pattern} {c['count']}/{c['n']} ({wilson_text(c)})" for pattern, c in patterns.items() if c["count"]]
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
