"""Checkpoints attached to a server someone else runs (``checkpoints.NAME.attach``), checked before any job.

Such a server is never started, restarted or stopped, so a run on it can ask only for what it already does:

- the engine must be one that attaches (``EngineSpec.attached_class_path``: llamaserver);
- it holds one cache type, so the checkpoint runs at one precision (E1's, E2's and E5's cast alike);
- an E6 factor the engine runs by a restart or by slots of its own (a ``Knob``'s mechanism ``restart`` or
  ``load``) is refused, naming the server option: its level is another attached server, compared as a served cell.

Whether its slot folder is one here (a dry run of a shipped config needs no server), and whether the server at
the URL answers, writes slot files and runs the checkpoint's model, is the first job's to check (``register_model``),
in one line before anything is written. No torch.
"""

from __future__ import annotations

from stagereplay.engines.spec import EngineSpec

# Mechanisms a server nobody restarts cannot run: a restart with another option, or slots of its own.
FIXED_BY_ITS_START = ("restart", "load")


class AttachRefused(ValueError):
    """One line: what an attached checkpoint cannot run, and the fix."""


def attached_checkpoints(config: dict) -> list[str]:
    return [name for name, entry in config["checkpoints"].items() if "attach" in entry]


def check_attached(config: dict, engines: dict[str, EngineSpec]) -> None:
    """Every attached checkpoint against the run."""
    primary = next(iter(config["checkpoints"]))
    for name in attached_checkpoints(config):
        spec = engines[name]
        if not spec.attached_class_path:
            raise AttachRefused(
                f"checkpoints.{name}.attach: the {spec.name} engine attaches to no server — set engine:"
                " llamaserver, or remove attach"
            )
        if name == primary:
            check_primary(config, name, spec)


def check_primary(config: dict, name: str, spec: EngineSpec) -> None:
    """One precision, and no E6 factor that needs the server restarted or slots of its own."""
    transplant = config["transplant"]
    cross = transplant["cross_precision"] if transplant["enabled"] else None
    precisions = {config["matched"]["precision"], *config["fixed_prefix"]["precisions"], *([cross] if cross else [])}
    if len(precisions) > 1:
        raise AttachRefused(
            f"checkpoints.{name} is attached: its server holds one cache type, and this run asks for"
            f" {', '.join(sorted(precisions))} — give the server's only (matched.precision,"
            " fixed_prefix.precisions, transplant.cross_precision: null)"
        )
    for factor in config["factors"]:
        knob = spec.factors.get(factor)
        if knob is None or knob.mechanism not in FIXED_BY_ITS_START:
            continue
        attached = f"factors.{factor}: checkpoints.{name} is attached to a server this run never restarts, which"
        if knob.mechanism == "restart":
            raise AttachRefused(
                f"{attached} takes it only when it starts ({knob.setting}) — start a second server with the level's"
                f" {knob.setting}, list both under served.servers (compared item by item), or remove the factor"
            )
        raise AttachRefused(
            f"{attached} would need slots of its own beside the run's one — list the server under served.servers with"
            " the slots it may use (other clients' load runs there as served requests), or remove the factor"
        )
