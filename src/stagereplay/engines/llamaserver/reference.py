"""The settings this project's own llama-server starts with (``engine.load_llamaserver``), and that an operator gives
a server of their own to attach it and get the same bytes (``attached_engine``; docs/engines.md).

Every setting the numbers depend on is on the command line, as the binding engine's reference context has it:
``-c``, ``-b`` and ``-ub`` all ``LLAMACPP_N_CTX`` (a prefix is one decode call and one micro-batch), one slot without
a unified cache, flash attention and the thread count from the runtime, the cache types from the precision, no
weight repacking, no host-memory prompt cache, and the options below. No torch here.
"""

from __future__ import annotations

from stagereplay.engines.base import Runtime
from stagereplay.engines.llamacpp.cache_types import cache_types
from stagereplay.engines.llamacpp.settings import LLAMACPP_N_CTX
from stagereplay.engines.llamaserver.process import ServerSettings

# Options besides ServerSettings' own: no GPU layers and no memory fitting (a CPU build; --fit could change
# an unset option), no context shift, no idle-slot caching, a fixed seed (greedy draws nothing, but the
# sampler is seeded all the same).
EXTRA_OPTIONS = ("--n-gpu-layers", "0", "--fit", "off", "--no-context-shift", "--no-cache-idle-slots", "--seed", "0")


def server_extra(cache_type: str) -> tuple[str, ...]:
    """The options besides ServerSettings' own for a cache type: llama.cpp's own log lines (the cache's rotation
    among them) reach the server's log only at verbosity 4, and a quantized cache's stored format depends on
    them (``chosen_rotation``)."""
    return EXTRA_OPTIONS + (("--log-verbosity", "4") if cache_types(cache_type).quantized else ())


def reference_settings(runtime: Runtime) -> ServerSettings:
    """What the engine's own server starts with at ``runtime`` (an operator starts the same to attach it)."""
    return ServerSettings(
        threads=runtime.threads,
        threads_batch=runtime.threads,
        flash_attn=runtime.flash_attn,
        cache_type=runtime.precision,
        ctx_size=LLAMACPP_N_CTX,
        batch=LLAMACPP_N_CTX,
        ubatch=LLAMACPP_N_CTX,
        parallel=1,
        kv_unified=False,
        repack=False,
        cache_ram_mib=0,
        extra=server_extra(runtime.precision),
    )
