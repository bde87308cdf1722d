"""Requests to one llama-server at a host and port: JSON in and out, one line on any failure.

``ServerClient`` is what every use of a server shares, whether this project started it (``process.ServerProcess``)
or someone else runs it (``attached.AttachedServer``): the request and its timeout, the API key (sent as
``Authorization: Bearer``, as the server checks it), the slot actions and a greedy completion of token ids. A
subclass says what a lost server means (``_check_alive``) and which slots it may use (``usable_slots``).

No torch here.
"""

from __future__ import annotations

import http.client
import json
import os
from dataclasses import dataclass
from pathlib import Path

from stagereplay.engines.llamaserver.build import LlamaServerError

# Pure greedy in this server: temperature 0 keeps only the first highest logit, and with no other sampler
# in the chain that is the argmax over the whole vocabulary (ties to the lowest id), as the engines decode.
GREEDY = {"temperature": 0.0, "samplers": ["temperature"]}


@dataclass(frozen=True)
class Sampling:
    """How a served request picks each token: greedy (temperature 0, the default), or sampled at ``temperature``
    with the server's RNG seeded (``seed``) and, where given, ``top_k`` / ``top_p`` (else the server's defaults), as
    llama.cpp's own server tests send their requests. A sampled request with its seed gives the same tokens each time
    the server computes the same logits, so its answers are compared as greedy ones are."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def fields(self) -> dict:
        """The request's sampling fields, on ``/completion`` and ``/v1/chat/completions`` alike."""
        if self.greedy:
            return dict(GREEDY)
        chosen = {"top_k": self.top_k, "top_p": self.top_p, "seed": self.seed}
        return {"temperature": self.temperature, **{key: value for key, value in chosen.items() if value is not None}}


GREEDY_SAMPLING = Sampling()


def greedy_margin(token: int, step: dict) -> float:
    """One step of a greedy answer with ``n_probs`` >= 2: the top-1 minus top-2 log-probability (pre-sampling, so
    the two logits' difference; 0 at a tie), checked to name the chosen ``token``. The server lists its top tokens
    by an unstable partial sort (``get_token_probabilities``), so at an exact tie the token it chose, the lowest id
    of the tied, may be listed second: a token tied with the top is greedy, any other is not."""
    top = step["top_logprobs"]
    chosen = next((entry["logprob"] for entry in top if entry["id"] == token), None)
    if chosen != top[0]["logprob"]:
        listed = f"log-probability {chosen}" if chosen is not None else f"not among its top {len(top)}"
        raise LlamaServerError(
            f"llama-server chose token {token} ({listed}), its highest is token {top[0]['id']}"
            f" (log-probability {top[0]['logprob']}): not greedy"
        )
    return sampled_margin(token, step)


def sampled_margin(token: int, step: dict) -> float:
    """One step of a sampled answer: the same top-1 minus top-2 log-probability of the logits it was drawn from
    (pre-sampling), whichever token was drawn; how near a tie the step was, not how likely its token."""
    top = step["top_logprobs"]
    return float(top[0]["logprob"] - top[1]["logprob"])


class ServerClient:
    """HTTP requests to a llama-server at ``host``:``port``.

    ``slot_dir`` is the server's ``--slot-save-path`` as this machine sees it: slot files are saved there by the
    server and read here (None: no slot files)."""

    def __init__(
        self,
        host: str,
        port: int | None,
        *,
        api_key: str | None = None,
        slot_dir: str | Path | None = None,
        request_timeout: float = 600.0,
    ):
        self.host = host
        self.port = port
        self.api_key = api_key
        self.slot_dir = Path(slot_dir) if slot_dir is not None else None
        self.request_timeout = request_timeout

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def usable_slots(self) -> range | tuple[int, ...]:
        """The slots this client may send requests to."""
        raise NotImplementedError

    def slot_refusal(self, slot: int) -> str:
        """Why ``slot`` is not one of them, and the fix."""
        raise NotImplementedError

    def _check_alive(self, what: str, wait: float = 0.0, during: bool = False) -> None:
        """One line if the server is gone (``during``: the request was sent and got no answer)."""
        raise NotImplementedError

    def batch_log_mark(self) -> int | None:
        """Where the server's batch log (every decode call's tokens: ``batches``) ends now, or None where this
        client reads none (a server someone else runs, or one started without it)."""
        return None

    def batch_log_since(self, mark: int) -> str:
        """What the batch log holds after ``mark``."""
        raise NotImplementedError

    # Requests.

    def connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(
            self.host, self.port, timeout=self.request_timeout if timeout is None else timeout
        )

    def headers(self, json_body: bool) -> dict[str, str]:
        headers = {"Content-Type": "application/json"} if json_body else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

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
        if status == 401:
            raise LlamaServerError(
                f"llama-server {what}: HTTP 401: {error_message(answer)} — the server wants an API key: name the"
                " environment variable that holds it as the checkpoint's api_key_env"
            )
        if status != 200:
            raise LlamaServerError(f"llama-server {what}: HTTP {status}: {error_message(answer)}")
        return answer

    def _exchange(self, method: str, endpoint: str, payload: dict | None, timeout: float) -> tuple[int, bytes]:
        connection = self.connection(timeout)
        try:
            body = None if payload is None else json.dumps(payload).encode()
            connection.request(method, endpoint, body=body, headers=self.headers(body is not None))
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    # Conveniences for the server's endpoints.

    def props(self) -> dict:
        return self.request("/props")

    def complete(self, tokens: list[int], n_predict: int, *, slot: int = 0, cache_prompt: bool = True, **extra) -> dict:
        """A greedy completion of a token-id prompt: the answer holds the generated ids in ``tokens``."""
        payload = {
            "prompt": list(tokens),
            "n_predict": n_predict,
            "id_slot": self.checked_slot(slot),
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
            raise LlamaServerError("this llama-server has no slot folder — give it a slot folder (--slot-save-path)")
        partial = f"{filename}.partial"
        try:
            answer = self.request(f"/slots/{self.checked_slot(slot)}?action=save", {"filename": partial})
            os.replace(self.slot_dir / partial, self.slot_dir / filename)
        finally:
            (self.slot_dir / partial).unlink(missing_ok=True)
        return {**answer, "filename": filename}

    def restore_slot(self, slot: int, filename: str) -> dict:
        return self.request(f"/slots/{self.checked_slot(slot)}?action=restore", {"filename": filename})

    def erase_slot(self, slot: int) -> dict:
        return self.request(f"/slots/{self.checked_slot(slot)}?action=erase", {})

    def checked_slot(self, slot: int) -> int:
        """The slot, refused unless this client may use it: the server takes ids modulo its slot count, so
        slot 7 of a one-slot server would silently be slot 0."""
        if slot not in self.usable_slots():
            raise LlamaServerError(f"slot {slot}: {self.slot_refusal(slot)}")
        return slot


def error_message(answer: dict) -> str:
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or answer)[:300]
