"""bench/deployed_server.py on a real llama-server started with its own defaults, on the tiny GGUF: the A/A control
holds, the prompt-cache hit reuses the prompt, and without a unified cache another client's traffic leaves every
answer as it was alone (each slot's cells from cell 0 of its own stream: the mechanism of docs/findings.md).

Skipped without the built server unless STAGEREPLAY_REQUIRE_LLAMASERVER=1.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from test_llamaserver_engine import built, tiny_gguf  # noqa: F401 - fixtures

BENCH = Path(__file__).resolve().parents[1] / "bench" / "deployed_server.py"
spec = importlib.util.spec_from_file_location("deployed_server", BENCH)
deployed_server = importlib.util.module_from_spec(spec)
sys.modules["deployed_server"] = deployed_server  # its dataclasses look their module up there
spec.loader.exec_module(deployed_server)

pytestmark = pytest.mark.slow


def _prompts() -> dict[str, list[int]]:
    """Four items of 80 byte ids each: more than one 64-query tile in a one-call prefill."""
    return {f"item-{i}": [(step * p + 5) % 250 + 3 for p in range(80)] for i, step in enumerate((17, 29, 31, 37))}


def test_the_servers_own_defaults_and_its_control_and_cache_hit(built, tiny_gguf):  # noqa: F811
    measured = deployed_server.measure(tiny_gguf, [], _prompts(), budget=6, seed=0)
    assert measured["flags"] == ["--no-repack"]  # nothing but the one flag the table names
    assert measured["slots"] == 4  # -np auto
    # -fa auto: what it resolved to is not in the default log, nor in /props, and the table says so.
    assert measured["flash_attn"] == deployed_server.FLASH_ATTN_AUTO
    results = measured["items"]
    assert deployed_server.differs(results, "control") == []  # the same request alone, twice
    assert all(result.hit.reused >= 64 for result in results.values())  # the cached prompt was reused
    assert all(len(result.loaded.tokens) == 6 for result in results.values())
    assert "| default --no-repack | 4 |" in deployed_server.table({"default": measured})


def test_without_a_unified_cache_other_clients_change_no_answer(built, tiny_gguf):  # noqa: F811
    measured = deployed_server.measure(tiny_gguf, ["--no-kv-unified"], _prompts(), budget=6, seed=0)
    results = measured["items"]
    assert deployed_server.differs(results, "control") == []
    assert deployed_server.differs(results, "loaded") == []


def test_flash_attention_off_is_read_from_the_log(built, tiny_gguf):  # noqa: F811
    measured = deployed_server.measure(tiny_gguf, ["-fa", "off"], dict(list(_prompts().items())[:1]), budget=2, seed=0)
    assert measured["flash_attn"] == "off"
