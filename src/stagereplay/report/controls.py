"""E6's A/A controls in the report.

Each factor's control level (``design.factors.Factor.control``) runs the reference setting through the
factor's test machinery, so it must reproduce the reference on every item: the reference's cache bytes,
its suffix in every cell, verdict none. If it does not, the harness itself changes what it measures, and
any E6 difference could be that artefact rather than a finding. summary.json's ``E6.controls`` says, per
control, whether it did (``summary.e6_controls``); ``check_controls`` stops ``summarize`` and ``report`` on
a control that failed, in one line (``ControlFailed``); ``controls_card_row`` is the card's one line.
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
        "A/A: each factor's reference setting through its own test machinery reproduces the reference",
        figure,
        "beyond the paper",
    ]
