import math

import numpy as np
import pytest
from scipy import stats

from stagereplay.report.stats import (
    mcnemar_exact,
    paired_counts,
    paired_difference_ci,
    paired_difference_newcombe,
    paired_difference_wald,
    wilson_interval,
)


def _paper_pair() -> tuple[np.ndarray, np.ndarray]:
    # 200 items: 11 right only on a, 9 right only on b, 50 right on both.
    a = np.zeros(200, dtype=bool)
    b = np.zeros(200, dtype=bool)
    a[0:11] = True
    b[11:20] = True
    a[20:70] = True
    b[20:70] = True
    return a, b


def test_wilson_zero_of_200_matches_paper():
    low, high = wilson_interval(0, 200)
    assert low == 0.0
    assert high == pytest.approx(0.0188, abs=5e-5)


def test_wilson_matches_closed_formula():
    k, n = 10, 50
    z = stats.norm.ppf(0.975)
    p = k / n
    centre = p + z**2 / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    denom = 1 + z**2 / n
    low, high = wilson_interval(k, n)
    assert low == pytest.approx((centre - half) / denom, rel=1e-9)
    assert high == pytest.approx((centre + half) / denom, rel=1e-9)


def test_wilson_wider_at_higher_confidence():
    low95, high95 = wilson_interval(10, 50, 0.95)
    low99, high99 = wilson_interval(10, 50, 0.99)
    assert low99 < low95 and high99 > high95


@pytest.mark.parametrize("k,n", [(0, 0), (1, -3), (-1, 10), (11, 10)])
def test_wilson_bad_inputs(k, n):
    with pytest.raises(ValueError):
        wilson_interval(k, n)


def test_paired_difference_matches_paper():
    a, b = _paper_pair()
    d, low, high = paired_difference_ci(a, b)
    assert d == 0.01
    assert abs(low - (-0.035)) <= 0.006
    assert abs(high - 0.055) <= 0.006
    assert low < d < high


def test_paired_difference_sign_flips():
    a, b = _paper_pair()
    d, low, high = paired_difference_ci(b, a)
    assert d == -0.01
    assert low < d < high


def test_paired_difference_deterministic_per_seed():
    a, b = _paper_pair()
    assert paired_difference_ci(a, b, seed=3) == paired_difference_ci(a, b, seed=3)
    # A different seed may or may not move the percentiles; with few resamples
    # at least one of several seeds must differ, or the seed is being ignored.
    results = {paired_difference_ci(a, b, n_resamples=200, seed=s) for s in range(5)}
    assert len(results) > 1


def test_identical_arrays_give_degenerate_interval():
    a, _ = _paper_pair()
    d, low, high = paired_difference_ci(a, a.copy())
    assert (d, low, high) == (0.0, 0.0, 0.0)


def test_constant_nonzero_difference_is_degenerate_too():
    a = np.ones(30, dtype=bool)
    b = np.zeros(30, dtype=bool)
    result = paired_difference_ci(a, b)
    assert result == (1.0, 1.0, 1.0)
    assert not any(math.isnan(x) for x in result)


def test_accepts_lists_of_bools():
    d, low, high = paired_difference_ci([True, False, True, True], [False, False, True, False])
    assert d == 0.5
    assert low <= d <= high


@pytest.mark.parametrize(
    "a,b",
    [
        ([True, False], [True]),
        ([], []),
        ([0.5, 1.0], [1.0, 0.0]),
    ],
)
def test_paired_difference_bad_inputs(a, b):
    with pytest.raises(ValueError):
        paired_difference_ci(a, b)


def _table(both: int, a_only: int, b_only: int, neither: int) -> tuple[np.ndarray, np.ndarray]:
    """Correctness vectors with the given paired 2x2 table."""
    a = [True] * both + [True] * a_only + [False] * b_only + [False] * neither
    b = [True] * both + [False] * a_only + [True] * b_only + [False] * neither
    return np.array(a), np.array(b)


# Cavo et al. (2012), complete response before and after consolidation therapy: the
# worked paired example of Fagerland, Lydersen and Laake, "Statistical Analysis of
# Contingency Tables" (2017), chapter 8, whose published figures are checked below.
CAVO = _table(59, 6, 16, 80)


def test_paired_counts():
    counts = paired_counts(*CAVO)
    assert (counts.both, counts.a_only, counts.b_only, counts.neither, counts.n) == (59, 6, 16, 80, 161)


def test_newcombe_matches_published_cavo_example():
    difference, low, high = paired_difference_newcombe(*CAVO)
    assert difference == pytest.approx(-0.0621, abs=5e-5)
    assert low == pytest.approx(-0.1186, abs=5e-5)
    assert high == pytest.approx(-0.0046, abs=5e-5)


def test_wald_matches_published_cavo_example():
    difference, low, high = paired_difference_wald(*CAVO)
    assert difference == pytest.approx(-0.0621, abs=5e-5)
    assert low == pytest.approx(-0.1184, abs=5e-5)
    assert high == pytest.approx(-0.0058, abs=5e-5)


def test_mcnemar_exact_is_the_binomial_tail_of_the_discordant_pairs():
    a_only, b_only, p_value = mcnemar_exact(*CAVO)
    assert (a_only, b_only) == (6, 16)
    # Two-sided exact conditional test: twice the lower tail of Binomial(22, 1/2) at 6.
    tail = sum(math.comb(22, k) for k in range(7)) / 2**22
    assert p_value == pytest.approx(2 * tail, rel=1e-12)
    assert p_value == pytest.approx(0.0525, abs=5e-5)


def test_mcnemar_without_discordant_pairs_is_one():
    a, b = _table(3, 0, 0, 5)
    assert mcnemar_exact(a, b) == (0, 0, 1.0)


def _closed_form_wilson(k: int, n: int, z: float) -> tuple[float, float]:
    p = k / n
    centre = (2 * n * p + z**2) / (2 * (n + z**2))
    half = z * math.sqrt(z**2 + 4 * n * p * (1 - p)) / (2 * (n + z**2))
    return centre - half, centre + half


def _independent_newcombe(both: int, a_only: int, b_only: int, neither: int) -> tuple[float, float]:
    """Newcombe (1998) method 10 written out from the paper's formulas."""
    n = both + a_only + b_only + neither
    z = stats.norm.ppf(0.975)
    e, f = both + a_only, b_only + neither  # row margins: a right, a wrong
    g, h = both + b_only, a_only + neither  # column margins: b right, b wrong
    p1, p2 = e / n, g / n
    l1, u1 = _closed_form_wilson(e, n, z)
    l2, u2 = _closed_form_wilson(g, n, z)
    cross = both * neither - a_only * b_only
    if e * f * g * h == 0:
        phi = 0.0
    elif cross > n / 2:
        phi = (cross - n / 2) / math.sqrt(e * f * g * h)
    elif cross >= 0:
        phi = 0.0
    else:
        phi = cross / math.sqrt(e * f * g * h)
    d = p1 - p2
    delta = math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    epsilon = math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    return d - delta, d + epsilon


@pytest.mark.parametrize("table", [(1, 1, 7, 12), (50, 11, 9, 130), (0, 3, 1, 4), (4, 0, 0, 0), (2, 5, 0, 1)])
def test_newcombe_matches_the_formula_written_out(table):
    a, b = _table(*table)
    difference, low, high = paired_difference_newcombe(a, b)
    expected_low, expected_high = _independent_newcombe(*table)
    assert difference == pytest.approx((table[1] - table[2]) / sum(table), abs=1e-15)
    assert low == pytest.approx(expected_low, abs=1e-12)
    assert high == pytest.approx(expected_high, abs=1e-12)
    assert -1 <= low <= difference <= high <= 1


def test_paired_intervals_agree_on_the_paper_pair_roughly():
    # 200 items, discordant 11 vs 9: the three methods should tell the same story.
    a, b = _paper_pair()
    intervals = [paired_difference_ci(a, b)[1:], paired_difference_newcombe(a, b)[1:], paired_difference_wald(a, b)[1:]]
    for low, high in intervals:
        assert low < 0 < high
        assert abs(low - (-0.035)) < 0.01 and abs(high - 0.055) < 0.01


def test_wald_collapses_without_discordant_pairs_but_newcombe_does_not():
    a, b = _table(3, 0, 0, 5)
    assert paired_difference_wald(a, b) == (0.0, 0.0, 0.0)
    _, low, high = paired_difference_newcombe(a, b)
    assert low < 0 < high


@pytest.mark.parametrize("function", [paired_difference_newcombe, paired_difference_wald, mcnemar_exact])
@pytest.mark.parametrize("a,b", [([True, False], [True]), ([], []), ([0.5, 1.0], [1.0, 0.0])])
def test_paired_tests_reject_bad_inputs(function, a, b):
    with pytest.raises(ValueError):
        function(a, b)


def test_overlap_chance_is_the_hypergeometric_tail_written_out():
    from math import comb

    from stagereplay.report.stats import overlap_chance

    # 11 of 19 items in a set of 18 out of 48: the tail counted by hand, draw by draw.
    figures = overlap_chance(11, 19, 18, 48)
    by_hand = sum(comb(18, k) * comb(30, 19 - k) for k in range(11, 19)) / comb(48, 19)
    assert figures["p_at_least"] == pytest.approx(by_hand, rel=1e-9)
    assert figures["expected"] == pytest.approx(19 * 18 / 48)
    assert overlap_chance(0, 19, 18, 48)["p_at_least"] == pytest.approx(1.0)  # at least none: certain
    # Symmetric in the two sets, and smaller for a larger overlap.
    assert overlap_chance(11, 18, 19, 48)["p_at_least"] == pytest.approx(figures["p_at_least"])
    assert overlap_chance(12, 19, 18, 48)["p_at_least"] < figures["p_at_least"]
    with pytest.raises(ValueError, match="impossible"):
        overlap_chance(20, 19, 18, 48)
