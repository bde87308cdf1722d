"""What every engine is: the one protocol the experiments use, and the records it fills in.

An engine runs one checkpoint at one runtime (precision, device, threads, kernels). The experiments
only ever ask it to load a checkpoint at a runtime, start an empty cache, feed tokens into a cache (getting the last position's
float32 logits back), export the cache as a ``KVState`` and import one, and read its tokenizer,
its end-of-generation ids, its layer count and its environment record. Three engines implement it:
transformers (``transformers.engine``), llama.cpp's binding (``llamacpp.engine``) and llama.cpp's own
HTTP server (``llamaserver.engine``); ``registry`` picks one
from a model record. Nothing outside this package asks which engine it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext

import torch

from stagereplay.engines.runtime import Runtime
from stagereplay.engines.spec import ModelError
from stagereplay.ledger.environment import Environment
from stagereplay.ledger.kvstate import KVState

__all__ = ["ModelError", "Runtime"]  # defined with the specs (no torch), raised by every engine


class Engine(ABC):
    """One checkpoint loaded at one runtime: a tokenizer, a cache to feed, and the record of how it runs."""

    tokenizer: object  # encode/decode/apply_chat_template/convert_ids_to_tokens, eos_token_id
    environment: Environment  # recorded in every ledger row the engine's outputs fill
    # Token positions fed through the model so far, padding included: what E6's cost figures count.
    fed_positions: int = 0
    # Where the engine's caches live. A state can come from the store (always on CPU) or from this engine (on
    # its device), and one batch may mix both (E6's batch level), so every method taking a state moves it here
    # first (``placed``): the one seam between stored states and the engine's tensors.
    device: torch.device = torch.device("cpu")

    @classmethod
    @abstractmethod
    def load(cls, record: dict, runtime: Runtime) -> Engine:
        """The checkpoint a model record names, loaded at ``runtime`` (its precision, device and threads)."""

    @classmethod
    @abstractmethod
    def checkpoint_tokenizer(cls, record: dict, trust_remote_code: bool = False) -> tuple[object, int]:
        """The checkpoint's own tokenizer and the context a prompt must fit (0: unknown), without loading it."""

    @property
    @abstractmethod
    def eos_ids(self) -> frozenset[int]:
        """The token ids that end a greedy continuation (the checkpoint's generation settings)."""

    @property
    @abstractmethod
    def num_layers(self) -> int:
        """Layers of the K/V cache, as ``KVState`` exports them."""

    @abstractmethod
    def empty_cache(self) -> object:
        """A new, empty cache of this engine (only this engine's own calls read it)."""

    @abstractmethod
    def forward(self, tokens: list[int], cache: object) -> torch.Tensor:
        """Feed ``tokens`` after what ``cache`` holds, in one call; the float32 logits of the last position."""

    @abstractmethod
    def snapshot(self, cache: object) -> KVState:
        """A detached copy of the cache as it stands now (later decoding never changes it)."""

    @abstractmethod
    def to_cache(self, state: KVState) -> object:
        """A fresh cache holding a copy of ``state`` (decoding from it leaves ``state`` intact)."""

    def feed(self, tokens: list[int], cache: object) -> None:
        """``forward`` without its logits, for a construction that only builds a cache. An engine whose logits
        cost a transfer (a server sends a whole row as text) skips it; the others just forward."""
        self.forward(tokens, cache)

    def generate(
        self,
        cache: object,
        tokens: list[int],
        max_new_tokens: int,
        eos_ids: Collection[int],
        *,
        stop_after: Callable[[list[int]], bool] | None = None,
    ) -> tuple[list[int], list[float], str] | None:
        """Feed ``tokens`` and decode greedily in the engine's own loop, as ``decode.decode_greedy`` does after a
        forward (same stops, the last token never fed): the generated ids, each one's top-1 minus top-2 logit
        margin, and "eos", "budget" or "stopped" (``stop_after`` said so). None, the default: the engine has no
        loop of its own and the caller feeds one token per ``forward``. A server has one: a token per
        ``forward`` would be a request per token, each sending back a whole vocabulary of logits."""
        return None

    def placed(self, state: KVState) -> KVState:
        """``state`` on this engine's device (as it is when it is there already: same tensors, same bytes)."""
        return state.to(self.device)

    def close(self) -> None:  # noqa: B027 - most engines hold nothing outside Python's memory
        """Free what the engine holds outside Python's memory (nothing by default)."""

    # --- E6's runtime factors: settings a server changes. An engine that cannot change one says so. ---

    def use_threads(self, threads: int) -> None:
        """Run the next calls with this many intra-op threads."""
        raise ModelError(f"the {self.environment.engine} engine cannot change its thread count between calls")

    def use_attention(self, implementation: str) -> None:
        """Run the next calls with this attention implementation."""
        raise ModelError(f"the {self.environment.engine} engine cannot change its attention kernel between calls")

    def build_description(self) -> str:
        """How the engine runs right now, in words (after ``reconfigure``, the changed settings)."""
        return self.environment.engine_build

    def reconfigure(self, **settings) -> None:
        """Run the next calls with these engine settings changed (llama.cpp's context parameters)."""
        raise ModelError(f"the {self.environment.engine} engine has no settings to change between calls")

    def converted(self, state: KVState) -> KVState:
        """``state`` as this engine's cache stores it (another cache type converted), or as it is."""
        return state

    def batch_context(self, size: int, unified: bool = True) -> AbstractContextManager:
        """Where a batch of ``size`` sequences runs (nothing to set up by default); ``unified`` False: each
        sequence in a KV stream of its own, from cell 0 (llama.cpp's ``kv_unified`` off)."""
        return nullcontext()

    def behind_filler(self, tokens: list[int], removed: bool = False) -> AbstractContextManager:
        """Where the next caches start behind another sequence holding ``tokens`` in one unified cache, idle;
        ``removed``: that sequence decoded, then removed before anything else runs."""
        raise ModelError(f"the {self.environment.engine} engine cannot place a cache behind another sequence")

    def batch_forward(self, batch: object | None, rows: list[list[int]]) -> tuple[object, torch.Tensor]:
        """Feed several sequences in one call, each row's tokens after what ``batch`` holds for it (None: an
        empty batch; rows of unequal length are left-padded); the batch and the float32 logits [rows, vocab]
        of each row's last position."""
        raise ModelError(f"the {self.environment.engine} engine cannot run a batch of sequences")

    def batch_of(self, states: list[KVState]) -> object:
        """A batch holding a copy of each state, one row each."""
        raise ModelError(f"the {self.environment.engine} engine cannot run a batch of sequences")

    def batch_row(self, batch: object, row: int) -> KVState:
        """One row of a batch as its own cache, less the padding."""
        raise ModelError(f"the {self.environment.engine} engine cannot run a batch of sequences")
