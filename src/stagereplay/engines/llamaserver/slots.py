"""llama-server's slot files: read into the project's parsed state, written from one (a restore takes both).

A slot file is llama_state_seq_save_file's: "ggsq", version 3, a count of 32-bit words and the words (the
server's packed tokens: -1, version 1, the token count and ids, a count of media chunks; or a plain token
list, which the server also restores), then the sequence state without its in-memory header (the magic
and the sequence id that ``llama_state_seq_get_data`` writes first). No torch until a file is read.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagereplay.engines.llamacpp.state import Geometry, SeqState

SLOT_FILE_MAGIC = 0x67677371  # "ggsq": llama_state_seq_save_file's header
SLOT_FILE_VERSION = 3
TOKENS_STATE_VERSION = 1  # the server's packed token list (server_tokens::serialize)


def read_slot_file(path: str | Path, geometry: Geometry, slot: int = 0, rotation=(0, 0)) -> tuple[list[int], SeqState]:
    """The tokens and the parsed cache of a slot file the server saved (``/slots/N?action=save``).

    The file is llama_state_seq_save_file's: "ggsq", version 3, a count of 32-bit words and the words (the
    server's packed tokens: -1, version 1, the token count and ids, a count of media chunks), then the
    sequence state without its in-memory header; that header (magic and the slot's sequence id) is put
    back and the state goes through the project's parser, whose one-line error a damaged file gets.
    """
    from stagereplay.engines.llamacpp.state import MAGIC, LlamaStateError, parse_seq_state

    data = Path(path).read_bytes()

    def refuse(problem: str) -> LlamaStateError:
        return LlamaStateError(f"llama-server slot file {path}: {problem} — save the slot again with this llama-server")

    if len(data) < 12:
        raise refuse(f"ends at byte {len(data)} inside its header")
    magic, version, words = struct.unpack_from("<III", data)
    if magic != SLOT_FILE_MAGIC or version != SLOT_FILE_VERSION:
        raise refuse(f"header {magic:#010x} version {version}, not {SLOT_FILE_MAGIC:#010x} version {SLOT_FILE_VERSION}")
    end = 12 + 4 * words
    if len(data) < end:
        raise refuse(f"ends at byte {len(data)} inside its {words} token words")
    packed = list(struct.unpack_from(f"<{words}i", data, 12))
    if packed and packed[0] == -1:
        if len(packed) < 3 or packed[1] != TOKENS_STATE_VERSION or len(packed) < 3 + packed[2] + 1:
            raise refuse(f"its packed tokens are not version {TOKENS_STATE_VERSION} of the server's token list")
        tokens = packed[3 : 3 + packed[2]]
        if packed[3 + packed[2]] != 0:
            raise refuse("it holds media chunks, which stagereplay does not read")
    else:
        tokens = packed  # a plain token list, as older servers wrote
    state = parse_seq_state(struct.pack("<Ii", MAGIC, slot) + data[end:], geometry, rotation)
    return tokens, state


def write_slot_file(path: str | Path, state: SeqState, tokens: list[int]) -> int:
    """Write ``state`` as a slot file the server restores (``/slots/N?action=save``'s layout with a plain token
    list, which the server reads as its older writers wrote it); the file's bytes.

    The tokens are only the slot's record of what its cells hold, for matching the next request's prompt;
    the cells themselves (positions, K and V) are the state's. The sequence id the state's header names is
    dropped with the header: a restore gives the cells the slot's own.
    """
    from stagereplay.engines.llamacpp.state import write_seq_state

    body = write_seq_state(state)[8:]
    data = struct.pack(f"<III{len(tokens)}i", SLOT_FILE_MAGIC, SLOT_FILE_VERSION, len(tokens), *tokens) + body
    Path(path).write_bytes(data)
    return len(data)


def gguf_geometry(path: str | Path) -> Geometry:
    """What a GGUF's metadata says its sequence states hold, for ``read_slot_file`` (no llama.cpp needed)."""
    from gguf import GGUFReader

    from stagereplay.engines.llamacpp.state import Geometry

    fields = GGUFReader(path).fields

    def value(key: str):
        return fields[key].contents() if key in fields else None

    arch = value("general.architecture")
    heads = int(value(f"{arch}.attention.head_count"))
    width = int(value(f"{arch}.embedding_length"))
    return Geometry(
        n_layer=int(value(f"{arch}.block_count")),
        n_head_kv=int(value(f"{arch}.attention.head_count_kv") or heads),
        head_dim_k=int(value(f"{arch}.attention.key_length") or width // heads),
        head_dim_v=int(value(f"{arch}.attention.value_length") or width // heads),
    )
