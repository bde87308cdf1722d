"""The llama.cpp binding's sequences (mixed into ``LlamaCppEngine``): the one it decodes (``LlamaCppCache``), a batch
of several in one context (``LlamaCppBatch``: E6's batch and kv_unified), and a sequence kept for a later request
or saved to and restored from llama.cpp's own files (E6's prefix reuse, as a server's slot does)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from stagereplay.engines.llamacpp.binding import LlamaCppError
from stagereplay.engines.llamacpp.state import write_seq_state
from stagereplay.ledger.kvstate import KVState

SEQ = 0
# The sequence that holds a filler the engine's own sequence sits behind (E6's kv_offset).
FILLER_SEQ = 1


class LlamaCppCache:
    """The engine's one sequence, valid until the engine starts another (a stale cache refuses to run)."""

    def __init__(self, engine: ContextSequences, generation: int):
        self.engine = engine
        self.generation = generation
        self.positions = 0


class LlamaCppBatch:
    """Several sequences of one context (ids 0..n-1), each with its own positions."""

    def __init__(self, engine: ContextSequences, generation: int, positions: list[int]):
        self.engine, self.generation, self.positions = engine, generation, positions


class ContextSequences:
    """``truncate``, ``save_sequence``, ``load_sequence`` and the batch calls on the engine's context."""

    def truncate(self, cache: LlamaCppCache, positions: int) -> None:
        """Keep only the first ``positions`` of the sequence, as a server slot does before a new request."""
        self._check(cache)
        if not self.llama_cpp.llama_memory_seq_rm(self.memory, SEQ, positions, -1):
            raise LlamaCppError(f"llama.cpp refused to drop the positions after {positions}")
        cache.positions = positions

    def save_sequence(self, cache: LlamaCppCache, path: str | Path, tokens: list[int]) -> int:
        """The sequence and its tokens saved to a file by llama.cpp (a server's slot save); the file's bytes."""
        self._check(cache)
        array = (self.llama_cpp.llama_token * len(tokens))(*tokens)
        written = self.llama_cpp.llama_state_seq_save_file(self.context, str(path).encode(), SEQ, array, len(tokens))
        if written == 0:
            raise LlamaCppError(f"llama_state_seq_save_file could not write {path}")
        return written

    def load_sequence(self, path: str | Path, capacity: int) -> tuple[LlamaCppCache, list[int]]:
        """A cache restored from a file ``save_sequence`` wrote (a server's slot restore), with its tokens."""
        cache = self.empty_cache()
        tokens = (self.llama_cpp.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        read = self.llama_cpp.llama_state_seq_load_file(
            self.context, str(path).encode(), SEQ, tokens, capacity, ctypes.byref(count)
        )
        if read == 0:
            raise LlamaCppError(f"llama_state_seq_load_file could not restore {path} into this context")
        cache.positions = count.value
        return cache, list(tokens[: count.value])

    def batch_forward(self, batch: LlamaCppBatch | None, rows: list[list[int]]) -> tuple[LlamaCppBatch, torch.Tensor]:
        """Each row's tokens after what its sequence holds, all in one ``llama_decode`` (sequence i is row i)."""
        if batch is None:
            self._need_sequences(len(rows))
            self.llama_cpp.llama_memory_clear(self.memory, True)
            self.generation += 1
            batch = LlamaCppBatch(self, self.generation, [0] * len(rows))
        self._check(batch)
        if len(rows) != len(batch.positions):
            raise LlamaCppError(f"{len(rows)} rows fed to a batch of {len(batch.positions)} sequences")
        self._decode([(seq, batch.positions[seq], tokens) for seq, tokens in enumerate(rows)])
        ends = np.cumsum([len(tokens) for tokens in rows]) - 1
        for seq, tokens in enumerate(rows):
            batch.positions[seq] += len(tokens)
        return batch, torch.stack([self._logits(int(end)) for end in ends])

    def batch_of(self, states: list[KVState]) -> LlamaCppBatch:
        self._need_sequences(len(states))
        self.llama_cpp.llama_memory_clear(self.memory, True)
        self.generation += 1
        batch = LlamaCppBatch(self, self.generation, [0] * len(states))
        for seq, state in enumerate(states):
            self._set_sequence(write_seq_state(self._seq_state(state, seq)), seq)
            batch.positions[seq] = state.num_positions
        return batch

    def batch_row(self, batch: LlamaCppBatch, row: int) -> KVState:
        self._check(batch)
        return self._parse(self._sequence_bytes(row), batch.positions[row]).kv

    def _need_sequences(self, count: int) -> None:
        if count > self.settings.n_seq_max:
            raise LlamaCppError(
                f"a batch of {count} sequences needs a context of as many (this one holds {self.settings.n_seq_max})"
                " — reconfigure(n_seq_max=...) first"
            )
