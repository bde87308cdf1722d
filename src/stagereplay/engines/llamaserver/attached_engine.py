"""E1–E6 with cache bytes on a llama-server someone else runs: a checkpoint with ``attach`` (url, slot, slot_dir).

The engine is the llamaserver engine on one slot of that server (``AttachedServerEngine``). What differs from a
server this project starts:

- **never started, restarted or stopped**: a setting the server takes only at its start (``-fa``, ``-ctk/-ctv``,
  ``-ub``, ``-t``, ``-np``) cannot be changed, so ``reconfigure`` refuses in one line; its level is another
  attached server, compared as a served cell (the config's ``served`` block). The parse-time check
  (``design.attach``) refuses such factors before any job.
- **what it runs with is read, not set**: its slot count and context per slot from ``/props``; its cache type,
  flash attention (llama.cpp stores V transposed without it) and KV streams from a slot file it saves of one
  token (``probe_settings``). A job whose precision or flash attention is not the server's is refused in one
  line naming the server flag. A quantized cache is refused: whether llama.cpp rotated it is said only in the
  server's log, which is not ours to read. Its micro-batch and thread counts are not reported: the record says so.
- **a guest**: one slot, held by one job at a time (a lock file in the slot folder, so two jobs of one run on
  the same slot wait for each other), slot files named for this process and removed once read, the slot
  erased after the job and no other slot touched; the server is checked at load and at close to be the one the
  model record says it was (``attached_record``, written when the checkpoint was registered).

Which server it is: the model record holds what the server said of itself when the checkpoint was registered
(``/props``, ``/v1/models``) and how its model was proven to be the checkpoint's GGUF (``model_check``: its bytes
where its file is readable here, else its metadata and its spelling of a sample of token ids). No torch here
until the engine loads.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
from pathlib import Path

from stagereplay.engines.base import Runtime
from stagereplay.engines.llamacpp.cache_types import cache_types
from stagereplay.engines.llamacpp.settings import check_runtime
from stagereplay.engines.llamaserver.attached import AttachedServer, ServerIdentity, api_key_from
from stagereplay.engines.llamaserver.build import LlamaServerError
from stagereplay.engines.llamaserver.engine import LlamaServerEngine
from stagereplay.engines.llamaserver.model_check import check_model
from stagereplay.engines.llamaserver.process import ServerSettings
from stagereplay.engines.llamaserver.slots import gguf_geometry, read_slot_file
from stagereplay.ledger.text import spelling

# How many token ids, spread over the vocabulary, the server must spell as the GGUF does where its model file is
# not readable here (the registration's tokenizer check; the served block checks every prompt token instead).
SPELLING_SAMPLE = 256


def attached_server(attach: dict, where: str) -> AttachedServer:
    """The server an ``attach`` entry names, on its one slot, its slot folder as this machine sees it."""
    slot_dir = Path(attach["slot_dir"])
    if not slot_dir.is_dir():
        raise LlamaServerError(
            f"{where}.slot_dir: {slot_dir} is not a folder here — start the server with --slot-save-path DIR and"
            " give DIR as this machine sees it (the boundary caches are read from its slot files); without slot"
            " files, list the server under served.servers (suffixes and margins only)"
        )
    slot = attach.get("slot", 0)
    return AttachedServer(
        attach["url"],
        api_key=api_key_from(attach.get("api_key_env"), f"{where}.api_key_env"),
        slots=(slot,),
        slot_dir=slot_dir,
    )


def attached_record(gguf_path: str | Path, attach: dict, where: str, recorded: dict | None = None) -> dict:
    """What the model record says of an attached checkpoint's server: the ``attach`` entry, what the server says of
    itself, and how its model was proven to be ``gguf_path`` (one line if it is not, or if it has no slot files).
    ``recorded``: the ledger's record of the checkpoint (the audit's registration), whose server this must be."""
    from stagereplay.engines.llamacpp.engine import gguf_tokenizer

    server = attached_server(attach, where)
    server.health()
    identity = server.identity()
    if recorded is not None:
        changes = identity.changes_from(ServerIdentity(**recorded["server"]))
        if changes:
            raise LlamaServerError(
                f"the llama-server at {server.url} is not the one the ledger records: {'; '.join(changes)} — audit"
                " against the server the ledger records (the same build, model and flags)"
            )
    server.check_slots(identity, f"{where}.slot")
    if not server.slot_files_on():
        raise LlamaServerError(
            f"the llama-server at {server.url} writes no slot files — start it with --slot-save-path"
            f" {attach['slot_dir']} (E1–E5 read the boundary cache from them), or list it under served.servers"
            " (suffixes and margins only)"
        )
    tokenizer, _ = gguf_tokenizer(str(gguf_path))
    vocabulary = len(tokenizer)
    sample = range(0, vocabulary, max(1, vocabulary // SPELLING_SAMPLE))
    spellings = {token: spelling(tokenizer, token) for token in sample}
    model = check_model(server, identity, gguf_path, spellings, list(sample))
    # attach_key: the config key the server was named under, for a job's one-line messages.
    return {"attach": dict(attach), "attach_key": where, "server": identity.record(), **model}


class AttachedServerEngine(LlamaServerEngine):
    """The llamaserver engine on slot ``attach.slot`` of a running server (see the module's text), holding the
    slot's lock (``slot_lock``) until ``close``."""

    @classmethod
    def load(cls, record: dict, runtime: Runtime) -> AttachedServerEngine:
        return load_attached(record, runtime)

    attached_record = staticmethod(attached_record)

    def __init__(self, gguf_path: str | Path, settings: ServerSettings, server: AttachedServer, lock):
        self.attached, self.lock = server, lock
        self.slot = server.slots[0]
        super().__init__(gguf_path, settings)

    def _new_server(self, settings: ServerSettings) -> tuple[Path, AttachedServer]:
        return self.attached.slot_dir, self.attached

    def _start(self) -> None:
        """Nothing starts: the server was checked to be the recorded one (``load_attached``)."""
        self.rotation = (0, 0)  # a quantized cache is refused by ``probe_settings``
        self.generation += 1

    def reconfigure(self, **changes) -> None:
        raise LlamaServerError(
            f"the llama-server at {self.attached.url} is attached: it takes {', '.join(sorted(changes))} only when"
            " it starts, and this run never restarts it — start a server with the level's setting and list it"
            " under served.servers"
        )

    def in_flight(self, prompts, cancelled: bool = False):
        raise LlamaServerError(
            f"the llama-server at {self.attached.url} is attached on one slot: concurrent load needs slots of its own"
            " — list the server under served.servers with its slots, where load runs as served requests"
        )

    def build_description(self) -> str:
        s, identity = self.settings, self.attached.recorded
        k_format, v_format = self.formats
        return (
            f"attached llama-server at {self.attached.url}, slot {self.slot} (never started or restarted by this run):"
            f" build {identity.build}, model {identity.model_path} ({identity.model_ftype}), {identity.total_slots}"
            f" slots of {identity.n_ctx_per_slot} cells in {'one unified cache' if s.kv_unified else 'a KV stream per slot'},"
            f" -fa {'on' if s.flash_attn else 'off'}, cache={s.cache_type} (these three read from its slot file);"
            f" micro-batch and threads not reported; K stored as {k_format or 'values'}, V as {v_format or 'values'};"
            " logits read as log-probabilities (n_probs: logits less a constant per position)"
        )

    def close(self) -> None:
        """Erase the slot this job used and check the server is still the recorded one; nothing else is touched."""
        try:
            if self.attached is not None:
                self.attached.erase_slot(self.slot)
                self.attached.check_unchanged(self.attached.recorded)
                self.attached = None
        finally:
            if self.lock is not None:
                self.lock.close()  # releases the slot's lock
                self.lock = None
            if self.binding is not None:
                self.binding.close()
                self.binding = None


def slot_lock(server: AttachedServer):
    """The slot's lock file in the server's slot folder, held (waiting for another job of this run that holds it):
    one job at a time on a slot, wherever the jobs run, as long as they see the same folder."""
    lock_path = server.slot_dir / f"stagereplay-slot-{server.slots[0]}.lock"
    try:
        lock = open(lock_path, "a")  # noqa: SIM115 — held until the engine closes
    except OSError as error:
        raise LlamaServerError(
            f"cannot write in the attached server's slot folder {server.slot_dir} ({error.strerror}) — give a"
            " slot_dir this machine may write"
        ) from None
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def probe_settings(server: AttachedServer, identity: ServerIdentity, gguf_path: str | Path, token: int) -> dict:
    """What the server's cache is, from a slot file it saves of one token on the run's slot (then erased): its cache
    type, whether flash attention is on (V not transposed) and whether its slots share one unified cache."""
    slot = server.slots[0]
    name = f"stagereplay-{os.getpid()}-settings.bin"
    server.erase_slot(slot)
    server.complete([token], 1, slot=slot, cache_prompt=True, n_probs=0)
    try:
        answer = server.save_slot(slot, name)
        if answer.get("n_saved") != 1:
            raise LlamaServerError(f"the llama-server at {server.url} saved {answer.get('n_saved')} tokens of one")
        _, parsed = read_slot_file(server.slot_dir / name, gguf_geometry(gguf_path), slot)
    finally:
        (server.slot_dir / name).unlink(missing_ok=True)
        server.erase_slot(slot)
    if cache_types(parsed.cache_type).quantized:
        raise LlamaServerError(
            f"the llama-server at {server.url} stores a {parsed.cache_type} cache, and whether llama.cpp rotated it is"
            " said only in the server's own log — attach a server with an f16, bf16 or f32 cache (-ctk/-ctv), or"
            " let the workflow start one (a llamaserver checkpoint without attach)"
        )
    return {
        "cache_type": parsed.cache_type,
        "flash_attn": not parsed.v_trans,
        "kv_unified": parsed.streams == 1 and identity.total_slots > 1,
        "parallel": identity.total_slots,
        "ctx_size": identity.n_ctx_per_slot,
    }


def load_attached(record: dict, runtime: Runtime) -> AttachedServerEngine:
    """The engine on the attached server the record names, its slot held; one line if the server is not the one
    recorded, or if the job asks for a cache type or flash attention the server does not run with."""
    from stagereplay.engines.llamacpp.engine import gguf_tokenizer

    check_runtime(runtime, "llamaserver", "the llama-server engine")
    server = attached_server(record["attach"], record.get("attach_key", "the attached checkpoint"))
    lock = slot_lock(server)
    try:
        server.health()
        server.recorded = ServerIdentity(**record["server"])
        server.check_unchanged(server.recorded)
        tokenizer, _ = gguf_tokenizer(record["gguf"])
        plain = tokenizer.encode("a", add_special_tokens=False)[0]
        found = probe_settings(server, server.recorded, record["gguf"], plain)
        if found["cache_type"] != runtime.precision:
            raise LlamaServerError(
                f"the llama-server at {server.url} stores a {found['cache_type']} cache (read from its slot file), this"
                f" job asks for {runtime.precision} — set the run's precisions to {found['cache_type']}, or attach a"
                " server started with -ctk/-ctv as asked"
            )
        if found["flash_attn"] != runtime.flash_attn:
            on_off = {True: "on", False: "off"}
            raise LlamaServerError(
                f"the llama-server at {server.url} runs with flash attention {on_off[found['flash_attn']]} (read from"
                f" its slot file), this job asks for it {on_off[runtime.flash_attn]} — set runtime.flash_attn:"
                f" {str(found['flash_attn']).lower()}, or attach a server started with -fa {on_off[runtime.flash_attn]}"
            )
        settings = ServerSettings(
            threads=runtime.threads,
            flash_attn=found["flash_attn"],
            cache_type=found["cache_type"],
            ctx_size=found["ctx_size"],
            parallel=found["parallel"],
            kv_unified=found["kv_unified"],
        )
        engine = AttachedServerEngine(record["gguf"], settings, server, lock)
    except BaseException:
        lock.close()
        raise
    engine.environment = attached_environment(engine, runtime)
    return engine


def attached_environment(engine: AttachedServerEngine, runtime: Runtime):
    """The environment record of a job on an attached server: its build as it reports it, where it runs unknown."""
    from stagereplay.engines.llamacpp.engine import ggml_environment

    server = engine.attached
    environment = ggml_environment(
        "llamaserver",
        runtime.precision,
        engine.settings.threads,
        engine.settings.flash_attn,
        "not reported (attached server)",
        f"llama-server {server.recorded.build} (attached at {server.url})",
        engine.build_description(),
    )
    return dataclasses.replace(environment, device_name=f"llama-server at {server.url}")
