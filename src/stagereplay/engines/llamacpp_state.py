"""llama.cpp's per-sequence state bytes, parsed into a ``KVState`` and written back.

``llama_state_seq_get_data`` returns the KV cache of one sequence in a format
that is llama.cpp's own and changes between releases; this module reads and
writes exactly the format of the pinned binding (``FORMAT``), read from its
``llama_context::state_seq_get_data`` and ``llama_kv_cache::state_write`` /
``state_write_meta`` / ``state_write_data``:

    u32 magic 0xaf143cd8, i32 seq_id                 (the context's header)
    u32 n_stream
    per stream:  u32 cell_count                      (0: the stream is empty, nothing follows)
      per cell:  i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id
                 u32 v_trans, u32 n_layer
      per layer: i32 k_type, u64 k_row_bytes, cell_count rows of K   (a row: kv_heads x head_dim)
      v_trans 0, per layer: i32 v_type, u64 v_row_bytes, cell_count rows of V
      v_trans 1, per layer: i32 v_type, u32 v_element_bytes, u32 n_embd_v_gqa,
                 n_embd_v_gqa rows of cell_count elements (V transposed: flash attention off)

Every length and type field is checked against the model's geometry and the
bytes must be consumed exactly; anything else is refused with one line naming
the pinned version, because a misread state would be a silently wrong cache.
Cells are kept only for a single sequence holding positions 0..n-1 in order
(what one sequence decoded from an empty cache holds), so cell i is position i.
Architectures whose cells carry extra fields (M-RoPE, per-layer embeddings)
are refused by the engine before a state is ever read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from stagereplay.ledger.kvstate import KVState

FORMAT = "llama-cpp-python 0.3.36"
# ggml_type ids (ggml.h) of the cache types stage replay reads: the f32 and f16 caches.
GGML_TYPES: dict[int, tuple[str, np.dtype]] = {0: ("f32", np.dtype("<f4")), 1: ("f16", np.dtype("<f2"))}
CACHE_TYPE_IDS = {"fp32": 0, "fp16": 1}
MAGIC = 0xAF143CD8  # llama_context's io_magic: the first four bytes of every sequence state


class LlamaStateError(ValueError):
    """One-line message naming the problem, the pinned format and the fix."""


def _refuse(problem: str) -> LlamaStateError:
    return LlamaStateError(
        f"llama.cpp sequence state: {problem} — stagereplay parses the state format of {FORMAT} only; install that version (pip install -e .[llamacpp])"
    )


@dataclass(frozen=True)
class Geometry:
    """What the model says a state must hold; every field of the bytes is checked against it."""

    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int


@dataclass(frozen=True)
class SeqState:
    """A parsed sequence state: the cache, and the two fields needed to write the same bytes back."""

    kv: KVState
    seq_id: int
    v_trans: bool
    cache_type: str  # "fp16" or "fp32"


class _Reader:
    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.offset = 0

    def take(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise _refuse(f"ends at byte {len(self.data)} inside {what}")
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += size
        return value

    def array(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
        size = dtype.itemsize * count
        if self.offset + size > len(self.data):
            raise _refuse(f"ends at byte {len(self.data)} inside {what} ({size} bytes expected)")
        values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.offset).copy()
        self.offset += size
        return values


def _tensor_type(reader: _Reader, what: str) -> tuple[str, np.dtype]:
    type_id = reader.take("<i", f"{what} type")
    if type_id not in GGML_TYPES:
        raise _refuse(f"{what} has ggml type {type_id}; only f32 (0) and f16 (1) caches are read")
    return GGML_TYPES[type_id]


def _expect(found: int, expected: int, what: str) -> None:
    if found != expected:
        raise _refuse(f"{what} is {found}, the model's geometry gives {expected}")


def parse_seq_state(data: bytes, geometry: Geometry) -> SeqState:
    """The per-layer K and V of one sequence's state, each [1, kv_heads, positions, head_dim]."""
    reader = _Reader(data)
    magic = reader.take("<I", "the header")
    if magic != MAGIC:
        raise _refuse(f"the header is {magic:#010x}, not the magic {MAGIC:#010x}")
    header_seq_id = reader.take("<i", "the header's sequence id")
    n_stream = reader.take("<I", "the stream count")
    _expect(n_stream, 1, "the stream count")  # one sequence in a unified cache: one stream
    cells = reader.take("<I", "the cell count")
    if cells == 0:
        raise _refuse("the sequence holds no cells (an empty cache has no boundary to read)")
    seq_ids = set()
    for cell in range(cells):
        position = reader.take("<i", f"cell {cell}'s position")
        _expect(position, cell, f"cell {cell}'s position")
        n_seq_id = reader.take("<I", f"cell {cell}'s sequence count")
        _expect(n_seq_id, 1, f"cell {cell}'s sequence count")
        seq_ids.add(reader.take("<i", f"cell {cell}'s sequence id"))
    if seq_ids != {header_seq_id}:
        raise _refuse(f"the cells name sequences {sorted(seq_ids)}, the header sequence {header_seq_id}")
    v_trans = reader.take("<I", "the v_trans flag")
    if v_trans not in (0, 1):
        raise _refuse(f"the v_trans flag is {v_trans}, not 0 or 1")
    _expect(reader.take("<I", "the layer count"), geometry.n_layer, "the layer count")
    k_width = geometry.n_head_kv * geometry.head_dim_k
    v_width = geometry.n_head_kv * geometry.head_dim_v
    keys, values, types = [], [], set()
    for layer in range(geometry.n_layer):
        name, dtype = _tensor_type(reader, f"layer {layer}'s K")
        types.add(name)
        _expect(
            reader.take("<Q", f"layer {layer}'s K row size"), k_width * dtype.itemsize, f"layer {layer}'s K row size"
        )
        rows = reader.array(dtype, cells * k_width, f"layer {layer}'s K")
        keys.append(rows.reshape(cells, geometry.n_head_kv, geometry.head_dim_k).transpose(1, 0, 2))
    for layer in range(geometry.n_layer):
        name, dtype = _tensor_type(reader, f"layer {layer}'s V")
        types.add(name)
        if v_trans:
            element = reader.take("<I", f"layer {layer}'s V element size")
            _expect(element, dtype.itemsize, f"layer {layer}'s V element size")
            _expect(reader.take("<I", f"layer {layer}'s V width"), v_width, f"layer {layer}'s V width")
            columns = reader.array(dtype, v_width * cells, f"layer {layer}'s V")
            values.append(columns.reshape(geometry.n_head_kv, geometry.head_dim_v, cells).transpose(0, 2, 1))
        else:
            row_bytes = reader.take("<Q", f"layer {layer}'s V row size")
            _expect(row_bytes, v_width * dtype.itemsize, f"layer {layer}'s V row size")
            rows = reader.array(dtype, cells * v_width, f"layer {layer}'s V")
            values.append(rows.reshape(cells, geometry.n_head_kv, geometry.head_dim_v).transpose(1, 0, 2))
    if reader.offset != len(data):
        raise _refuse(f"{len(data) - reader.offset} bytes follow the last layer's V")
    if len(types) != 1:
        raise _refuse(f"the layers mix cache types {sorted(types)}")
    cache_type = {"f32": "fp32", "f16": "fp16"}[types.pop()]

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).unsqueeze(0)

    kv = KVState(keys=tuple(tensor(key) for key in keys), values=tuple(tensor(value) for value in values))
    return SeqState(kv=kv, seq_id=seq_ids.pop(), v_trans=bool(v_trans), cache_type=cache_type)


def write_seq_state(state: SeqState) -> bytes:
    """The bytes ``llama_state_seq_set_data`` reads back as ``state`` (the inverse of ``parse_seq_state``)."""
    kv = state.kv
    if state.cache_type not in CACHE_TYPE_IDS:
        raise _refuse(f"cache type {state.cache_type!r} cannot be written; use fp16 or fp32")
    type_id = CACHE_TYPE_IDS[state.cache_type]
    dtype = GGML_TYPES[type_id][1]
    cells = kv.num_positions

    def host(tensor: torch.Tensor) -> np.ndarray:
        array = tensor.detach().cpu()[0].numpy()  # [kv_heads, positions, head_dim]
        if array.dtype != dtype:
            raise _refuse(f"a {array.dtype} tensor cannot go into a {state.cache_type} cache unconverted")
        return array

    parts = [struct.pack("<IiII", MAGIC, state.seq_id, 1, cells)]
    parts += [struct.pack("<iIi", cell, 1, state.seq_id) for cell in range(cells)]
    parts.append(struct.pack("<II", int(state.v_trans), kv.num_layers))
    for key in kv.keys:
        rows = host(key).transpose(1, 0, 2)  # [positions, kv_heads, head_dim]: one cell per row
        parts += [struct.pack("<iQ", type_id, rows[0].size * dtype.itemsize), np.ascontiguousarray(rows).tobytes()]
    for value in kv.values:
        array = host(value)
        if state.v_trans:
            columns = array.transpose(0, 2, 1)  # [kv_heads, head_dim, positions]: one row per V element
            parts += [
                struct.pack("<iII", type_id, dtype.itemsize, columns.shape[0] * columns.shape[1]),
                np.ascontiguousarray(columns).tobytes(),
            ]
        else:
            rows = array.transpose(1, 0, 2)
            parts += [struct.pack("<iQ", type_id, rows[0].size * dtype.itemsize), np.ascontiguousarray(rows).tobytes()]
    return b"".join(parts)
