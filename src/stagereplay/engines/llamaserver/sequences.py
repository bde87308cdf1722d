"""The llamaserver engine's own prefix reuse (E6's ``prefix_reuse`` through ``HeldPrefix``): the slot's prompt
cache and its save and restore, as the binding engine's ``truncate``, ``save_sequence`` and ``load_sequence``
do them with llama.cpp's calls.

``truncate`` drops nothing at once: the server drops a slot's cells only when the next request arrives (it
keeps the longest common prefix of the slot's tokens and the new prompt, ``llama_memory_seq_rm`` on the
rest, then decodes only the new tokens). So the cache records the slot's real tokens (``slot_tokens``) until
then, the next request's prompt is the kept tokens and the new ones, and the engine's check of the answer's
``timings`` (``cache_n`` kept, ``prompt_n`` decoded) says the server kept exactly the truncated length. A
snapshot in between saves the slot and keeps its first cells only: the bytes the kept cells hold, which a
removal does not touch. ``save_sequence`` and ``load_sequence`` are the server's slot save and restore
(``/slots/0?action=save|restore``), the file moved to and from the caller's path.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stagereplay.engines.llamaserver.build import LlamaServerError
from stagereplay.engines.llamaserver.slots import read_slot_file
from stagereplay.ledger.kvstate import KVState

SLOT = 0


def kept_positions(state: KVState, positions: int) -> KVState:
    """The first ``positions`` cells of a parsed slot."""
    return state.replace(
        (key[..., :positions, :].contiguous() for key in state.keys),
        (value[..., :positions, :].contiguous() for value in state.values),
    )


class SlotSequences:
    """``truncate``, ``save_sequence`` and ``load_sequence`` on the engine's slot (mixed into the engine)."""

    slot = SLOT  # the slot the engine's requests go to (an attached server's may be another)

    def slot_file_name(self, kind: str) -> str:
        """A new slot file's name, this process's: an attached server's slot folder is shared with others."""
        self.saved += 1
        return f"stagereplay-{os.getpid()}-{kind}-{self.saved}.bin"

    def truncate(self, cache, positions: int) -> None:
        """Keep the first ``positions`` of the slot for the next request (the server drops the rest then)."""
        self._check(cache)
        if not 0 <= positions <= len(cache.tokens):
            raise LlamaServerError(f"cannot keep {positions} positions of a slot holding {len(cache.tokens)}")
        if cache.slot_tokens is None:
            cache.slot_tokens = list(cache.tokens)
        cache.tokens = cache.tokens[:positions]

    def save_sequence(self, cache, path: str | Path, tokens: list[int]) -> int:
        """The slot saved by the server with its tokens (which must be ``tokens``), moved to ``path``; its bytes."""
        self._check(cache)
        if cache.slot_tokens is not None or list(tokens) != cache.tokens:
            raise LlamaServerError(
                "the server saves the slot's own tokens and cells: save a slot holding exactly the given tokens"
            )
        name = self.slot_file_name("sequence")
        answer = self.server.save_slot(self.slot, name)
        if answer.get("n_saved") != len(tokens):
            (self.slot_dir / name).unlink(missing_ok=True)
            raise LlamaServerError(f"llama-server saved {answer.get('n_saved')} tokens, the slot holds {len(tokens)}")
        shutil.move(self.slot_dir / name, path)
        return Path(path).stat().st_size

    def load_sequence(self, path: str | Path, capacity: int):
        """The emptied slot restored by the server from a file ``save_sequence`` wrote, with its tokens."""
        cache = self.empty_cache()
        name = self.slot_file_name("sequence")
        shutil.copyfile(path, self.slot_dir / name)
        try:
            tokens, _ = read_slot_file(self.slot_dir / name, self.geometry, self.slot, self.rotation)
            if len(tokens) > capacity:
                raise LlamaServerError(f"the slot file {path} holds {len(tokens)} tokens, more than {capacity}")
            answer = self.server.restore_slot(self.slot, name)
        finally:
            (self.slot_dir / name).unlink(missing_ok=True)
        if answer.get("n_restored") != len(tokens):
            raise LlamaServerError(f"llama-server restored {answer.get('n_restored')} tokens of {len(tokens)}")
        cache.tokens = list(tokens)
        return cache, list(tokens)
