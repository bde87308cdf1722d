"""llama.cpp's own HTTP server (``llama-server``) as a child process that never outlives its job.

``ServerProcess`` starts the server (the binary ``llamaserver.build`` checks) for one GGUF on 127.0.0.1 and
a free port, waits for ``/health``, and stops it on leaving its ``with`` block, on an error too. The child
cannot be orphaned: a SIGTERM or SIGHUP to this process stops every live server before this process exits,
an exit stops them (atexit), and on Linux the kernel kills the server when the thread that started it dies
(PR_SET_PDEATHSIG), so a SIGKILL of this process takes the server with it. Every failure is one line
(``LlamaServerError``, a ``ModelError``): a server that does not start (its log's first error and last
line), a port in use, a request that errors or times out (the endpoint and the server's message), a server
that died (its exit status). Its requests are ``ServerClient``'s (``llamaserver.client``), shared with a server
someone else runs. The server's environment has every ``LLAMA_ARG_*`` variable removed: each would fill an option
left off the command line, so only ``ServerSettings`` decides how the server runs.

No torch here.
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from stagereplay.engines.llamacpp.cache_types import CACHE_TYPES, CacheTypeError, cache_types
from stagereplay.engines.llamaserver.build import LlamaServerError, server_binary
from stagereplay.engines.llamaserver.client import ServerClient

HOST = "127.0.0.1"


# The settings a server starts with.


@dataclass(frozen=True)
class ServerSettings:
    """What the server is started with: each field is one of its command-line options."""

    threads: int = 1
    threads_batch: int | None = None  # None: the same as threads
    flash_attn: bool = False
    cache_type: str = "fp16"  # a llama.cpp precision as stagereplay names it: "q8_0", or K's and V's ("q8_0-fp16")
    ctx_size: int = 2048  # the whole context; without a unified cache each slot gets an equal share
    batch: int = 2048
    ubatch: int = 512
    parallel: int = 1  # slots (-np)
    kv_unified: bool = False  # one KV buffer shared by all slots
    # No extra CPU buffer types (weight repacking, AMX), as in the binding's engine: with them a multi-token
    # decode of the Q4_1 GGUF crashed on an AMX CPU, and they make the kernels depend on the CPU model.
    repack: bool = False
    # The host-memory prompt cache off (0 MiB): with it the server moves an idle slot's cache out to memory
    # and back, and with a unified cache clears the idle slot when another slot gets a task; a slot must
    # hold exactly what its requests and restores put there.
    cache_ram_mib: int = 0
    # Every micro-batch logged with its tokens' positions and sequences, and where the KV cache placed it (--verbose,
    # LLAMA_BATCH_DEBUG=1 and LLAMA_KV_CACHE_DEBUG=1, read by ``llamaserver.batches``): how a prompt under load was
    # cut into decode calls, and from which cell. Logging only.
    log_batches: bool = False
    extra: tuple[str, ...] = field(default=())  # further options, passed as given

    def arguments(self) -> list[str]:
        try:
            types = cache_types(self.cache_type)
        except CacheTypeError as error:
            raise LlamaServerError(str(error)) from None
        return [
            *("--threads", str(self.threads)),
            *("--threads-batch", str(self.threads_batch or self.threads)),
            *("--flash-attn", "on" if self.flash_attn else "off"),
            *("--cache-type-k", CACHE_TYPES[types.k][1]),
            *("--cache-type-v", CACHE_TYPES[types.v][1]),
            *("--ctx-size", str(self.ctx_size)),
            *("--batch-size", str(self.batch)),
            *("--ubatch-size", str(self.ubatch)),
            *("--parallel", str(self.parallel)),
            "--kv-unified" if self.kv_unified else "--no-kv-unified",
            "--repack" if self.repack else "--no-repack",
            *("--cache-ram", str(self.cache_ram_mib)),
            *(("--verbose",) if self.log_batches else ()),
            *self.extra,
        ]


# Stopping every server this process started, however it ends.

_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.RLock()  # re-entered when a signal handler stops the servers mid-start or mid-stop
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_PREVIOUS_HANDLERS: dict[int, object] = {}
_AT_EXIT = False
_SIGNALS_SET = False


def _stop_all() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        server.stop()


def _on_signal(signum, frame) -> None:
    """Stop the servers first, then end as the signal would have (or as the handler it replaced does)."""
    _stop_all()
    previous = _PREVIOUS_HANDLERS.get(signum)
    if callable(previous):
        previous(signum, frame)
        return
    raise SystemExit(128 + signum)


def _install_guards() -> None:
    """Once: the atexit hook, and the signal handlers if this is the main thread (only there can they be set;
    elsewhere the death signal is the guard)."""
    global _AT_EXIT, _SIGNALS_SET
    if not _AT_EXIT:
        atexit.register(_stop_all)
        _AT_EXIT = True
    if _SIGNALS_SET or threading.current_thread() is not threading.main_thread():
        return
    for signum in _HANDLED_SIGNALS:
        previous = signal.getsignal(signum)
        if previous == signal.SIG_IGN:
            continue  # an ignored signal (nohup's SIGHUP) stays ignored: it ends nothing, so it stops nothing
        _PREVIOUS_HANDLERS[signum] = previous
        signal.signal(signum, _on_signal)
    _SIGNALS_SET = True


def _death_signal_setter():
    """A function for the child, between fork and exec: the kernel sends it SIGKILL when the thread that
    forked it dies, and it exits at once if that already happened. Resolved here, before the fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    set_death_signal = 1  # PR_SET_PDEATHSIG in <linux/prctl.h>

    def child() -> None:
        prctl(set_death_signal, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return child


# The process.


# What the batch log (ServerSettings.log_batches) sets in the server's environment, beside --verbose.
BATCH_LOG_ENVIRONMENT = {"LLAMA_BATCH_DEBUG": "1", "LLAMA_KV_CACHE_DEBUG": "1"}


def server_environment() -> dict[str, str]:
    """This process's environment less what changes the server's numerics unasked: every ``LLAMA_ARG_*`` (an
    option's default) and ``LLAMA_ATTN_ROT_DISABLE`` (read when the cache is made)."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("LLAMA_ARG_") and key != "LLAMA_ATTN_ROT_DISABLE"
    }


def free_port() -> int:
    """A port nothing listens on now; another process may take it before the server does (then it says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class ServerProcess(ServerClient):
    """One llama-server for one GGUF, alive inside a ``with`` block.

    ``slot_dir`` is the server's ``--slot-save-path`` (slot files are saved to and restored from it);
    the server's output goes to ``log_path`` (by default a temporary file, removed at a stop unless something
    failed), never to a pipe nobody reads.
    """

    def __init__(
        self,
        model: str | Path,
        settings: ServerSettings | None = None,
        *,
        slot_dir: str | Path | None = None,
        log_path: str | Path | None = None,
        start_timeout: float = 120.0,
        request_timeout: float = 600.0,
        stop_grace: float = 2.0,
        binary: str | Path | None = None,
        port: int | None = None,
    ):
        super().__init__(HOST, None, slot_dir=slot_dir, request_timeout=request_timeout)
        self.model = Path(model)
        self.settings = settings or ServerSettings()
        self.log_path = Path(log_path) if log_path is not None else None
        self._own_log = log_path is None
        self._log_start = 0  # where this start's output begins in the log
        self._failed = False  # a failure was reported from the log: keep it
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.binary = Path(binary) if binary is not None else None
        self.process: subprocess.Popen | None = None
        self.fixed_port = port  # None: a free port, chosen again if another process takes it first

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def command(self, port: int) -> list[str]:
        command = [str(self.binary), "--model", str(self.model), "--host", HOST, "--port", str(port)]
        command += self.settings.arguments()
        if self.slot_dir is not None:
            command += ["--slot-save-path", str(self.slot_dir)]
        # No web UI, no warm-up decode (it would touch the cache before the job does).
        return command + ["--no-webui", "--no-warmup"]

    def start(self, attempts: int = 3) -> None:
        if self.process is not None:
            raise LlamaServerError("this llama-server is already started")
        self.binary = server_binary(self.binary)
        if not self.model.is_file():
            raise LlamaServerError(f"GGUF file {self.model} not found — fix the checkpoint's gguf path")
        if self.slot_dir is not None:
            self.slot_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        _install_guards()
        attempts = 1 if self.fixed_port else attempts
        for attempt in range(attempts):
            port = self.fixed_port or free_port()
            self._spawn(port)
            try:
                self._wait_healthy()
                return
            except LlamaServerError:
                port_taken = "couldn't bind HTTP server socket" in self._log_tail()
                self.stop()
                if not port_taken:
                    raise
                if attempt == attempts - 1:
                    chosen = "" if self.fixed_port else f" ({attempts} free ports were taken before it bound one)"
                    raise LlamaServerError(
                        f"llama-server could not listen on {HOST}:{port}: the port is in use{chosen} — free it, or let a free port be chosen"
                    ) from None

    def _spawn(self, port: int) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"--- llama-server on {HOST}:{port}\n".encode())
            log.flush()
            self._log_start = log.tell()
            self.process = subprocess.Popen(
                self.command(port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**server_environment(), **(BATCH_LOG_ENVIRONMENT if self.settings.log_batches else {})},
                preexec_fn=_death_signal_setter(),
            )
        self.port = port
        with _LIVE_LOCK:
            _LIVE.add(self)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.process.poll() is not None:
                raise LlamaServerError(
                    f"llama-server did not start for {self.model} ({exit_status(self.process.returncode)}): {self._log_reason()}"
                )
            try:
                status, _ = self._exchange("GET", "/health", None, timeout=1.0)
                if status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise LlamaServerError(
                    f"llama-server was not healthy within {self.start_timeout:g} s for {self.model}: {self._log_reason()} — raise the start timeout, or check the log {self.log_path}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Terminate the server, kill it after the grace period; safe to call twice and from a signal handler."""
        process = self.process
        if process is None:
            return
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(self.stop_grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(self.stop_grace)  # timed: a blocking wait cannot be re-entered from a signal handler
        self.process = None
        if self._own_log and not self._failed and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def _check_alive(self, what: str, wait: float = 0.0, during: bool = False) -> None:
        """One line if the server is gone: stopped by us, or died (its exit status and its log's reason)."""
        process = self.process
        if process is None:
            raise LlamaServerError(f"llama-server {what}: the server is not running (start it first)")
        try:
            process.wait(wait) if wait else process.poll()
        except subprocess.TimeoutExpired:
            return
        if process.returncode is not None:
            with _LIVE_LOCK:
                _LIVE.discard(self)
            raise LlamaServerError(
                f"llama-server (pid {process.pid}) died ({exit_status(process.returncode)}): {what} {'got no answer' if during else 'not sent'}; its log: {self._log_reason()}"
            )

    # The log.

    def _log_tail(self, size: int = 16384) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                end = log.tell()
                log.seek(max(self._log_start, end - size))
                return log.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def _log_reason(self) -> str:
        """The cause and the end, from the server's log: its first error line (llama.cpp logs the cause first, then
        each caller's "failed") and its last line, each without the timestamp and level; the log is kept."""
        self._failed = True
        lines = [_LOG_PREFIX.sub("", line).strip() for line in self._log_tail().splitlines()]
        lines = [line for line in lines if line and not line.startswith("--- llama-server on")]
        errors = [line for line in self._log_tail().splitlines() if _LOG_ERROR.match(line)]
        if not lines:
            return f"nothing logged (log {self.log_path})"
        first = _LOG_PREFIX.sub("", errors[0]).strip() if errors else None
        if first is None or first == lines[-1]:
            return f"{lines[-1]} (log {self.log_path})"
        return f"{first} … {lines[-1]} (log {self.log_path})"

    def log_text(self) -> str:
        """What this start of the server logged so far (its context settings, the cache's types and rotation)."""
        return self._log_tail(1 << 22)

    def log_size(self) -> int:
        """Where the log ends now: a mark for ``log_since``."""
        return self.log_path.stat().st_size if self.log_path is not None and self.log_path.exists() else 0

    def log_since(self, mark: int) -> str:
        """What the server logged after ``mark`` (``log_size``)."""
        with open(self.log_path, "rb") as log:
            log.seek(max(mark, self._log_start))
            return log.read().decode("utf-8", errors="replace")

    def batch_log_mark(self) -> int | None:
        return self.log_size() if self.settings.log_batches else None

    def batch_log_since(self, mark: int) -> str:
        return self.log_since(mark)

    # The slots: every one of the server's.

    def usable_slots(self) -> range:
        return range(self.settings.parallel)

    def slot_refusal(self, slot: int) -> str:
        count = self.settings.parallel
        return f"this server has {count} slot{'s' if count != 1 else ''} (0..{count - 1}) — start it with parallel={slot + 1} or more"


# A server log line: "0.00.004.351 E gguf_init_from_reader: ..." (minutes.seconds.milliseconds, level).
_LOG_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ [A-Z] ")
_LOG_ERROR = re.compile(r"^\d+\.\d+\.\d+\.\d+ E ")
