"""A stamp on a rendered document: which summary.json it was drawn from, and that it is unedited.

The results card (Markdown and HTML) ends with one line
``<!-- stagereplay stamp: source xxh3-128 <hex>; body xxh3-128 <hex> -->``: the
digest of the summary.json bytes it was rendered from, and of the text above
that line. An HTML comment is invisible in both formats, and a digest of the
source (not of the tables) is enough: summary.json is itself checked against
the tables by ``stagereplay verify``.
"""

from __future__ import annotations

import re

from stagereplay.ledger.fingerprint import bytes_digest

_STAMP = re.compile(
    r"(?s)(?P<body>.*\n)?<!-- stagereplay stamp: source xxh3-128 (?P<source>[0-9a-f]{32}); "
    r"body xxh3-128 (?P<digest>[0-9a-f]{32}) -->\n?"
)

REDRAW = "rerun snakemake --forcerun report to redraw it"


def stamp(text: str, source: bytes) -> str:
    """``text`` with the stamp appended as its final line (a newline first, if the text lacks one)."""
    body = text if text.endswith("\n") or not text else text + "\n"
    return f"{body}<!-- stagereplay stamp: source xxh3-128 {bytes_digest(source)}; body xxh3-128 {bytes_digest(body.encode())} -->\n"


def stamp_problem(text: str, source: bytes) -> str | None:
    """What is wrong with a stamped document, as one line with its fix; None when it matches ``source``."""
    match = _STAMP.fullmatch(text)
    if match is None:
        return f"carries no stamp (not written by stagereplay report, or edited at its end) — {REDRAW}"
    if bytes_digest((match["body"] or "").encode()) != match["digest"]:
        return f"edited after it was written — {REDRAW}"
    if bytes_digest(source) != match["source"]:
        return "rendered from another summary.json — rerun snakemake to redraw it"
    return None
