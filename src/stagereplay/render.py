"""How the card is written: numbers as text, and its blocks as Markdown and as HTML.

The card is one document written twice: Markdown (results.md, for the ledger and
for diffs) and HTML (shown inside the Snakemake report, which displays only HTML
and images). Blocks are ("heading", level, text), ("paragraph", text),
("bullets", [text]) and ("table", header, rows); `code` spans are marked with backticks.
"""

from __future__ import annotations

import html
import re


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def points(fraction: float) -> str:
    return f"{100 * fraction:+.1f}"


def experiment_name(experiment: str, precision: str | None, checkpoint: str, summary: dict) -> str:
    """'E1 matched (bf16)'; with several checkpoints, 'E1 matched (bf16, tiny-b)'."""
    where = ", ".join(part for part in (precision, checkpoint if len(summary["checkpoints"]) > 1 else None) if part)
    return f"{experiment} ({where})" if where else experiment


def _markdown_cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[tuple]) -> str:
    out: list[str] = []
    for kind, *body in blocks:
        if kind == "heading":
            out.append("#" * body[0] + " " + body[1])
        elif kind == "paragraph":
            out.append(body[0])
        elif kind == "bullets":
            out.append("\n".join(f"- {item}" for item in body[0]))
        else:
            header, rows = body
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(_markdown_cell(value) for value in row) + " |" for row in rows]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _html_text(value: object) -> str:
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(str(value)))


def to_html(blocks: list[tuple]) -> str:
    out = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8"><title>stagereplay results card</title>',
        "<style>body{font-family:sans-serif;max-width:70em;margin:1em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #bbb;padding:2px 6px;text-align:left;font-size:90%}</style></head><body>",
    ]
    for kind, *body in blocks:
        if kind == "heading":
            out.append(f"<h{body[0]}>{_html_text(body[1])}</h{body[0]}>")
        elif kind == "paragraph":
            out.append(f"<p>{_html_text(body[0])}</p>")
        elif kind == "bullets":
            out.append("<ul>" + "".join(f"<li>{_html_text(item)}</li>" for item in body[0]) + "</ul>")
        else:
            header, rows = body
            out.append(
                "<table><tr>"
                + "".join(f"<th>{_html_text(cell)}</th>" for cell in header)
                + "</tr>"
                + "".join("<tr>" + "".join(f"<td>{_html_text(cell)}</td>" for cell in row) + "</tr>" for row in rows)
                + "</table>"
            )
    out.append("</body></html>")
    return "\n".join(out) + "\n"
