"""bench/server_vs_binding.py's verdict comparison: per E6 level, each engine's verdict item by item from its own
cells, and where they part. Known answers: rows built so each item's verdict is known."""

from __future__ import annotations

from workflow_helpers import bench_script

server_vs_binding = bench_script("server_vs_binding")

REFERENCE = "ref"


def _rows(level: str, items: dict[str, tuple[str, str, str]], run: int = 0) -> dict[tuple, dict]:
    """Factor rows keyed as the script keys them: each item's (test-ref, ref-test, test-test) suffixes."""
    rows = {}
    for item, suffixes in items.items():
        for cell, suffix in zip(("test-ref", "ref-test", "test-test"), suffixes):
            rows[("fp16", "batch", level, cell, run, item)] = {
                "applicable": True,
                "reference_suffix": REFERENCE,
                "suffix_object": suffix,
            }
    return rows


def test_verdicts_are_compared_item_by_item_with_each_disagreement_named():
    server = _rows("2", {"a": ("x", REFERENCE, "x"), "b": (REFERENCE, "y", "y"), "c": (REFERENCE,) * 3})
    binding = _rows("2", {"a": ("x", REFERENCE, "x"), "b": (REFERENCE,) * 3, "c": ("x", REFERENCE, REFERENCE)})
    assert server_vs_binding.compare_verdicts(server, binding) == [
        "  batch 2 (fp16): served differently A 2/3, B 1/3; verdicts agree on 1/3 (none → latent 1, read → none 1)"
    ]
    # A second run under load on the server has no twin on the binding (whose batch is pinned): each run of one
    # is compared with runs of the same number only.
    later = _rows("2", {"a": (REFERENCE,) * 3}, run=1)
    assert server_vs_binding.compare_verdicts({**server, **later}, binding) == server_vs_binding.compare_verdicts(
        server, binding
    )
    assert server_vs_binding.compare_verdicts({**server, **later}, {**binding, **later})[1].startswith(
        "  batch 2 run 1 (fp16): served differently A 0/1, B 0/1"
    )


def test_only_the_items_in_both_ledgers_are_kept():
    server = _rows("2", {"a": (REFERENCE,) * 3})
    binding = _rows("2", {"a": (REFERENCE,) * 3, "b": ("x", "x", "x")})
    kept_server, kept_binding = server_vs_binding.in_both(server, binding)
    assert kept_server == server and set(kept_binding) == set(server)
