"""Where two JSON-like values differ: the one walker of dicts and lists.

verify (summary.json and audit/e4.json against their recomputation), the provenance checks (a config
against the design a ledger recorded) and ``bench/same_ledger.py`` (two ledgers' summaries) all
walk through it. A difference is named by its key path: dict keys and list indices, in order. No torch.
"""

from __future__ import annotations

from collections.abc import Iterator


def same_leaf(a, b, strict: bool = True) -> bool:
    """Two values the walker does not descend into are the same: equal (and of one type when
    ``strict``: 1 is not 1.0, nor True), or both NaN (a value the same computation gives twice)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b and (not strict or type(a) is type(b))


def differences(
    a, b, path: tuple = (), *, sort_keys: bool = False, into_lists: bool = True, strict: bool = True
) -> Iterator[tuple]:
    """Every key path at which ``a`` and ``b`` differ, depth first and lazily (``first_difference`` stops
    at the first). Dict keys go in ``a``'s order, then those only ``b`` has (``sort_keys``: all sorted); a
    key one side lacks is a difference at that key. Lists are walked index by index (``into_lists``; else
    compared whole), a difference in length being one at the first index the shorter lacks."""
    options = {"sort_keys": sort_keys, "into_lists": into_lists, "strict": strict}
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted({*a, *b}) if sort_keys else [*a, *(key for key in b if key not in a)]
        for key in keys:
            if key not in a or key not in b:
                yield (*path, key)
            else:
                yield from differences(a[key], b[key], (*path, key), **options)
        return
    if into_lists and isinstance(a, list) and isinstance(b, list):
        for index, (x, y) in enumerate(zip(a, b)):
            yield from differences(x, y, (*path, index), **options)
        if len(a) != len(b):
            yield (*path, min(len(a), len(b)))
        return
    if not same_leaf(a, b, strict):
        yield path


def first_difference(a, b, **options) -> tuple | None:
    """The key path of the first place ``a`` and ``b`` differ (``differences``' options), or None."""
    return next(differences(a, b, **options), None)


def value_at(data, path: tuple, absent="absent"):
    """The value at a key path, or ``absent`` where the path leads nowhere."""
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return absent
    return data


def path_text(path: tuple) -> str:
    """A key path as text: ``E1.items[3].correct``."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")
