"""What an attached llama-server allows, said before anything runs (``stagereplay probe URL``).

A server this project did not start allows what its own flags allow, and nothing can change them:

- **slot files** (``--slot-save-path``) give the boundary cache's bytes: with them E1–E5 and E6's cells that read
  cache bytes can run, as on a server the project starts; without them only what requests return (suffixes and
  the top log-probabilities, so margins) is there: E1 and E2 on suffixes, E6's request-level levels as served
  cells;
- a **per-process option** (cache type, flash attention, micro-batch, threads, ``--no-kv-unified``) is fixed by
  whoever started the server: its level is another attached server started with the other value, compared item
  by item as reference and level;
- the **slots a run may use** bound what needs several at once: concurrent load with B requests needs B of them,
  an offset behind another slot's cells needs two.

The slot file format is checked at the first save, against the one this project parses (``llamaserver.slots``:
a mismatch is refused with both versions named); the probe says whether the build is the one the project builds.
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stagereplay.engines.llamaserver.attached import AttachedServer, ServerIdentity
from stagereplay.engines.llamaserver.spec import DECLARED

SLOT_FILES_FLAG = "--slot-save-path"


@dataclass(frozen=True)
class Allowance:
    """One experiment or E6 level on the attached server: whether it can run, and why (or why not)."""

    what: str
    runs: bool
    why: str


@dataclass
class Probe:
    """What a server said of itself, and what that allows."""

    url: str
    identity: ServerIdentity
    slot_files: bool
    slots: tuple[int, ...]  # the slots the run may use
    busy_slots: list[int]  # slots processing a request when the probe looked
    model_file_here: bool  # the server's model path is a file on this machine (its bytes can be hashed)
    project_commit: str | None  # the llama.cpp commit of the server this project builds (None: not built here)

    @property
    def allowances(self) -> list[Allowance]:
        return allowances(self.slot_files, self.slots)

    def render(self) -> str:
        identity = self.identity
        if self.project_commit is None:
            build_note = "this project's server is not built here, so slot files are checked at the first save"
        elif identity.commit == self.project_commit:
            build_note = "the llama.cpp commit this project builds: its slot files are the format parsed here"
        else:
            build_note = (
                f"not the commit this project builds ({self.project_commit}): slot files are checked at the first save"
            )
        model = (
            f"{identity.model_path} ({identity.model_ftype}, {identity.n_params} parameters, {identity.n_vocab} tokens)"
        )
        lines = [
            f"llama-server at {self.url}",
            f"  build: {identity.build or 'not reported'} — {build_note}",
            f"  model: {model}",
            "  model file: "
            + (
                "readable here: its bytes are hashed (xxh3-128) and must be the checkpoint's GGUF"
                if self.model_file_here
                else "not readable here: the weights cannot be hashed; the ledger records the server's model metadata"
            ),
            f"  slots: {identity.total_slots}, context {identity.n_ctx_per_slot} each; this run may use"
            f" {list(self.slots)}" + (f"; processing now: {self.busy_slots}" if self.busy_slots else ""),
            "  slot files: "
            + (
                "on: the boundary cache's bytes can be read"
                if self.slot_files
                else f"off: started without {SLOT_FILES_FLAG}"
            ),
            "  not reported by the server: its cache type, flash attention and KV streams (an attached checkpoint's"
            " job reads them from a slot file it saves of one token), its micro-batch and threads (never known)",
            "",
            "  How to run it: as served cells (served.servers.NAME: {url, slots}), whole requests, E1 on suffixes among"
            " them (a replay from the stage boundary); with slot files, as an attached checkpoint"
            " (checkpoints.NAME.attach: {url, slot, slot_dir}), E1-E5 and E6's prefix_reuse with the boundary"
            " cache's bytes, on one slot, one job at a time.",
            f"  {'what':<34} {'allows':<6} why",
        ]
        for allowance in self.allowances:
            lines.append(f"  {allowance.what:<34} {'yes' if allowance.runs else 'no':<6} {allowance.why}")
        return "\n".join(lines)


def probe(server: AttachedServer) -> Probe:
    """Ask ``server`` what it is and what it allows: status requests and one slot action it has none of."""
    from stagereplay.engines.llamaserver.build import LlamaServerError, server_build

    server.health()
    identity = server.identity()
    server.check_slots(identity, "--slots")
    busy = [state["id"] for state in server.slot_states() if state.get("is_processing")]
    try:
        project_commit = server_build().llama_cpp_commit
    except LlamaServerError:
        project_commit = None
    return Probe(
        url=server.url,
        identity=identity,
        slot_files=server.slot_files_on(),
        slots=server.slots,
        busy_slots=busy,
        model_file_here=Path(identity.model_path).is_file(),
        project_commit=project_commit,
    )


def allowances(slot_files: bool, slots: tuple[int, ...]) -> list[Allowance]:
    """Each experiment, then each E6 factor of the server's spec, on a server with or without slot files."""
    need_files = f"needs the boundary cache's bytes: start the server with {SLOT_FILES_FLAG}"
    with_files = "slot files give the boundary cache's bytes"
    rows = [
        Allowance("served: alone, control, hit", True, "whole greedy requests on the run's slots"),
        Allowance(
            "served: amid other clients",
            len(slots) >= 2,
            "the other clients on the run's other slots" if len(slots) >= 2 else "needs 2 or more slots: list them",
        ),
        Allowance("E1 matched: suffixes", True, "the served replay: the boundary's prefix prefilled as a new prompt"),
        Allowance("E1 matched: boundary caches", slot_files, with_files if slot_files else need_files),
        Allowance("E2 fixed prefix: suffixes", True, "the server's own cache type only (set when it started)"),
        Allowance("E3 bridge", slot_files, with_files if slot_files else need_files),
        Allowance("E4 audit", True, "the server must still report the build and model the ledger records"),
        Allowance("E5 transplant", slot_files, "slot save and restore" if slot_files else need_files),
    ]
    for factor, (mechanism, option) in DECLARED["factors"].items():
        rows.append(_factor_allowance(factor, mechanism, option, slot_files, slots))
    return rows


def _factor_allowance(factor: str, mechanism: str, option: str, slot_files: bool, slots: tuple[int, ...]) -> Allowance:
    what = f"E6 {factor}"
    if mechanism == "restart" or factor == "kv_unified":
        flag = "--no-kv-unified" if factor == "kv_unified" else option.split(":")[0].strip()
        return Allowance(
            what,
            False,
            f"{flag} is set when the server starts: list a second server started with the other value",
        )
    if factor == "prefix_reuse":
        if slot_files:
            return Allowance(what, True, "the slot's prompt cache; slot save and restore")
        return Allowance(
            what + " (prompt, block)", True, f"the slot's prompt cache; restore levels need {SLOT_FILES_FLAG}"
        )
    if factor == "batch":
        if len(slots) < 2:
            return Allowance(what, False, "concurrent load needs the run to use 2 or more slots: list them under slots")
        return Allowance(
            what,
            True,
            f"as served requests amid up to {len(slots) - 1} other clients on the run's own slots (served"
            " cells: suffixes and margins; an attached checkpoint uses one slot)",
        )
    if factor == "kv_offset":
        if len(slots) < 2:
            return Allowance(what, False, "another slot holds the filler: list 2 or more slots under slots")
        return Allowance(
            what,
            True,
            "as served requests (served.kv_offsets: the filler on the run's second slot, idle); a server caching"
            " idle slots (its host prompt cache, the default) clears the filler when the item's task starts",
        )
    return Allowance(what, False, f"not known to the probe ({mechanism}: {option})")
