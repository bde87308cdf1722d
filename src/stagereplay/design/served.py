"""The config's ``served`` block, checked before any job: its servers and what they need.

The servers are the serving engine's (``registry.serving_spec``); whether an entry can run is that engine's
answer (``check_server``: deployed flags, an attached URL and its slots), asked without sending a request. The
requests carry the primary checkpoint's prompt tokens, so it must be a GGUF the servers run. No torch.
"""

from __future__ import annotations

import json
import re

from stagereplay.engines.registry import serving_spec
from stagereplay.engines.spec import EngineSpec, ModelError

# A served request's sampling as every served row records it when greedy (``sampling_json``).
GREEDY_JSON = '{"temperature": 0}'

# A server's name is a path component of its table (runs/served/NAME.parquet).
SERVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ServedRefused(ValueError):
    """One line: what in the served block cannot run, and the fix."""


def check_served(config: dict, primary_spec: EngineSpec) -> list[str]:
    """The served servers' names, in the config's order (the first is the reference); [] without any."""
    served = config["served"]
    servers = served["servers"]
    if not servers:
        return []
    if primary_spec.record_kind != "gguf":
        raise ServedRefused(
            "served: the servers run the primary checkpoint's GGUF and its prompt tokens — make the first checkpoint"
            " a GGUF one (engine llamacpp or llamaserver), or remove served"
        )
    try:
        protocol = serving_spec().server_protocol()
    except ModelError as error:
        raise ServedRefused(f"served: {error}") from None
    tokens, boundary = served_tokens(config), config["stage"]["max_new_tokens"]
    if tokens <= boundary:
        raise ServedRefused(
            f"served.tokens: {tokens} tokens per request end within the first stage (stage.max_new_tokens:"
            f" {boundary}), so no request can be replayed from the stage boundary — set served.tokens above {boundary}"
        )
    if "default" in served["send_as"] and not config["runtime"]["use_chat_template"]:
        raise ServedRefused(
            "served.send_as: the default client sends each item as chat messages, and this run's prompts are not"
            " chat-templated (runtime.use_chat_template: false) — remove default from served.send_as, or set"
            " runtime.use_chat_template: true"
        )
    sampling = served.get("sampling") or {}
    if sampling.get("temperature") and sampling.get("seed") is None:
        raise ServedRefused(
            f"served.sampling: temperature {sampling['temperature']} without a seed draws other tokens on every"
            " request, so no answer can be compared with another — give served.sampling.seed (llama.cpp's own server"
            " tests use 42), or set temperature: 0 (greedy)"
        )
    for name, entry in servers.items():
        if not SERVER_NAME.fullmatch(name):
            raise ServedRefused(
                f"served.servers: {name!r} is no server name — use letters, digits, '.', '_' and '-', starting with a"
                " letter or digit"
            )
        problem = protocol.check_server(name, entry or {}, served)
        if problem:
            raise ServedRefused(problem)
    return list(servers)


def served_tokens(config: dict) -> int:
    """Greedy tokens per served request: the block's, else the stage's suffix budget."""
    return config["served"]["tokens"] or config["stage"]["suffix_tokens"]


def sampling_json(sampling: dict | None) -> str:
    """A served block's sampling as every served row records it: the fields given, as sorted JSON; greedy (no
    temperature, or 0) is ``GREEDY_JSON`` whatever else is given, since a greedy request samples nothing."""
    given = {key: value for key, value in (sampling or {}).items() if value is not None}
    if not given.get("temperature"):
        return GREEDY_JSON
    return json.dumps(given, sort_keys=True)
