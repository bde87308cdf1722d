"""The HTML card in a real browser: headless Chromium (Debian's `chromium`) renders results.html of a real run and
the rendered DOM is checked against the ledger: every item's entry is there, each divergent item marks its first
divergent token (on both sides, at that step), every image decoded, and nothing needs sideways scrolling.

Skipped only when no chromium is installed and STAGEREPLAY_REQUIRE_BROWSER is unset (.ci/run sets it).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stagereplay.report.plots import PLOT_FILES

pytestmark = pytest.mark.slow

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
if BROWSER is None and not os.environ.get("STAGEREPLAY_REQUIRE_BROWSER"):
    pytest.skip("chromium is not installed (apt-get install -y chromium)", allow_module_level=True)

WIDTH = 1000  # CSS pixels: narrower than the card's 70em, so wrapping is exercised

# Run after the page's load event (which waits for every image): what the browser made of the page, written
# into the DOM that --dump-dom prints.
PROBE = """<script>
window.addEventListener("load", () => {
  const root = document.documentElement;
  const report = {
    scrollWidth: root.scrollWidth,
    clientWidth: root.clientWidth,
    images: [...document.images].map(img => ({alt: img.alt, complete: img.complete, width: img.naturalWidth})),
    firstTable: (document.querySelector("table") || {}).id || null,
    panel: [...document.querySelectorAll("table.answer tr")].slice(1).map(tr => [...tr.cells].map(cell => cell.textContent)),
    panelTop: (document.querySelector("table.answer") || {getBoundingClientRect: () => ({top: -1})}).getBoundingClientRect().top,
    readingTop: ([...document.querySelectorAll("h2")].find(h => h.textContent.startsWith("Reading")) || {getBoundingClientRect: () => ({top: -1})}).getBoundingClientRect().top,
    entries: [...document.querySelectorAll(".item-entry")].map(entry => ({
      item: entry.dataset.item,
      divergent: entry.classList.contains("divergent"),
      height: entry.getBoundingClientRect().height,
      marks: [...entry.querySelectorAll("mark.diverge")].map(mark => mark.closest(".cell").dataset.pos),
    })),
  };
  const out = document.createElement("script");
  out.type = "application/json";
  out.id = "browser-report";
  out.textContent = JSON.stringify(report);
  document.body.appendChild(out);
});
</script>"""


def rendered(card: Path, scratch: Path) -> dict:
    """Open a copy of ``card`` (the probe added before </body>) in headless Chromium; the probe's report."""
    page = scratch / "page.html"
    text = card.read_text()
    assert text.count("</body>") == 1
    page.write_text(text.replace("</body>", PROBE + "</body>"))
    result = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            f"--user-data-dir={scratch / 'profile'}",
            f"--window-size={WIDTH},2000",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r'<script type="application/json" id="browser-report">(.*?)</script>', result.stdout, re.S)
    assert found, f"the probe did not run; the browser said: {result.stderr[-1000:]}"
    return json.loads(html.unescape(found.group(1)) if "&quot;" in found.group(1) else found.group(1))


def expected(ledger: Path) -> dict[str, int | None]:
    """Each item's first divergent suffix position, live vs prefill (None: the suffixes agree)."""
    rows = pq.read_table(ledger / "tables" / "comparisons.parquet").to_pylist()
    return {
        r["item_id"]: r["first_divergence"] for r in rows if r["experiment"] == "E1" and r["relation"] == "construction"
    }


def panel_expected(ledger: Path) -> dict[str, str]:
    """The answer panel's "this run" figure per experiment, from summary.json (x/N of the primary checkpoint)."""
    summary = json.loads((ledger / "summary.json").read_text())
    primary = summary["checkpoints"][0]
    e1 = summary["E1"]["checkpoints"][primary]["suffixes_differ"]
    e2 = summary["E2"]["checkpoints"][primary]["precisions"]["fp32"]["incremental_vs_prefill"]["decoded_disagreements"]
    e3 = summary["E3"]["checkpoints"][primary]["precisions"]
    e5 = summary["E5"]["all_layers"]
    wanted = {
        "E1 matched": f"{e1['count']}/{e1['n']}",
        "E2 fixed prefix": f"{e2['count']}/{e2['n']}",
        "E3 bridge": "; ".join(f"{p}: {arm['bit_exact']['count']}/{arm['bit_exact']['n']}" for p, arm in e3.items()),
        "E4 audit": "not run yet",
    }
    # E5 over items, one row per selection; the outcome-blind sample is its own row (beside the paper's
    # later-checkpoint replication only when it ran on another checkpoint).
    for key, fig in e5.items():
        items = fig["items_follow_donor_both_ways"]
        row = "E5 transplant" if key.startswith("selected/") else "E5 outcome-blind"
        wanted[row] = f"{items['count']}/{items['n']}"
    return wanted


def panel_problems(report: dict, wanted: dict[str, str]) -> list[str]:
    """The answer panel is the card's first table, above the reading, one row per experiment, and each row's
    figure is summary.json's (the count/N text; E3 and E5 list theirs per arm)."""
    found = []
    if report["firstTable"] != "answer":
        found.append(f"the first table is {report['firstTable']!r}, not the answer panel")
    if not 0 <= report["panelTop"] < report["readingTop"]:
        found.append("the answer panel is not above the reading")
    shown = {row[0]: row[2] for row in report["panel"]}
    if list(shown) != list(wanted):
        found.append(f"panel rows {list(shown)}, expected {list(wanted)}")
    for experiment, figure in wanted.items():
        cell = shown.get(experiment, "")
        parts = figure.split("; ")
        if not all(part in cell for part in parts):
            found.append(f"panel {experiment}: {cell!r} does not show {figure!r}")
    return found


def problems(report: dict, divergence: dict[str, int | None]) -> list[str]:
    found = []
    entries = {entry["item"]: entry for entry in report["entries"]}
    for item, at in sorted(divergence.items()):
        entry = entries.get(item)
        if entry is None:
            found.append(f"{item}: no entry")
            continue
        if entry["height"] <= 0:
            found.append(f"{item}: entry not rendered")
        if at is None and entry["marks"]:
            found.append(f"{item}: suffixes agree, yet a token is marked")
        if at is not None and (not entry["divergent"] or entry["marks"] != [str(at), str(at)]):
            found.append(f"{item}: divergent at {at}, marks at {entry['marks']}")
    found += [f"image {image['alt']!r} did not load" for image in report["images"] if image["width"] <= 0]
    if report["scrollWidth"] > report["clientWidth"]:
        found.append(f"scrolls sideways: {report['scrollWidth']} > {report['clientWidth']} px")
    return found


def test_the_card_renders_every_item_every_mark_and_every_image(test_run, tmp_path):
    _, ledger, _ = test_run
    divergence = expected(ledger)
    assert any(at is not None for at in divergence.values()), "config/test.yaml is meant to diverge on some items"
    report = rendered(ledger / "report" / "results.html", tmp_path)
    assert problems(report, divergence) == []
    assert panel_problems(report, panel_expected(ledger)) == []
    # The card's plots (each written whether or not its experiment ran) and one per-layer plot per
    # divergent item, each decoded by the browser.
    divergent = sum(at is not None for at in divergence.values())
    assert len(report["images"]) == len(PLOT_FILES) + divergent
    assert all(image["complete"] for image in report["images"])


def test_the_check_fails_on_a_missing_entry_mark_or_image(test_run, tmp_path):
    """The same check on a damaged copy of the card: a divergent item's marks removed, an agreeing item's entry
    removed, an image broken, each is named."""
    _, ledger, _ = test_run
    divergence = expected(ledger)
    divergent = sorted(item for item, at in divergence.items() if at is not None)[0]
    agreeing = sorted(item for item, at in divergence.items() if at is None)
    text = (ledger / "report" / "results.html").read_text()
    start = text.index(f'data-item="{divergent}"')
    end = text.index("</section>", start)
    section = text[start:end].replace('<mark class="diverge tok">', '<span class="tok">').replace("</mark>", "</span>")
    text = text[:start] + section + text[end:]
    text = re.sub(r'src="data:image/png;base64,[^"]{8}', 'src="data:image/png;base64,AAAAAAAA', text, count=1)
    if agreeing:
        text = re.sub(rf'<tr class="item-entry agree" data-item="{re.escape(agreeing[0])}".*?</tr>', "", text)
    damaged = tmp_path / "results.html"
    damaged.write_text(text)
    found = problems(rendered(damaged, tmp_path), divergence)
    assert f"{divergent}: divergent at {divergence[divergent]}, marks at []" in found
    assert any(line.startswith("image ") and line.endswith("did not load") for line in found)
    if agreeing:
        assert f"{agreeing[0]}: no entry" in found


def test_the_panel_check_fails_on_a_wrong_number_or_a_missing_panel(test_run, tmp_path):
    _, ledger, _ = test_run
    wanted = panel_expected(ledger)
    text = (ledger / "report" / "results.html").read_text()
    e1 = wanted["E1 matched"]
    count, n = e1.split("/")
    wrong = tmp_path / "wrong.html"
    wrong.write_text(text.replace(f">{e1} (", f">{int(count) + 1}/{n} (", 1))
    assert "panel E1 matched: " in "\n".join(panel_problems(rendered(wrong, tmp_path), wanted))
    start = text.index('<table class="answer"')
    missing = tmp_path / "missing.html"
    missing.write_text(text[:start] + text[text.index("</table>", start) + len("</table>") :])
    found = panel_problems(rendered(missing, tmp_path), wanted)
    assert any(line.startswith("the first table is") for line in found), found
