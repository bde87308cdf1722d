"""E6's cells and the verdict of an item (no torch).

A cell builds an item's boundary state under one setting and continues under another, each the
reference ("ref") or the test level ("test"); the reference cell (ref, ref) is E2's prefill row. From the
suffixes of an item's cells come the pattern of which cells differ (``differing_cells``, named by
``pattern_name``) and its verdict (``item_verdict``), served first: only an item whose served suffix
differs from the reference's gets a side. Which cells a factor has is the factor's (``design.factors``).
"""

from __future__ import annotations

# Cells, as (build, read): "ref" or "test".
WRITE = ("test", "ref")
READ = ("ref", "test")
SERVER = ("test", "test")
FULL = (WRITE, READ, SERVER)
CELL_LABELS = tuple(f"{build}-{read}" for build, read in FULL)  # as the factor rows name them: "test-ref", ...
# An item's verdict (item_verdict). `latent` and `none` are the items whose served suffix equals the reference's;
# each of the others says the served suffix differs, and where the difference enters.
VERDICTS = ("none", "latent", "write", "read", "both", "interaction", "served")
SERVED_VERDICTS = ("write", "read", "both", "interaction", "served")


def cell_label(cell: tuple[str, str]) -> str:
    return f"{cell[0]}-{cell[1]}"


def pattern_name(differing: list[str] | tuple[str, ...]) -> str:
    """A pattern's name: the labels of the cells whose suffix differs from the reference's, in the order of
    ``FULL``, joined by "+" ("test-ref+test-test"), or "none". The cells not named equal the reference."""
    return "+".join(differing) or "none"


def cell_patterns(cells: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """Every pattern of which of ``cells`` differ, as ``pattern_name`` names it: 2**k for k cells, so eight for
    the full 2x2, and two for a build-only (test-ref) or a server-only (test-test) factor. Counted in binary
    with the served cell as the highest digit, so the patterns whose served suffix equals the reference's
    come first."""
    labels = [cell_label(cell) for cell in FULL if cell in cells]
    return tuple(
        pattern_name([label for digit, label in enumerate(labels) if index >> digit & 1])
        for index in range(2 ** len(labels))
    )


def differing_cells(
    reference: list[int], write: list[int] | None, read: list[int] | None, server: list[int] | None
) -> tuple[str, ...]:
    """The labels of the cells whose suffix differs from the reference's, in the order of ``FULL``; a cell the
    factor does not have (None) is never listed."""
    return tuple(
        cell_label(cell)
        for cell, suffix in zip(FULL, (write, read, server))
        if suffix is not None and suffix != reference
    )


# The verdict of an item whose served suffix differs, by whether (t, r) and (r, t) differ.
SIDES = {(True, False): "write", (False, True): "read", (True, True): "both", (False, False): "interaction"}


def item_verdict(
    reference: list[int], write: list[int] | None, read: list[int] | None, server: list[int] | None
) -> str:
    """Where the divergence of one item enters, from the suffixes of its cells (token lists; None for a cell
    the factor does not have). Served first: only an item whose served suffix differs from the reference's
    gets a side, since a one-sided cell alone is not what a server returns.

    - ``none``: every cell continues like the reference;
    - ``latent``: a one-sided cell (``(t, r)`` or ``(r, t)``) differs, the served suffix ``(t, t)`` does not;
    - the served suffix differs, and ``write``: ``(t, r)`` differs and ``(r, t)`` does not; ``read``: the other
      way round; ``both``: both differ; ``interaction``: neither does.

    For a build-only factor (``read`` and ``server`` None) the served cell is ``(t, r)``, and reading is the
    reference's by construction, so it is ``write`` or ``none``. For a factor with (t, t) alone (``write`` and
    ``read`` None, server-only) it is ``served`` (the level changes the continuation, where it enters is not
    separable) or ``none``. With identical cache bytes ``(t, r)`` is the reference computation and ``(t, t)``
    is ``(r, t)``'s, so such an item is ``none`` or ``read``.
    """
    shape = tuple(suffix is not None for suffix in (write, read, server))
    if shape == (False, False, True):
        return "served" if server != reference else "none"
    if shape == (True, False, False):
        return "write" if write != reference else "none"
    if shape != (True, True, True):
        present = [cell_label(cell) for cell, there in zip(FULL, shape) if there]
        raise ValueError(
            f"an item has the cells {', '.join(present) or 'none'}: a factor level has test-ref alone (build-only),"
            " test-test alone (server-only) or all three"
        )
    if server != reference:
        return SIDES[(write != reference, read != reference)]
    return "latent" if write != reference or read != reference else "none"
