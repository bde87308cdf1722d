"""E6's A/A controls in the report.

Each factor's control level (``design.factors.Factor.control``) runs the reference setting through the
factor's test machinery, so it must reproduce the reference on every item: the reference's cache bytes,
its suffix in every cell, verdict none. If it does not, the harness itself changes what it measures, and
any E6 difference could be that artefact rather than a finding. summary.json's ``E6.controls`` says, per
control, whether it did (``summary.e6_controls``); ``check_controls`` stops ``summarize`` and ``report`` on
a control that failed, in one line (``ControlFailed``); ``controls_card_row`` is the card's one line, and
``controls_blocks`` its table of the controls: per control, what it exercises and what it does not (so cannot
fail on), as the spec of the engine that ran it declares (``engines.spec.EngineSpec.control_scopes``).
"""

from __future__ import annotations


class ControlFailed(ValueError):
    """One line: the control paths that did not reproduce the reference, and that the harness is broken."""


def _what_differs(control: dict) -> str:
    def on(items: list[str]) -> str:
        return f"on {len(items)} of {control['items']} items ({', '.join(items)})"

    parts = [
        f"{what} {on(control[key])}"
        for key, what in (
            ("caches_differ", "other cache bytes"),
            ("suffixes_differ", "another suffix"),
            ("verdict_not_none", "a verdict other than none"),
        )
        if control[key]
    ]
    if control["not_run"]:
        parts.append(f"no run {on(control['not_run'])}: {control['reason'] or 'no reason recorded'}")
    return "; ".join(parts) or "no item"


def check_controls(controls: dict | None) -> None:
    """Stop, in one line naming each failed path (factor and control level), when a control did not reproduce
    the reference on every item. ``controls``: summary.json's E6.controls (None: no E6, nothing to check)."""
    failed = [control for control in (controls or {}).get("levels", []) if not control["identical"]]
    if not failed:
        return
    paths = "; ".join(
        f"{control['factor']} {control['level']} (the reference setting through the {control['factor']} test"
        f" path) gave {_what_differs(control)}"
        for control in failed
    )
    factors = ", ".join(dict.fromkeys(control["factor"] for control in failed))
    raise ControlFailed(
        f"E6 control failed: {paths} — the E6 harness is broken, so no E6 difference of {factors} is a finding;"
        f" fix how {factors} runs its levels (experiments/factor_settings.py) and rerun its factor jobs"
    )


def controls_card_row(e6: dict | None) -> list[str] | None:
    """The card's one line for the controls (None: no E6 controls in the summary)."""
    controls = (e6 or {}).get("controls")
    if controls is None:
        return None
    figure = f"{controls['identical']}/{controls['paths']} paths identical on every item"
    if controls["without_control"]:
        figure += f"; no control run for {', '.join(controls['without_control'])}"
    return [
        "E6 controls",
        "A/A: each factor's reference setting through its own test machinery reproduces the reference (what"
        " each exercises and does not: the table of controls under E6)",
        figure,
        "beyond the paper",
    ]


CONTROL_COLUMNS = [
    "Factor",
    "Control level",
    "Engine",
    "Items identical",
    "What it exercises",
    "What it does not exercise",
]
# A summary.json written before the controls named what they exercise (verify_documents names its migration).
NOT_RECORDED = "not recorded in this summary.json"


def _identical_items(control: dict) -> str:
    differ = set().union(*(control[key] for key in ("caches_differ", "suffixes_differ", "verdict_not_none", "not_run")))
    return f"{control['items'] - len(differ)}/{control['items']}"


def controls_rows(e6: dict | None) -> list[list[str]]:
    """One row per control: its factor, level, engine, the items it reproduced, what it exercises and what not."""
    return [
        [
            control["factor"],
            control["level"],
            control.get("engine") or NOT_RECORDED,
            _identical_items(control),
            control.get("exercises") or NOT_RECORDED,
            control.get("does_not") or NOT_RECORDED,
        ]
        for control in ((e6 or {}).get("controls") or {}).get("levels", [])
    ]


def controls_blocks(e6: dict | None) -> list[tuple]:
    """The card's table of the controls (nothing where no control ran)."""
    rows = controls_rows(e6)
    if not rows:
        return []
    return [
        ("heading", 3, "E6: what each control exercises, and what it does not"),
        (
            "paragraph",
            "Each control runs the reference setting through its factor's test machinery and must reproduce the"
            " reference on every item, so it can fail only on what it exercises: a difference a level shows in"
            " what its control does not exercise is not covered by that control.",
        ),
        ("table", CONTROL_COLUMNS, rows),
    ]
