"""llama.cpp's HTTP server (``llama-server``) as the rest of stagereplay sees it before loading it (no torch).

The same GGUFs, precisions (KV-cache types) and byte counts as the binding's engine: the server is built from
the llama.cpp tree the binding vendors, so its caches are the same bytes. What differs is how the engine
reaches the model: through HTTP requests on one slot of its own server process. E6 runs on it the factors
that are the server's per-process options (``-t/-tb``, ``-fa``, ``-ub``, ``-ctk/-ctv``): each level is a
restart with the option changed, as the binding's is a new context; any other factor in a ``factors:``
block naming this engine is refused at parse time.

What it declares beyond the binding's spec is here, as plain values; ``llamacpp.spec`` makes the spec object
(``LLAMASERVER``) with the binding's spec class. That keeps the registry one import level above the specs
(tests/test_architecture.py's depth limit): a spec module importing another would add a level.
"""

from __future__ import annotations

DECLARED = {
    "name": "llamaserver",
    "summary": "a GGUF through llama.cpp's own HTTP server",
    "record_kind": "gguf",
    # factor -> (how the server runs it: a Knob's mechanism, its option); refusals are the binding's
    "factors": {
        "threads": ("restart", "-t/-tb"),
        "flash_attn": ("restart", "-fa"),
        "ubatch": ("restart", "-ub"),
        "cache_type": ("restart", "-ctk/-ctv"),
        "prefix_reuse": ("kept", "the slot's prompt cache; slot save and restore"),
        "batch": ("load", "-np B --kv-unified: B-1 other requests generating"),
        "kv_offset": ("load", "another slot's idle cells before the item's (--no-cache-idle-slots)"),
        "kv_unified": ("load", "-np B --no-kv-unified: B-1 other requests generating"),
    },
    # The server is no Python distribution: its build (vendored commit, CMake flags, CPU features) is in every
    # row's engine_build; the binding it was built from, whose tokenizer the engine uses, is versioned here.
    "libraries": ("llama_cpp_python",),
    "engine_class_path": "stagereplay.engines.llamaserver.engine:LlamaServerEngine",
    # A checkpoint with attach: the engine on one slot of a server someone else runs, its slot files read here.
    "attached_class_path": "stagereplay.engines.llamaserver.attached_engine:AttachedServerEngine",
    # Whole requests to a server deployed by the workflow or attached at a URL (the served block, stagereplay probe).
    "server_module": "stagereplay.engines.llamaserver.served",
    "precision_note": "its precision is llama.cpp's KV cache type; the weights are the GGUF's as shipped, run by"
    " llama-server (built here from the binding's vendored llama.cpp, or attached at a URL); its logits are read as log-probabilities"
    " (logits less a constant per position): margins and argmax hold, absolute logits do not",
    # factor -> (what its control exercises on the server, what it does not): EngineSpec.control_scopes
    "control_scopes": {
        "threads": (
            "a server restart with the run's own -t/-tb: a new process and its cache allocation",
            "another thread count's split of the work",
        ),
        "flash_attn": (
            "a server restart with the run's own -fa: a new process and its cache allocation",
            "the other attention path",
        ),
        "ubatch": (
            "a server restart with the run's own -ub: a new process and its cache allocation",
            "another split of the prompt into micro-batches",
        ),
        "cache_type": (
            "a server restart with the run's own -ctk/-ctv (a new process and its cache allocation), and the"
            " conversion path, which must hand the cache back as it is",
            "a conversion between two cache types: no value is converted",
        ),
        "prefix_reuse": (
            "the slot's own prompt cache keeping the whole context of the earlier request",
            "a partial hit: nothing is decoded on top of the kept cells",
        ),
        "batch": (
            "4 slots in one unified cache of 2048·4 cells; 3 companions started, generating, then cancelled and"
            " erased before the item's request: slots, the shared cache, companion streams, cancellation, erasure",
            "the companions' cells beside the item's, or their tokens in its decode calls (kv_offset tests the cells)",
        ),
        "kv_offset": (
            "2 slots in one unified cache, slot 1 fed 100 cells, then erased before the item's request: the filler"
            " path and its erasure",
            "the item's cells behind another slot's: they start at cell 0",
        ),
        "kv_unified": (
            "4 slots with --no-kv-unified (one KV stream per slot of 2048 cells); 3 companions started,"
            " generating, then cancelled and erased before the item's request",
            "other slots' tokens in the item's decode calls, or cells in streams beside the item's",
        ),
    },
}
