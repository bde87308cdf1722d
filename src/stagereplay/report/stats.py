"""Confidence intervals and tests for accuracy and paired accuracy differences.

Thin wrappers around scipy.stats so the statistics are the library's, and this
module only adds input validation and edge-case handling.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


def _as_bool_array(x: Sequence[bool] | np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of booleans, got shape {arr.shape}")
    if arr.dtype != bool:
        # Accept 0/1 ints but reject anything else so a score of 0.7 is not silently truthy.
        if not np.isin(arr, (0, 1)).all():
            raise ValueError(f"{name} must contain only booleans (or 0/1)")
        arr = arr.astype(bool)
    return arr


def _paired_arrays(a: Sequence[bool] | np.ndarray, b: Sequence[bool] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a_arr = _as_bool_array(a, "a")
    b_arr = _as_bool_array(b, "b")
    if a_arr.size != b_arr.size:
        raise ValueError(f"a and b must have equal length (paired items), got {a_arr.size} and {b_arr.size}")
    if a_arr.size == 0:
        raise ValueError("a and b must not be empty")
    return a_arr, b_arr


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _mean_difference(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def paired_difference_ci(
    a: Sequence[bool] | np.ndarray,
    b: Sequence[bool] | np.ndarray,
    confidence: float = 0.95,
    n_resamples: int = 10000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Difference mean(a) - mean(b) with a paired percentile-bootstrap CI.

    a, b: per-item correctness on the same items, in the same order.
    Returns (difference, low, high) as fractions (0.01 == 1 percentage point).
    """
    a_arr, b_arr = _paired_arrays(a, b)
    _check_confidence(confidence)

    n = a_arr.size
    # Integer counts keep the point estimate exact (2/200 == 0.01, while
    # 0.35 - 0.34 in floats is 0.010000000000000009).
    diff = (int(a_arr.sum()) - int(b_arr.sum())) / n

    per_item = a_arr.astype(np.int8) - b_arr.astype(np.int8)
    if (per_item == per_item[0]).all():
        # Every resample has the same statistic; scipy's percentile method
        # happens to cope in 1.17 but BCa returns NaN with a
        # DegenerateDataWarning, so we do not rely on it.
        return diff, diff, diff

    result = stats.bootstrap(
        (a_arr.astype(float), b_arr.astype(float)),
        _mean_difference,
        paired=True,
        vectorized=True,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    low = float(result.confidence_interval.low)
    high = float(result.confidence_interval.high)
    return diff, low, high


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for k successes out of n trials."""
    if n <= 0:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, n={n}], got {k}")
    _check_confidence(confidence)
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


@dataclass(frozen=True)
class PairedCounts:
    """The paired 2x2 table of two correctness vectors over the same items."""

    both: int
    a_only: int
    b_only: int
    neither: int

    @property
    def n(self) -> int:
        return self.both + self.a_only + self.b_only + self.neither


def paired_counts(a: Sequence[bool] | np.ndarray, b: Sequence[bool] | np.ndarray) -> PairedCounts:
    a_arr, b_arr = _paired_arrays(a, b)
    return PairedCounts(
        both=int((a_arr & b_arr).sum()),
        a_only=int((a_arr & ~b_arr).sum()),
        b_only=int((~a_arr & b_arr).sum()),
        neither=int((~a_arr & ~b_arr).sum()),
    )


MCNEMAR = "exact McNemar (two-sided binomial test on the discordant pairs)"  # how a summary names it


def mcnemar_exact(a: Sequence[bool] | np.ndarray, b: Sequence[bool] | np.ndarray) -> tuple[int, int, float]:
    """Exact (conditional) McNemar test of equal accuracy on paired items.

    Under the null each discordant pair is equally likely to favour a or b, so
    the test is a two-sided binomial test of a_only out of the discordant pairs.
    Returns (a_only, b_only, p_value); p is 1.0 when there is no discordant pair.
    """
    counts = paired_counts(a, b)
    discordant = counts.a_only + counts.b_only
    if discordant == 0:
        return 0, 0, 1.0
    p_value = stats.binomtest(counts.a_only, discordant, 0.5, alternative="two-sided").pvalue
    return counts.a_only, counts.b_only, float(p_value)


def paired_difference_wald(
    a: Sequence[bool] | np.ndarray, b: Sequence[bool] | np.ndarray, confidence: float = 0.95
) -> tuple[float, float, float]:
    """Difference mean(a) - mean(b) with the Wald interval for paired proportions.

    Standard error sqrt((a_only + b_only) - (a_only - b_only)**2 / n) / n. Shown for
    comparison only: it collapses to a point when there is no discordant pair and
    may overshoot [-1, 1] (it is clipped there).
    """
    _check_confidence(confidence)
    counts = paired_counts(a, b)
    n = counts.n
    difference = (counts.a_only - counts.b_only) / n
    z = stats.norm.ppf(0.5 + confidence / 2)
    standard_error = np.sqrt((counts.a_only + counts.b_only) - (counts.a_only - counts.b_only) ** 2 / n) / n
    return difference, max(-1.0, difference - z * standard_error), min(1.0, difference + z * standard_error)


def paired_difference_newcombe(
    a: Sequence[bool] | np.ndarray, b: Sequence[bool] | np.ndarray, confidence: float = 0.95
) -> tuple[float, float, float]:
    """Difference mean(a) - mean(b) with Newcombe's (1998) hybrid score interval for paired data.

    Method 10 of Newcombe, Statistics in Medicine 17:2635-2650 ("square and add"):
    the Wilson intervals of the two marginal accuracies combined with the
    estimated correlation phi between them, whose numerator (A*D - B*C) is
    shrunk towards 0 by n/2 when positive, as in the paper.
    """
    _check_confidence(confidence)
    counts = paired_counts(a, b)
    n = counts.n
    a_correct, b_correct = counts.both + counts.a_only, counts.both + counts.b_only
    p1, p2 = a_correct / n, b_correct / n
    difference = (counts.a_only - counts.b_only) / n
    l1, u1 = wilson_interval(a_correct, n, confidence)
    l2, u2 = wilson_interval(b_correct, n, confidence)
    margins = a_correct * (n - a_correct) * b_correct * (n - b_correct)
    if margins == 0:
        phi = 0.0
    else:
        cross = counts.both * counts.neither - counts.a_only * counts.b_only
        numerator = cross - n / 2 if cross > n / 2 else (0.0 if cross >= 0 else cross)
        phi = numerator / np.sqrt(float(margins))
    below = np.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    above = np.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    return difference, float(difference - below), float(difference + above)


def overlap_chance(shared: int, first: int, second: int, items: int) -> dict:
    """The chance baseline of an overlap: ``shared`` items lie in both of two sets of ``first`` and ``second``
    items out of ``items``. Were the second set a random draw of its size, the overlap would be hypergeometric:
    ``expected`` = first * second / items on average, and ``p_at_least`` the probability of ``shared`` or more
    (one-sided: an overlap is read as "more than chance"). Uncorrected, like every p-value here."""
    if not 0 <= shared <= min(first, second) or max(first, second) > items:
        raise ValueError(f"an overlap of {shared} between sets of {first} and {second} of {items} items is impossible")
    distribution = stats.hypergeom(items, first, second)
    return {
        "shared": shared,
        "first": first,
        "second": second,
        "items": items,
        "expected": first * second / items,
        "p_at_least": float(distribution.sf(shared - 1)),
        "test": "hypergeometric upper tail (one-sided), uncorrected",
    }


def share(count: int, n: int) -> dict:
    """x/N with its Wilson interval; with n = 0 nothing was observed, so it is marked not measured."""
    low, high = wilson_interval(count, n) if n else (None, None)
    return {
        "count": int(count),
        "n": int(n),
        "rate": count / n if n else None,
        "wilson95": [low, high],
        "measured": n > 0,
    }


def grouped(rows: list[dict], key) -> dict[str, list[dict]]:
    """Rows grouped by ``key``, in key order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return dict(sorted(groups.items()))


def upper_bound(k: int, n: int, confidence: float = 0.95) -> float:
    """The one-sided upper confidence bound on a rate of which k of n were seen (Clopper-Pearson, exact): with k = 0,
    the largest share that n clean trials still leave plausible."""
    if n <= 0:
        raise ValueError(f"n must be >= 1, got {n}")
    _check_confidence(confidence)
    ci = stats.binomtest(int(k), int(n), alternative="less").proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.high)
