"""How the card is written: numbers as text, and its blocks as Markdown and as HTML.

The card is one document written twice: Markdown (results.md, for the ledger and
for diffs) and HTML (shown inside the Snakemake report, which displays only HTML
and images). Blocks are ("heading", level, text), ("paragraph", text),
("bullets", [text]), ("table", header, rows), ("image", caption, PNG bytes, relative path)
and ("items", item_view records, {item id: PNG bytes}); `code` spans are marked with backticks.

The HTML is one self-contained file (styles in <style>, images as data: URIs), so it can be
mailed or attached; nothing in it needs sideways scrolling (tokens and tables wrap).
"""

from __future__ import annotations

import base64
import html
import re

from stagereplay.report.item_view import ItemRecord, cache_text, divergence_text, label_text, visible


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
        elif kind == "image":
            caption, _, relative = body
            out.append(f"![{caption}]({relative})")
        elif kind == "items":
            out.append(_items_markdown(body[0]))
        elif kind == "details":  # a collapsible section in HTML; a headed one in Markdown
            title, inner = body
            out.append(f"### {title}\n\n" + to_markdown(inner).rstrip("\n"))
        elif kind == "panel":
            out.append(to_markdown([("table", *body)]).rstrip("\n"))
        else:
            header, rows = body
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(_markdown_cell(value) for value in row) + " |" for row in rows]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _html_text(value: object) -> str:
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(str(value)))


def to_html(blocks: list[tuple]) -> str:
    head = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8"><title>stagereplay results card</title>',
        f"<style>{STYLE}</style></head><body>",
    ]
    return "\n".join([*head, _html_body(blocks), "</body></html>"]) + "\n"


def _html_body(blocks: list[tuple]) -> str:
    out = []
    for kind, *body in blocks:
        if kind == "heading":
            out.append(f"<h{body[0]}>{_html_text(body[1])}</h{body[0]}>")
        elif kind == "paragraph":
            out.append(f"<p>{_html_text(body[0])}</p>")
        elif kind == "bullets":
            out.append("<ul>" + "".join(f"<li>{_html_text(item)}</li>" for item in body[0]) + "</ul>")
        elif kind == "image":
            caption, png, _ = body
            out.append(
                f'<figure class="plot"><img src="{_data_uri(png)}" alt="{html.escape(caption)}">'
                f"<figcaption>{_html_text(caption)}</figcaption></figure>"
            )
        elif kind == "items":
            out.append(_items_html(*body))
        elif kind == "details":
            title, inner = body
            out.append(f"<details><summary>{_html_text(title)}</summary>{_html_body(inner)}</details>")
        elif kind == "panel":
            out.append(_html_table(*body).replace("<table>", '<table class="answer" id="answer">', 1))
        else:
            out.append(_html_table(*body))
    return "\n".join(out)


STYLE = (
    "body{font-family:sans-serif;max-width:70em;margin:1em auto;padding:0 1em}"
    "table{border-collapse:collapse;max-width:100%}"
    "td,th{border:1px solid #bbb;padding:2px 6px;text-align:left;font-size:90%;overflow-wrap:anywhere}"
    "td.nw{white-space:nowrap;overflow-wrap:normal}th{overflow-wrap:normal}"
    "figure.plot img{max-width:100%;height:auto}figure.plot{margin:1em 0}"
    "section.item-entry{border-top:2px solid #ccc;margin:1.2em 0;padding-top:.4em}"
    "section.item-entry h3{margin:.2em 0;font-size:110%}"
    ".question{margin:.3em 0}.choices{margin:0 0 .4em 0;padding-left:1.5em}"
    ".suffix{display:flex;flex-wrap:wrap;gap:2px;font-family:monospace;font-size:100%;margin:.4em 0}"
    ".cell{display:inline-flex;flex-direction:column;border:1px solid #e4e4e4;padding:0 2px;min-width:1.2em}"
    ".cell span{white-space:pre-wrap;overflow-wrap:anywhere}.cell .pos{color:#999;font-size:75%}"
    ".cell.head{border:none;color:#555;font-family:sans-serif}"
    ".cell.after span.tok{color:#a33}"
    "mark.diverge{background:#ffd54f;outline:2px solid #c62828}"
    ".side-label{font-size:85%;color:#444}"
    "table.transplants,table.labels{font-size:90%;margin:.3em 0}"
    "img.layers{display:block;max-width:100%;height:auto}"
    "table.answer{margin:.5em 0 1em 0}table.answer td{font-size:100%}"
    "details{margin:.3em 0}details summary{cursor:pointer;font-weight:bold}"
)


WIDE = 8  # columns: a wider table (the environment) is turned on its side, one row per column


def _html_table(header: list[str], rows: list[list]) -> str:
    if len(header) > WIDE:
        return (
            '<table class="sideways">'
            + "".join(
                f"<tr><th>{_html_text(name)}</th>" + "".join(_html_cell(row[index]) for row in rows) + "</tr>"
                for index, name in enumerate(header)
            )
            + "</table>"
        )
    return (
        "<table><tr>"
        + "".join(f"<th>{_html_text(cell)}</th>" for cell in header)
        + "</tr>"
        + "".join("<tr>" + "".join(_html_cell(cell) for cell in row) + "</tr>" for row in rows)
        + "</table>"
    )


def _html_cell(value: object) -> str:
    # Short cells (counts, estimates, intervals) never break; long ones wrap anywhere, so no table is wider
    # than the page.
    attribute = ' class="nw"' if len(str(value)) <= 18 else ""
    return f"<td{attribute}>{_html_text(value)}</td>"


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _token_html(token: str, marked: bool) -> str:
    text = html.escape(visible(token)) or "&nbsp;"
    return f'<mark class="diverge tok">{text}</mark>' if marked else f'<span class="tok">{text}</span>'


def _suffixes_html(record: ItemRecord) -> str:
    """Live over prefill, position by position: each cell holds both sides' token at one suffix step."""
    at = record.first_divergence
    cells = ['<span class="cell head"><span class="pos">step</span><span>live</span><span>prefill</span></span>']
    for index in range(max(len(record.live.tokens), len(record.prefill.tokens))):
        tokens = [side.tokens[index] if index < len(side.tokens) else "" for side in record.sides()]
        after = " after" if at is not None and index > at else ""
        cells.append(
            f'<span class="cell{after}" data-pos="{index}"><span class="pos">{index}</span>'
            + "".join(_token_html(token, index == at) for token in tokens)
            + "</span>"
        )
    return '<div class="suffix">' + "".join(cells) + "</div>"


def _labels_html(record: ItemRecord) -> str:
    rows = "".join(
        f"<tr><td>{name}</td><td>{html.escape(side.label)}</td>"
        f"<td>{html.escape(side.parsed_answer or 'unparsable')} ({'correct' if side.parsed_correct else 'wrong'})</td>"
        f"<td>{side.readout_answer} ({'correct' if side.readout_correct else 'wrong'}; margin"
        f" {side.readout_margin:.4g})</td><td>{html.escape(side.stop)}</td></tr>"
        for name, side in zip(("live", "prefill"), record.sides())
    )
    return (
        '<table class="labels"><tr><th>side</th><th>trajectory</th><th>parsed</th><th>readout</th>'
        f"<th>suffix stop</th></tr>{rows}</table>"
    )


def _transplants_html(record: ItemRecord) -> str:
    if not record.transplants:
        return "<p>Transplants: none for this item.</p>"
    rows = "".join(
        f"<tr><td>{html.escape(t.selection)}</td><td>{html.escape(t.direction)}</td>"
        f"<td>{html.escape(t.subset)}</td><td>{html.escape(t.outcome)}</td></tr>"
        for t in record.transplants
    )
    return (
        f'<p>Transplants ({html.escape(record.transplant_outcomes())}):</p><table class="transplants"><tr><th>selection</th>'
        f"<th>donor -&gt; recipient</th><th>subset</th><th>outcome</th></tr>{rows}</table>"
    )


def _question_html(record: ItemRecord) -> str:
    choices = "".join(f"<li>{letter}) {html.escape(choice)}</li>" for letter, choice in zip("ABCD", record.choices))
    return (
        f'<p class="question">{html.escape(record.question)}</p><ul class="choices">{choices}</ul>'
        f"<p>Correct: {record.answer}</p>"
    )


def _entry_html(record: ItemRecord, png: bytes) -> str:
    return (
        f'<section class="item-entry divergent" id="item-{html.escape(record.checkpoint)}-{html.escape(record.item_id)}"'
        f' data-item="{html.escape(record.item_id)}" data-checkpoint="{html.escape(record.checkpoint)}">'
        f"<h3>{html.escape(record.item_id)}: {html.escape(divergence_text(record))}</h3>"
        + _question_html(record)
        + _suffixes_html(record)
        + _labels_html(record)
        + f"<p>{html.escape(cache_text(record))}</p>"
        + f'<img class="layers" src="{_data_uri(png)}" alt="per-layer cache difference, {html.escape(record.item_id)}">'
        + _transplants_html(record)
        + "</section>"
    )


def _agreeing_html(records: list[ItemRecord]) -> str:
    rows = "".join(
        f'<tr class="item-entry agree" data-item="{html.escape(r.item_id)}" data-checkpoint="{html.escape(r.checkpoint)}">'
        f'<td class="nw">{html.escape(r.item_id)}</td><td>{html.escape(r.question)}</td><td>{len(r.live.tokens)}</td>'
        f"<td>{html.escape(label_text(r.live))}</td><td>{html.escape(label_text(r.prefill))}</td>"
        f"<td>{html.escape(cache_text(r))}</td><td>{html.escape(r.transplant_outcomes())}</td></tr>"
        for r in records
    )
    return (
        '<h3>Items whose suffixes agree</h3><table class="agree"><tr><th>item</th><th>question</th>'
        "<th>suffix tokens (all the same)</th><th>labels, live</th><th>labels, prefill</th><th>boundary caches</th>"
        f"<th>transplants (outcomes)</th></tr>{rows}</table>"
    )


def _items_html(records: list[ItemRecord], plots: dict[str, bytes]) -> str:
    divergent = [record for record in records if record.divergent]
    agreeing = [record for record in records if not record.divergent]
    parts = [_entry_html(record, plots[record.item_id]) for record in divergent]
    if agreeing:
        parts.append(_agreeing_html(agreeing))
    return '<div class="items">' + "".join(parts) + "</div>"


def _items_markdown(records: list[ItemRecord]) -> str:
    header = ["Item", "First divergence", "Labels, live", "Labels, prefill", "Boundary caches", "Transplants"]
    rows = [
        [
            r.item_id,
            divergence_text(r),
            label_text(r.live),
            label_text(r.prefill),
            cache_text(r),
            r.transplant_outcomes(),
        ]
        for r in records
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_markdown_cell(value) for value in row) + " |" for row in rows]
    return (
        "\n".join(lines)
        + "\n\n`stagereplay show LEDGER ITEM_ID` prints one item's suffixes with the divergence marked."
    )
