"""What an E6 cell's logits say against the reference's (``factor_job`` records them on every cell row).

**The first read**: the logits a cell chooses its first token from, against the reference's logits for the
same pending token. On ref-test both read the reference cache's bytes, one under the test level and one under
the reference, so this is the read of the boundary cache alone, before any decoded token can differ.

**The margins at divergence**: at the first step where a cell's suffix leaves the reference's, the top-1
minus top-2 logit of each, and the reference's top-1 logit, whose binade sets one bf16 step there
(``report.margins``). E2's row keeps the reference's tokens and margins but not its logits, so the job
replays the reference read as far as the last step where a cell diverges (``factor_job.replay_reference``).
"""

from __future__ import annotations

import torch

from stagereplay.experiments.decode import Decoded

NOT_DECODED = {"first_logits_identical": None, "first_argmax_same": None, "first_logits_max_abs": None}
NOT_DIVERGED = {
    "margin_at_divergence": None,
    "reference_margin_at_divergence": None,
    "reference_top_logit_at_divergence": None,
}


def first_read(cell: torch.Tensor | None, reference: torch.Tensor | None) -> dict:
    """Step 0 of a cell against the reference's: bit-identical logits, the same argmax (lowest index on a
    tie, as the decoder chooses), and the largest |difference|. Null where nothing was decoded (the stage
    ended the answer)."""
    if cell is None or reference is None:
        return dict(NOT_DECODED)
    # Equal infinities subtract to nan: they are no difference.
    difference = torch.where(cell == reference, 0.0, (cell - reference).abs())
    return {
        "first_logits_identical": torch.equal(cell, reference),
        "first_argmax_same": int(torch.argmax(cell)) == int(torch.argmax(reference)),
        "first_logits_max_abs": float(difference.max()),
    }


def margins_at_divergence(
    divergence: int | None, cell: Decoded, reference_margins: list[float], replayed: Decoded
) -> dict:
    """At the cell's first divergent step: its margin, the reference's (from E2's row) and the reference's top-1
    logit (from the replay). Null where the cell does not diverge."""
    if divergence is None:
        return dict(NOT_DIVERGED)
    return {
        "margin_at_divergence": _at(cell.margins, divergence),
        "reference_margin_at_divergence": _at(reference_margins, divergence),
        "reference_top_logit_at_divergence": _at(replayed.top_logits, divergence),
    }


def _at(values, index: int):
    return float(values[index]) if index < len(values) else None
