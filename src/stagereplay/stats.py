"""Confidence intervals for accuracy and paired accuracy differences.

Thin wrappers around scipy.stats so the statistics are the library's, and this
module only adds input validation and edge-case handling.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    a_arr = _as_bool_array(a, "a")
    b_arr = _as_bool_array(b, "b")
    if a_arr.size != b_arr.size:
        raise ValueError(f"a and b must have equal length (paired items), got {a_arr.size} and {b_arr.size}")
    if a_arr.size == 0:
        raise ValueError("a and b must not be empty")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")

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
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)
