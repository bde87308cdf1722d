"""llama-server as people start it: ``llama-server -m MODEL`` with the server's own defaults and the flags given.

Where this project's engine gives every setting the numbers depend on (``process.ServerSettings``), a deployed
server is started with the model, an address and an operator's flags only: slots auto, one unified KV cache,
flash attention auto, the host prompt cache on with idle-slot caching, the default context. One flag is added
everywhere, and every record names it: ``--no-repack`` (``BASE_FLAGS``), because the server's default extra CPU
buffer types (weight repacking, AMX) crashed it at start on the embedded Q4_1 GGUF on an AMX CPU (SIGSEGV after
"llama threadpool init"), as they crash the binding.

What the server resolved is recorded from the server itself: ``/props`` (slots, context per slot, build) and its
startup log (slots, context per slot, the unified cache, threads: what it logs at its default verbosity).
"""

from __future__ import annotations

import re
from pathlib import Path

from stagereplay.engines.llamaserver.process import HOST, ServerProcess, ServerSettings

BASE_FLAGS = ("--no-repack",)
# Options this project sets itself (the address) and one an operator's flags may not take over.
RESERVED_FLAGS = ("--host", "--port", "-m", "--model", "--slot-save-path")

# What the server resolved, from its startup log at its default verbosity: "load_model: initializing, n_slots = 4,
# n_ctx_slot = 8192, kv_unified = 'true'" and "llama threadpool init, n_threads = 2". Flash attention, the cache's
# types and the host prompt cache are not logged there (llama.cpp's own lines need a higher verbosity).
_RESOLVED = {
    "n_slots": re.compile(r"n_slots = (\d+)"),
    "n_ctx_slot": re.compile(r"n_ctx_slot = (\d+)"),
    "kv_unified": re.compile(r"kv_unified = '(\w+)'"),
    "n_threads": re.compile(r"threadpool init, n_threads = (\d+)"),
}


class DeployedServer(ServerProcess):
    """A llama-server started with the model, a loopback address and ``flags`` only (and ``BASE_FLAGS``).

    ``log_batches``: its log also holds every decode call's tokens and where the KV cache put them (``--verbose``,
    ``process.BATCH_LOG_ENVIRONMENT``; logging only, recorded apart from the flags): the proof of whether a traffic
    pattern's trigger happened."""

    def __init__(
        self, model: str | Path, flags: tuple[str, ...] | list[str] = (), log_batches: bool = False, **options
    ):
        options.setdefault("start_timeout", 300.0)
        super().__init__(model, ServerSettings(log_batches=log_batches), **options)
        self.flags = (*BASE_FLAGS, *flags)

    def command(self, port: int) -> list[str]:
        # A slot folder (``slot_dir``) turns the slot actions on: a run that erases slots needs them; they change
        # no answer (the attached runs with and without them agree request for request,
        # docs/runs/2026-12-06-attach-8.md).
        slot_files = ["--slot-save-path", str(self.slot_dir)] if self.slot_dir is not None else []
        return [
            str(self.binary),
            "--model",
            str(self.model),
            "--host",
            HOST,
            "--port",
            str(port),
            *self.flags,
            *slot_files,
            *(("--verbose",) if self.settings.log_batches else ()),
        ]

    def usable_slots(self) -> range:
        return range(int(self.props().get("total_slots", 1)))

    def resolved(self) -> dict[str, str]:
        """What the startup log says the server resolved: each setting's first logged value, where it logs one."""
        log = self.log_text()
        found = {}
        for name, pattern in _RESOLVED.items():
            match = pattern.search(log)
            if match:
                found[name] = match.group(1)
        return found
