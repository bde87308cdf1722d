"""Does another precision's divergence sit where the E1 precision's does? E2's incremental-vs-prefill comparison at
each precision, item by item, over the same E1 prefix (summary.json's ``E2.checkpoints.<name>.precision_overlap``).

E3 shows the incremental cache is the live one (bit-exact bridge), so E2's incremental-vs-prefill rows are live vs
prefill at each precision on the same tokens. For the E1 precision and each other one: how many items' caches and
suffixes differ in both, in only one, or in neither, and the first differing layers of the caches that differ in
both. On llama.cpp, where the precision is the cache type, this says whether a quantized cache still differs only
where the fp16 cache differs.
"""

from __future__ import annotations

from collections import Counter


def precision_overlap(e2_rows: list[dict], e1_precision: str) -> list[dict]:
    """Per other precision of one checkpoint's E2, and per caches / suffixes: the items that differ live vs
    prefill in both precisions, in only one, in neither; [] where E2 ran at the E1 precision alone."""
    by_precision: dict[str, dict[str, dict]] = {}
    for row in e2_rows:
        if row["relation"] == "construction" and row["b"].startswith("prefill/"):
            by_precision.setdefault(row["precision"], {})[row["item_id"]] = row
    reference = by_precision.get(e1_precision)
    if reference is None:
        return []
    figures = []
    for precision, items in sorted(by_precision.items()):
        if precision == e1_precision:
            continue
        shared = sorted(set(items) & set(reference))
        for what, differs in (
            ("caches", lambda row: not row["cache_exact"]),
            ("suffixes", lambda row: row["suffix_differs"]),
        ):
            counts = Counter((differs(reference[item]), differs(items[item])) for item in shared)
            layers = Counter(
                f"{reference[item]['first_differing_layer']}/{items[item]['first_differing_layer']}"
                for item in shared
                if what == "caches" and differs(reference[item]) and differs(items[item])
            )
            figures.append(
                {
                    "precision": precision,
                    "what": what,
                    "items": len(shared),
                    "both": counts[True, True],
                    "only_e1_precision": counts[True, False],
                    "only_this_precision": counts[False, True],
                    "neither": counts[False, False],
                    "first_differing_layers_both": dict(sorted(layers.items())),
                }
            )
    return figures
