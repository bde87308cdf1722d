"""A llama-server someone else runs, attached by its URL: asked, never started, restarted or stopped.

``AttachedServer`` is a ``ServerClient`` for a server this project did not start. It behaves as a guest:

- it sends requests only to the slots it is given (``slots``; the server takes a slot id modulo its slot count,
  so an unlisted id is refused here, in one line, before it is sent);
- it reads what the server says of itself (``identity``: ``/props``, ``/v1/models`` and ``/slots``), so a job can
  check that the server it talks to is still the one the ledger records (``check_unchanged``): a server
  restarted with another model or build under a run stops the job in one line;
- it learns whether slot files are on (``--slot-save-path``) without writing one (``slot_files_on``): a slot
  action the server does not know is refused as "not supported" when they are off, and as "invalid action"
  when they are on, with nothing saved, restored or erased;
- a server that stops answering is one line naming its URL, at the request that got no answer.

The API key, where the server wants one, comes from an environment variable the config names
(``api_key_from``), never from the config itself. No torch here.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from stagereplay.engines.llamaserver.build import LlamaServerError
from stagereplay.engines.llamaserver.client import ServerClient

# How long a status request (/health, /props, /slots) may take before the server counts as not answering.
STATUS_TIMEOUT = 10.0
# How long a server that stopped answering is given to answer /health again before the job gives up on it.
RECONNECT_SECONDS = 10.0
# A slot action no server knows: asked only to learn whether slot actions are on (``slot_files_on``).
NO_ACTION = "stagereplay-probe"


@dataclass(frozen=True)
class ServerIdentity:
    """What a llama-server says of itself: its build, its model, its slots."""

    build: str  # /props build_info: "b<number>-<commit>"
    model_path: str  # the GGUF's path on the server's machine
    model_alias: str
    model_ftype: str  # the weights' type, as the server names it ("Q4_1")
    model_bytes: int | None  # /v1/models meta: the weights' size
    n_params: int | None
    n_vocab: int | None
    total_slots: int
    n_ctx_per_slot: int  # each slot's context (/props default_generation_settings.n_ctx)
    chat_template_sha256: str  # of the template the server applies (/props chat_template)

    def record(self) -> dict:
        return asdict(self)

    @property
    def commit(self) -> str:
        """The llama.cpp commit of the build ("b1-0c1e570…" -> "0c1e570…"), or "" where it names none."""
        return self.build.split("-", 1)[1] if "-" in self.build else ""

    def changes_from(self, before: ServerIdentity) -> list[str]:
        """Each field that differs from ``before``, as "name now (was then)"."""
        now, then = self.record(), before.record()
        return [f"{name} {now[name]!r} (was {then[name]!r})" for name in now if now[name] != then[name]]


class AttachedServer(ServerClient):
    """A running llama-server at ``url``, used on ``slots`` only; ``slot_dir`` is its ``--slot-save-path`` as
    this machine sees it, where it is readable here (None: no slot files are read)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        slots: tuple[int, ...] = (0,),
        slot_dir: str | Path | None = None,
        request_timeout: float = 600.0,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise LlamaServerError(
                f"{url!r} is not a llama-server address — give it as http://HOST:PORT (the server's --host and --port)"
            )
        default_port = 443 if parts.scheme == "https" else 80
        super().__init__(
            parts.hostname,
            parts.port or default_port,
            api_key=api_key,
            slot_dir=slot_dir,
            request_timeout=request_timeout,
        )
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.secure = parts.scheme == "https"
        self.slots = tuple(slots)
        # What the server said of itself when the job began (``record_identity``): a request that gets no answer
        # is then checked against it once the server answers again.
        self.recorded: ServerIdentity | None = None

    @property
    def address(self) -> str:
        return self.url

    def connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.secure else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.request_timeout if timeout is None else timeout)

    # What the server says of itself.

    def health(self) -> None:
        """The server answers ``/health`` (one line naming the URL if it does not)."""
        self.request("/health", timeout=STATUS_TIMEOUT)

    def identity(self) -> ServerIdentity:
        props = self.request("/props", timeout=STATUS_TIMEOUT)
        models = self.request("/v1/models", timeout=STATUS_TIMEOUT).get("data") or [{}]
        meta = models[0].get("meta") or {}
        template = str(props.get("chat_template", ""))
        return ServerIdentity(
            build=str(props.get("build_info", "")),
            model_path=str(props.get("model_path", "")),
            model_alias=str(props.get("model_alias", "")),
            model_ftype=str(props.get("model_ftype", "")),
            model_bytes=meta.get("size"),
            n_params=meta.get("n_params"),
            n_vocab=meta.get("n_vocab"),
            total_slots=int(props.get("total_slots", 0)),
            n_ctx_per_slot=int(props.get("default_generation_settings", {}).get("n_ctx", 0)),
            chat_template_sha256=hashlib.sha256(template.encode()).hexdigest(),
        )

    def record_identity(self) -> ServerIdentity:
        """What the server says of itself now, kept: every lost request is checked against it."""
        self.recorded = self.identity()
        return self.recorded

    def check_slots(self, identity: ServerIdentity, where: str) -> None:
        """One line if a slot this run was given is not one of the server's (``where``: the option that lists them)."""
        for slot in self.slots:
            if not 0 <= slot < identity.total_slots:
                raise LlamaServerError(
                    f"slot {slot} is not one of the {identity.total_slots} slots of the llama-server at {self.url} —"
                    f" list slots 0..{identity.total_slots - 1} only under {where}"
                )

    def slot_states(self) -> list[dict]:
        """``GET /slots``: each slot's id, context and whether it is processing (the server must allow it)."""
        return self.request("/slots", timeout=STATUS_TIMEOUT)

    def slot_files_on(self) -> bool:
        """Whether the server was started with ``--slot-save-path``, learnt from an action no server knows: it is
        refused as not supported without slot files, as invalid with them; nothing is saved or erased."""
        slot = self.slots[0] if self.slots else 0
        try:
            self.request(f"/slots/{slot}?action={NO_ACTION}", {}, timeout=STATUS_TIMEOUT)
        except LlamaServerError as error:
            if "HTTP 501" in str(error):
                return False
            if "HTTP 400" in str(error):
                return True
            raise
        raise LlamaServerError(
            f"the llama-server at {self.url} accepted the slot action {NO_ACTION!r}, which it has none of"
        )

    def check_unchanged(self, before: ServerIdentity) -> None:
        """One line if the server now says something else of itself than ``before``: restarted or replaced."""
        changes = self.identity().changes_from(before)
        if changes:
            raise LlamaServerError(
                f"the llama-server at {self.url} is not the one this run recorded: {'; '.join(changes)} — it was"
                " restarted with other settings or replaced; run again against the server the ledger records, or"
                " start a new ledger"
            )

    # The guest's slots.

    def usable_slots(self) -> tuple[int, ...]:
        return self.slots

    def slot_refusal(self, slot: int) -> str:
        return (
            f"this run may use slots {list(self.slots)} of the llama-server at {self.url} — list the slot under the"
            " checkpoint's slots if it is yours to use"
        )

    def _check_alive(self, what: str, wait: float = 0.0, during: bool = False) -> None:
        """After a request that got no answer: one line if ``/health`` gets none for ``RECONNECT_SECONDS``, or if
        the server that answers again is not the one recorded (restarted with another model or build)."""
        if not during:
            return
        deadline = time.monotonic() + RECONNECT_SECONDS
        while True:
            try:
                status, _ = self._exchange("GET", "/health", None, STATUS_TIMEOUT)
                problem = None if status == 200 else f"HTTP {status}"
            except (OSError, http.client.HTTPException) as error:
                problem = type(error).__name__
            if problem is None:
                break
            if time.monotonic() > deadline:
                raise LlamaServerError(
                    f"no llama-server answers at {self.url} ({problem}): {what} got no answer — start the server,"
                    " or fix its url"
                )
            time.sleep(0.2)
        if self.recorded is not None:
            self.check_unchanged(self.recorded)


def api_key_from(variable: str | None, option: str) -> str | None:
    """The API key held by the environment variable ``variable`` names (None: the server wants no key); ``option``:
    where the variable was named (the config key or the command-line option), for the message."""
    if not variable:
        return None
    key = os.environ.get(variable)
    if not key:
        raise LlamaServerError(
            f"{option} names the environment variable {variable}, which is not set — export the server's API key as"
            f" {variable}"
        )
    return key
