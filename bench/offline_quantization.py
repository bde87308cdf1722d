"""Is a quantized llama.cpp cache just the quantization of what the reference wrote? Layer by layer.

    python bench/offline_quantization.py ledger/factors-llamacpp q8_0

For each item whose E2 prefill cache the ledger stores at the E1 precision (the reference, e.g. fp16) and at
the quantized precision (the native build: the same tokens, one prefill, in a context of that cache type),
the reference is quantized offline as E6's ref-test cell does it (``LlamaCppEngine.converted``: rotated as the
native cache is, then gguf's reference quantizer) and compared with the native build block by block. Prints,
per layer, the share of K and V blocks whose bytes differ, over all items and positions. Layer 0 sees the
same inputs in both, so what differs there is the path (fp16 rounding before quantizing, numpy instead of
ggml); what grows with depth is the quantized write path itself (each layer attends over quantized caches).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq
import torch

from stagereplay.ledger.block_format import BlockFormat
from stagereplay.ledger.blocks import blocks_of
from stagereplay.ledger.kvstate import KVState
from stagereplay.ledger.layout import LedgerLayout
from stagereplay.ledger.store import ObjectStore


def differing_blocks(root: str | Path, precision: str) -> list[dict]:
    ledger = LedgerLayout(root)
    store = ObjectStore(ledger.objects)
    reference_precision = json.loads(Path(ledger.provenance).read_text())["config"]["matched"]["precision"]
    prefill = {
        (row["precision"], row["item_id"]): row["cache_object"]
        for row in pq.read_table(ledger.table("trajectories")).to_pylist()
        if row["construction"] == "prefill" and row["replica"] == 0 and row["prefix_precision"] == reference_precision
    }
    items = sorted(item for kind, item in prefill if kind == precision and (reference_precision, item) in prefill)
    totals: dict[tuple[int, str], list[int]] = {}
    for item in items:
        reference = KVState.from_named_tensors(store.get(prefill[reference_precision, item]))
        native = KVState.from_named_tensors(store.get(prefill[precision, item]))
        for part, plain, stored, block_format in (
            ("K", reference.keys, native.keys, native.key_format),
            ("V", reference.values, native.values, native.value_format),
        ):
            parsed = BlockFormat.parse(block_format)
            block = parsed.block_bytes(32)
            for layer, (values, raw) in enumerate(zip(plain, stored)):
                offline = blocks_of(values, parsed)
                differ = (offline.reshape(-1, block) != raw.reshape(-1, block)).any(dim=1)
                count = totals.setdefault((layer, part), [0, 0])
                count[0] += int(torch.count_nonzero(differ))
                count[1] += differ.numel()
    layers = sorted({layer for layer, _ in totals})
    return [
        {
            "layer": layer,
            "items": len(items),
            "k": totals[layer, "K"][0] / totals[layer, "K"][1],
            "v": totals[layer, "V"][0] / totals[layer, "V"][1],
            "blocks": totals[layer, "K"][1],
        }
        for layer in layers
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "ledger", help="a llama.cpp ledger storing E2 prefill caches at the E1 and a quantized precision"
    )
    parser.add_argument("precision", help="the quantized precision, e.g. q8_0")
    args = parser.parse_args()
    rows = differing_blocks(args.ledger, args.precision)
    if not rows:
        raise SystemExit(f"offline_quantization: {args.ledger} stores no E2 prefill caches at {args.precision}")
    print("| layer | items | K blocks | K blocks differ | V blocks differ |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['layer']} | {row['items']} | {row['blocks']} | {row['k']:.2%} | {row['v']:.2%} |")


if __name__ == "__main__":
    main()
