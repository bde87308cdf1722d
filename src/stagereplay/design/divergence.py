"""Where two token sequences part: the one definition of a first divergence, for every experiment and report.

No torch, no other module of the library: the comparisons, the audit and the served requests' figures all read
it from here.
"""

from __future__ import annotations


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix of the other."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))
