"""llama.cpp's per-sequence state bytes, parsed into a ``KVState`` and written back.

``llama_state_seq_get_data`` returns the KV cache of one sequence in a format
that is llama.cpp's own and changes between releases; this module reads and
writes exactly the format of the pinned binding (``FORMAT``), read from its
``llama_context::state_seq_get_data`` and ``llama_kv_cache::state_write`` /
``state_write_meta`` / ``state_write_data``:

    u32 magic 0xaf143cd8, i32 seq_id                 (the context's header)
    u32 n_stream                                     (1, or with one KV stream per sequence, their count)
    per stream:  u32 cell_count                      (0: the stream is empty, nothing follows)
      per cell:  i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id
                 u32 v_trans, u32 n_layer
      per layer: i32 k_type, u64 k_row_bytes, cell_count rows of K   (a row: kv_heads x head_dim)
      v_trans 0, per layer: i32 v_type, u64 v_row_bytes, cell_count rows of V
      v_trans 1, per layer: i32 v_type, u32 v_element_bytes, u32 n_embd_v_gqa,
                 n_embd_v_gqa rows of cell_count elements (V transposed: flash attention off)

A row of a quantized type (q8_0, q4_0) is ggml blocks of 32 values; a head's values are whole blocks
(head sizes are multiples of 32), so each head's blocks are kept as raw bytes per cell (``quantized``).
The bytes do not say whether llama.cpp rotated the values before quantizing them: the context that
wrote them does, so the caller gives the rotation and it is named in the parts' block format.

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

from stagereplay.engines.llamacpp.cache_types import CACHE_TYPES, QUANTIZED, cache_types
from stagereplay.ledger.block_format import BlockFormat
from stagereplay.ledger.blocks import numeric, part_codec
from stagereplay.ledger.kvstate import KVState

FORMAT = "llama-cpp-python 0.3.36"
CACHE_TYPE_IDS = {name: type_id for name, (type_id, _, _, _) in CACHE_TYPES.items()}
_TYPE_NAMES = {type_id: name for name, type_id in CACHE_TYPE_IDS.items()}
# The element of each cache type as numpy reads a row: plain values, or raw block bytes.
_ELEMENT = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2"), "q8_0": np.dtype("u1"), "q4_0": np.dtype("u1")}
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
    cache_type: str  # the precision: "fp16", "q8_0", or K's and V's type ("q8_0-fp16")
    # The context's KV streams and the one holding the sequence: 1 and 0 in a single-sequence context or a unified
    # cache; without a unified cache (kv_unified off) one stream per sequence, the others empty in its state.
    streams: int = 1
    stream: int = 0


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


def _tensor_type(reader: _Reader, what: str) -> str:
    type_id = reader.take("<i", f"{what} type")
    if type_id not in _TYPE_NAMES:
        raise _refuse(f"{what} has ggml type {type_id}; the cache types read are {', '.join(CACHE_TYPE_IDS)}")
    return _TYPE_NAMES[type_id]


def part_format(cache_type: str, rotation: int) -> str:
    """How a part of this cache type is kept: plain values (""), or its block format with the rotation."""
    return BlockFormat(cache_type, rotation).name if cache_type in QUANTIZED else ""


def _precision(k_type: str, v_type: str) -> str:
    return k_type if k_type == v_type else f"{k_type}-{v_type}"


def _expect(found: int, expected: int, what: str) -> None:
    if found != expected:
        raise _refuse(f"{what} is {found}, the model's geometry gives {expected}")


def parse_seq_state(data: bytes, geometry: Geometry, rotation: tuple[int, int] = (0, 0)) -> SeqState:
    """The per-layer K and V of one sequence's state, each [1, kv_heads, positions, head_dim] (values) or
    [1, kv_heads, positions, head bytes] (raw blocks). ``rotation``: the Hadamard size llama.cpp rotated a
    quantized K and V by in the context that wrote ``data`` (0: not rotated)."""
    reader = _Reader(data)
    magic = reader.take("<I", "the header")
    if magic != MAGIC:
        raise _refuse(f"the header is {magic:#010x}, not the magic {MAGIC:#010x}")
    header_seq_id = reader.take("<i", "the header's sequence id")
    n_stream = reader.take("<I", "the stream count")
    if n_stream < 1:
        raise _refuse("the state has no KV stream")
    # One stream holds the sequence's cells; every other (one per sequence, without a unified cache) is empty.
    stream, cells = 0, 0
    while stream < n_stream and (cells := reader.take("<I", f"stream {stream}'s cell count")) == 0:
        stream += 1
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
    heads = geometry.n_head_kv

    def rows(part: str, head_dim: int, what: str) -> tuple[str, np.ndarray]:
        """One layer's cells of K or V (one row per cell): [kv_heads, cells, head values or head bytes]."""
        cache_type = _tensor_type(reader, what)
        types = cache_types(cache_type)
        row_bytes = types.row_bytes(part, heads * head_dim)
        _expect(reader.take("<Q", f"{what} row size"), row_bytes, f"{what} row size")
        element = _ELEMENT[cache_type]
        array = reader.array(element, cells * row_bytes // element.itemsize, what)
        return cache_type, array.reshape(cells, heads, -1).transpose(1, 0, 2)

    keys, values, k_types, v_types = [], [], set(), set()
    for layer in range(geometry.n_layer):
        cache_type, key = rows("k", geometry.head_dim_k, f"layer {layer}'s K")
        k_types.add(cache_type)
        keys.append(key)
    for layer in range(geometry.n_layer):
        if not v_trans:
            cache_type, value = rows("v", geometry.head_dim_v, f"layer {layer}'s V")
            v_types.add(cache_type)
            values.append(value)
            continue
        cache_type = _tensor_type(reader, f"layer {layer}'s V")
        if cache_type in QUANTIZED:
            raise _refuse(f"layer {layer}'s V is {cache_type} and transposed, which llama.cpp never writes")
        v_types.add(cache_type)
        dtype = _ELEMENT[cache_type]
        element = reader.take("<I", f"layer {layer}'s V element size")
        _expect(element, dtype.itemsize, f"layer {layer}'s V element size")
        v_width = heads * geometry.head_dim_v
        _expect(reader.take("<I", f"layer {layer}'s V width"), v_width, f"layer {layer}'s V width")
        columns = reader.array(dtype, v_width * cells, f"layer {layer}'s V")
        values.append(columns.reshape(heads, geometry.head_dim_v, cells).transpose(0, 2, 1))
    for other in range(stream + 1, n_stream):
        if reader.take("<I", f"stream {other}'s cell count") != 0:
            raise _refuse(f"the sequence has cells in streams {stream} and {other}, one KV stream holds a sequence")
    if reader.offset != len(data):
        raise _refuse(f"{len(data) - reader.offset} bytes follow the last layer's V")
    if len(k_types) != 1 or len(v_types) != 1:
        raise _refuse(f"the layers mix cache types (K {sorted(k_types)}, V {sorted(v_types)})")
    k_type, v_type = k_types.pop(), v_types.pop()

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).unsqueeze(0)

    kv = KVState(
        keys=tuple(tensor(key) for key in keys),
        values=tuple(tensor(value) for value in values),
        key_format=part_format(k_type, rotation[0]),
        value_format=part_format(v_type, rotation[1]),
    )
    return SeqState(
        kv=kv,
        seq_id=seq_ids.pop(),
        v_trans=bool(v_trans),
        cache_type=_precision(k_type, v_type),
        streams=n_stream,
        stream=stream,
    )


def write_seq_state(state: SeqState) -> bytes:
    """The bytes ``llama_state_seq_set_data`` reads back as ``state`` (the inverse of ``parse_seq_state``)."""
    kv = state.kv
    types = cache_types(state.cache_type)
    cells = kv.num_positions
    if types.v in QUANTIZED and state.v_trans:
        raise _refuse(f"a {types.v} V cache cannot be written transposed (llama.cpp quantizes V only untransposed)")
    for part, (cache_type, block_format) in {"K": (types.k, kv.key_format), "V": (types.v, kv.value_format)}.items():
        stored = BlockFormat.parse(block_format).cache_type if block_format else None
        if stored != (cache_type if cache_type in QUANTIZED else None):
            raise _refuse(
                f"a {part} part stored as {block_format or 'values'} cannot go into a {cache_type} cache unconverted"
            )

    def host(tensor: torch.Tensor, cache_type: str) -> np.ndarray:
        array = tensor.detach().cpu()[0].numpy()  # [kv_heads, positions, head values or bytes]
        if array.dtype != _ELEMENT[cache_type]:
            raise _refuse(f"a {array.dtype} tensor cannot go into a {cache_type} cache unconverted")
        return array

    def row_major(tensor: torch.Tensor, cache_type: str) -> list:
        rows = host(tensor, cache_type).transpose(1, 0, 2)  # [positions, kv_heads, ...]: one cell per row
        row_bytes = rows[0].size * rows.dtype.itemsize
        return [struct.pack("<iQ", CACHE_TYPE_IDS[cache_type], row_bytes), np.ascontiguousarray(rows).tobytes()]

    if not 0 <= state.stream < state.streams:
        raise _refuse(f"stream {state.stream} is not one of the context's {state.streams}")
    parts = [struct.pack("<IiI", MAGIC, state.seq_id, state.streams)]
    parts += [struct.pack("<I", 0)] * state.stream + [struct.pack("<I", cells)]
    parts += [struct.pack("<iIi", cell, 1, state.seq_id) for cell in range(cells)]
    parts.append(struct.pack("<II", int(state.v_trans), kv.num_layers))
    for key in kv.keys:
        parts += row_major(key, types.k)
    for value in kv.values:
        if not state.v_trans:
            parts += row_major(value, types.v)
            continue
        columns = host(value, types.v).transpose(0, 2, 1)  # [kv_heads, head_dim, positions]: a row per V element
        parts += [
            struct.pack("<iII", CACHE_TYPE_IDS[types.v], columns.dtype.itemsize, columns.shape[0] * columns.shape[1]),
            np.ascontiguousarray(columns).tobytes(),
        ]
    parts += [struct.pack("<I", 0)] * (state.streams - state.stream - 1)
    return b"".join(parts)


def plain_dtype(cache_type: str) -> torch.dtype:
    """The torch dtype of a cache type's values (uint8: a block format's bytes)."""
    return {"fp16": torch.float16, "fp32": torch.float32}.get(cache_type, torch.uint8)


def converted_state(state: KVState, cache_type: str, formats: tuple[str, str]) -> KVState:
    """``state`` (in CPU memory) as a cache of ``cache_type`` stored as ``formats`` (K's, V's) keeps it: values
    quantized offline (rotated first where the format rotates) by gguf's reference quantizer, or blocks
    dequantized (un-rotated) and rounded to fp16/fp32; as it is where it is stored so already. The binding's
    and the server's engines both convert through here."""
    types = cache_types(cache_type)
    dtypes = (state.keys[0].dtype, state.values[0].dtype)
    if state.formats == formats and dtypes == (plain_dtype(types.k), plain_dtype(types.v)):
        return state
    values = numeric(state)

    def part(tensors, part_type, part_format):
        codec = part_codec(part_format, plain_dtype(part_type))
        return tuple(codec.stored_of(tensor) for tensor in tensors)

    key_format, value_format = formats
    return KVState(
        part(values.keys, types.k, key_format),
        part(values.values, types.v, value_format),
        key_format,
        value_format,
    )
