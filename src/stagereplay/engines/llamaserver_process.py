"""llama.cpp's own HTTP server (``llama-server``) as a child process that never outlives its job.

The server binary is built from the llama.cpp tree vendored in the pinned llama-cpp-python sdist
(``envs/build_llama_server.sh``, run by ``SPEC=envs/llamaserver.txt bash envs/setup.sh``), so its slot
files hold the same sequence state format as the one ``llamacpp_state`` parses. The build writes a record
beside the binary (``llama-server.json``: the binding version, the vendored commit, the CMake flags and
the CPU features); ``server_binary`` refuses a binary that is missing or was built for another version,
and ``server_build`` gives the record every row of a server run names.

``ServerProcess`` starts the server for one GGUF on 127.0.0.1 and a free port, waits for ``/health``,
and stops it on leaving its ``with`` block, on an error too. The child cannot be orphaned: a SIGTERM or
SIGHUP to this process stops every live server before this process exits, an exit stops them (atexit),
and on Linux the kernel kills the server when the thread that started it dies (PR_SET_PDEATHSIG), so a
SIGKILL of this process takes the server with it. Every failure is one line (``LlamaServerError``, a
``ModelError``): a server that does not start (its log's first error and last line), a port in use, a
request that errors or times out (the endpoint and the server's message), a server that died (its exit
status). A slot is saved under a partial name and renamed, so no half-written slot file is left.

No torch here: the slot-file reader imports the state parser only when it is called.
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from stagereplay.engines.cache_types import CACHE_TYPES, CacheTypeError, cache_types
from stagereplay.engines.spec import ModelError

if TYPE_CHECKING:
    from stagereplay.engines.llamacpp_state import Geometry, SeqState

BINARY = "llama-server"
SETUP = "SPEC=envs/llamaserver.txt bash envs/setup.sh"
HOST = "127.0.0.1"


class LlamaServerError(ModelError):
    """One line: what the server (or its binary) did wrong, and the fix where there is one."""


# The binary and its build record.


def binary_path() -> Path:
    """Where the set-up installs the server: beside this environment's Python."""
    return Path(sys.prefix) / "bin" / BINARY


@dataclass(frozen=True)
class ServerBuild:
    """The build record ``envs/build_llama_server.sh`` wrote beside the binary."""

    llama_cpp_python: str  # the binding whose vendored llama.cpp tree was built
    llama_cpp_commit: str  # that tree's commit, as the sdist's changelog names it ("unknown" if it does not)
    cmake_flags: tuple[str, ...]
    march_native: str  # what the compiler's -march=native resolved to on the build machine
    cpu_features: tuple[str, ...]  # the instruction sets the kernels were compiled for
    version_output: str  # what ``llama-server --version`` printed

    def describe(self) -> str:
        """The build in one line, for a row's environment."""
        return (
            f"llama-server of llama-cpp-python {self.llama_cpp_python} (llama.cpp {self.llama_cpp_commit});"
            f" {' '.join(self.cmake_flags)}; -march=native={self.march_native}; {' '.join(self.cpu_features)}"
        )


def server_build(binary: Path | None = None) -> ServerBuild:
    """The build record of ``binary`` (the installed server by default); one line if it has none."""
    binary = binary or binary_path()
    record = binary.with_name(binary.name + ".json")
    try:
        data = json.loads(record.read_text())
        return ServerBuild(
            llama_cpp_python=str(data["llama_cpp_python"]),
            llama_cpp_commit=str(data["llama_cpp_commit"]),
            cmake_flags=tuple(data["cmake_flags"]),
            march_native=str(data["march_native"]),
            cpu_features=tuple(data["cpu_features"]),
            version_output=str(data["version_output"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = "has no build record" if isinstance(error, OSError) else f"has an unreadable build record ({error!r})"
        raise LlamaServerError(f"{binary} {problem} ({record}) — run {SETUP}") from None


def installed_binding_version() -> str | None:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def server_binary(binary: Path | None = None) -> Path:
    """The installed server (or ``binary``), checked: present, executable, built from the installed binding's tree."""
    binary = Path(binary) if binary is not None else binary_path()
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise LlamaServerError(f"llama-server is not built ({binary} is missing) — run {SETUP}")
    built_for = server_build(binary).llama_cpp_python
    installed = installed_binding_version()
    if built_for != installed:
        raise LlamaServerError(
            f"llama-server at {binary} was built from llama-cpp-python {built_for}, the installed one is {installed or 'none'} — run {SETUP}"
        )
    return binary


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


class ServerProcess:
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
        self.model = Path(model)
        self.settings = settings or ServerSettings()
        self.slot_dir = Path(slot_dir) if slot_dir is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self._own_log = log_path is None
        self._log_start = 0  # where this start's output begins in the log
        self._failed = False  # a failure was reported from the log: keep it
        self.start_timeout = start_timeout
        self.request_timeout = request_timeout
        self.stop_grace = stop_grace
        self.binary = Path(binary) if binary is not None else None
        self.process: subprocess.Popen | None = None
        self.fixed_port = port  # None: a free port, chosen again if another process takes it first
        self.port: int | None = None

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

    # Requests.

    def request(self, endpoint: str, payload: dict | None = None, *, timeout: float | None = None) -> dict:
        """POST ``payload`` as JSON (GET without one) and the JSON answer; one line on any failure."""
        method = "GET" if payload is None else "POST"
        what = f"{method} {endpoint}"
        self._check_alive(what)
        timeout = self.request_timeout if timeout is None else timeout
        try:
            status, body = self._exchange(method, endpoint, payload, timeout)
        except TimeoutError:
            self._check_alive(what, during=True)
            raise LlamaServerError(
                f"llama-server {what}: no answer within {timeout:g} s — raise the request timeout"
            ) from None
        except (OSError, http.client.HTTPException) as error:
            self._check_alive(what, wait=1.0, during=True)
            raise LlamaServerError(f"llama-server {what} failed: {error!r}") from None
        try:
            answer = json.loads(body) if body else {}
        except ValueError:
            raise LlamaServerError(f"llama-server {what}: HTTP {status}, not JSON: {body[:200]!r}") from None
        if status != 200:
            raise LlamaServerError(f"llama-server {what}: HTTP {status}: {_error_message(answer)}")
        return answer

    def _exchange(self, method: str, endpoint: str, payload: dict | None, timeout: float) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            body = None if payload is None else json.dumps(payload).encode()
            headers = {"Content-Type": "application/json"} if body is not None else {}
            connection.request(method, endpoint, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

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

    # Conveniences for the server's endpoints.

    def props(self) -> dict:
        return self.request("/props")

    def complete(self, tokens: list[int], n_predict: int, *, slot: int = 0, cache_prompt: bool = True, **extra) -> dict:
        """A greedy completion of a token-id prompt: the answer holds the generated ids in ``tokens``."""
        payload = {
            "prompt": list(tokens),
            "n_predict": n_predict,
            "id_slot": self._slot(slot),
            "cache_prompt": cache_prompt,
            "return_tokens": True,
            **GREEDY,
            **extra,
        }
        return self.request("/completion", payload)

    def save_slot(self, slot: int, filename: str) -> dict:
        """The slot's cache and tokens written to ``filename`` in the slot folder (``n_saved`` tokens, ``n_written``
        bytes). The server writes the file in place, so it saves under a partial name that is renamed once the
        save has answered: a stop or a failure mid-save leaves no half-written file under ``filename``."""
        if self.slot_dir is None:
            raise LlamaServerError("this llama-server has no slot folder — give ServerProcess a slot_dir")
        partial = f"{filename}.partial"
        try:
            answer = self.request(f"/slots/{self._slot(slot)}?action=save", {"filename": partial})
            os.replace(self.slot_dir / partial, self.slot_dir / filename)
        finally:
            (self.slot_dir / partial).unlink(missing_ok=True)
        return {**answer, "filename": filename}

    def restore_slot(self, slot: int, filename: str) -> dict:
        return self.request(f"/slots/{self._slot(slot)}?action=restore", {"filename": filename})

    def erase_slot(self, slot: int) -> dict:
        return self.request(f"/slots/{self._slot(slot)}?action=erase", {})

    def _slot(self, slot: int) -> int:
        """The slot, refused if the server has no such slot: the server takes ids modulo its slot count, so
        slot 7 of a one-slot server would silently be slot 0."""
        count = self.settings.parallel
        if not 0 <= slot < count:
            raise LlamaServerError(
                f"slot {slot}: this server has {count} slot{'s' if count != 1 else ''} (0..{count - 1}) — start it with parallel={slot + 1} or more"
            )
        return slot


# Pure greedy in this server: temperature 0 keeps only the first highest logit, and with no other sampler
# in the chain that is the argmax over the whole vocabulary (ties to the lowest id), as the engines decode.
GREEDY = {"temperature": 0.0, "samplers": ["temperature"]}


# A server log line: "0.00.004.351 E gguf_init_from_reader: ..." (minutes.seconds.milliseconds, level).
_LOG_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ [A-Z] ")
_LOG_ERROR = re.compile(r"^\d+\.\d+\.\d+\.\d+ E ")


def _error_message(answer: dict) -> str:
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or answer)[:300]


# Slot files.

SLOT_FILE_MAGIC = 0x67677371  # "ggsq": llama_state_seq_save_file's header
SLOT_FILE_VERSION = 3
TOKENS_STATE_VERSION = 1  # the server's packed token list (server_tokens::serialize)


def read_slot_file(path: str | Path, geometry: Geometry, slot: int = 0, rotation=(0, 0)) -> tuple[list[int], SeqState]:
    """The tokens and the parsed cache of a slot file the server saved (``/slots/N?action=save``).

    The file is llama_state_seq_save_file's: "ggsq", version 3, a count of 32-bit words and the words (the
    server's packed tokens: -1, version 1, the token count and ids, a count of media chunks), then the
    sequence state without its in-memory header; that header (magic and the slot's sequence id) is put
    back and the state goes through the project's parser, whose one-line error a damaged file gets.
    """
    from stagereplay.engines.llamacpp_state import MAGIC, LlamaStateError, parse_seq_state

    data = Path(path).read_bytes()

    def refuse(problem: str) -> LlamaStateError:
        return LlamaStateError(f"llama-server slot file {path}: {problem} — save the slot again with this llama-server")

    if len(data) < 12:
        raise refuse(f"ends at byte {len(data)} inside its header")
    magic, version, words = struct.unpack_from("<III", data)
    if magic != SLOT_FILE_MAGIC or version != SLOT_FILE_VERSION:
        raise refuse(f"header {magic:#010x} version {version}, not {SLOT_FILE_MAGIC:#010x} version {SLOT_FILE_VERSION}")
    end = 12 + 4 * words
    if len(data) < end:
        raise refuse(f"ends at byte {len(data)} inside its {words} token words")
    packed = list(struct.unpack_from(f"<{words}i", data, 12))
    if packed and packed[0] == -1:
        if len(packed) < 3 or packed[1] != TOKENS_STATE_VERSION or len(packed) < 3 + packed[2] + 1:
            raise refuse(f"its packed tokens are not version {TOKENS_STATE_VERSION} of the server's token list")
        tokens = packed[3 : 3 + packed[2]]
        if packed[3 + packed[2]] != 0:
            raise refuse("it holds media chunks, which stagereplay does not read")
    else:
        tokens = packed  # a plain token list, as older servers wrote
    state = parse_seq_state(struct.pack("<Ii", MAGIC, slot) + data[end:], geometry, rotation)
    return tokens, state


def gguf_geometry(path: str | Path) -> Geometry:
    """What a GGUF's metadata says its sequence states hold, for ``read_slot_file`` (no llama.cpp needed)."""
    from gguf import GGUFReader

    from stagereplay.engines.llamacpp_state import Geometry

    fields = GGUFReader(path).fields

    def value(key: str):
        return fields[key].contents() if key in fields else None

    arch = value("general.architecture")
    heads = int(value(f"{arch}.attention.head_count"))
    width = int(value(f"{arch}.embedding_length"))
    return Geometry(
        n_layer=int(value(f"{arch}.block_count")),
        n_head_kv=int(value(f"{arch}.attention.head_count_kv") or heads),
        head_dim_k=int(value(f"{arch}.attention.key_length") or width // heads),
        head_dim_v=int(value(f"{arch}.attention.value_length") or width // heads),
    )
