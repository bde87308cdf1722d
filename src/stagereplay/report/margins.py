"""summary.json's figures of the logits at a flip: the reference's margin at the first divergent step against
the scale of its top logit (E1 and E6), and E6's first read per factor level. ``report.summary`` calls these;
like it, they only count rows.

One bf16 step at the magnitude of a logit x is 2**(floor(log2|x|) - 7): bf16 keeps 7 fraction bits, so that is
the gap between x and its bf16 neighbours. Where the logits are bf16 values (``bf16_logits``), a flip whose
reference margin is at most one step was a tie, or a lead of one last bit of the top logit: any perturbation
that reaches that bit can flip it. Where they are not (llama.cpp's are float32, whatever its cache type), the
same number is no rounding step, only a scale: the margin is at most |top|/128, |top| rounded down to a power of
two. The two are kept under different names so that a float32 count is never read as a last-bit tie.
"""

from __future__ import annotations

import math
import statistics

from stagereplay.design.cells import READ, cell_label
from stagereplay.engines.spec import EngineSpec
from stagereplay.report.stats import share

BF16_FRACTION_BITS = 7


def bf16_logits(engine: EngineSpec | None, precision: str | None) -> bool:
    """Whether a run's logits are bf16 values: only where its precision is the model's weight dtype (the logits
    come out of a model computed in it) and that dtype is bf16. An engine whose precision names its KV-cache
    type (llama.cpp) computes float32 logits whatever the cache."""
    return engine is not None and engine.precision_kind == "weight dtype" and precision == "bf16"


def bf16_step(top: float) -> float:
    """One bf16 ulp at the magnitude of ``top``: 2**(floor(log2|top|) - 7); 0 for a top logit of 0, which has no
    binade (only a tie is within a step of it)."""
    if top == 0:
        return 0.0
    _, exponent = math.frexp(abs(top))  # |top| = m * 2**exponent with m in [0.5, 1): floor(log2|top|) = exponent - 1
    return math.ldexp(1.0, exponent - 1 - BF16_FRACTION_BITS)


def within_one_bf16_step(margin: float, top: float) -> bool:
    return margin <= bf16_step(top)


def one_bf16_step_at_most_for_some_top(margin: float) -> bool:
    """Whether a margin between two bf16 logits is at most one step of the larger for some top logit. Both lie on
    the bf16 grid, so within one step of the top their difference is one step of its binade, or one or two
    steps of the binade below (when the runner-up lies just under a power of two): 0 or a power of two, never
    anything else. E1 keeps no top logit, so this is what bounds its count."""
    return margin == 0 or math.frexp(margin)[0] == 0.5


def e1_flip_margins(pairs: list[dict], bf16: bool) -> dict:
    """E1's flips (items whose suffixes differ) by the prefill side's margin at the first divergent step (the
    prefill row is the reference E6 starts from). E1's rows keep no top logit, so the step there is unknown:
    ties are counted exactly, and on bf16 logits (``bf16``) the margins that could be one step at most (0 or a
    power of two) give an upper bound; other logits are not on the bf16 grid and there is no bound."""
    margins = [
        row["b_margin_at_divergence"]
        for row in pairs
        if row["suffix_differs"] and row["b_margin_at_divergence"] is not None
    ]
    n = len(margins)
    return {
        "side": "prefill",
        "flips": n,
        "tie": share(sum(margin == 0 for margin in margins), n),
        "one_bf16_step_at_most": (
            share(sum(one_bf16_step_at_most_for_some_top(margin) for margin in margins), n) if bf16 else None
        ),
    }


def e6_flip_margins(served: list[dict], bf16: bool) -> dict:
    """One level's served flips (its served cell's rows whose suffix differs from the reference's; one per item)
    by the reference's margin at the first divergent step, against the scale of the reference's top logit
    there: one bf16 step on bf16 logits (``within_one_bf16_step``), the same number named for what it is on
    other logits (``within_top_over_128``). Counted per level only: levels repeat items, and some repeat the
    very same flips (the item batched with itself at several sizes; a slot restored with the prompt's cache),
    so a count pooled over levels would count one flip several times."""
    flips = [
        (row["reference_margin_at_divergence"], row["reference_top_logit_at_divergence"])
        for row in served
        if row["first_divergence"] is not None and row["reference_margin_at_divergence"] is not None
    ]
    # An engine that returns log-probabilities (llama-server) gives margins (a difference of two log-probabilities
    # of one softmax is the logits' difference) but no top logit: those flips have ties and margins, no scale.
    scaled = [(margin, top) for margin, top in flips if top is not None]
    n = len(flips)
    within = share(sum(within_one_bf16_step(margin, top) for margin, top in scaled), len(scaled)) if scaled else None
    return {
        "flips": n,
        "bf16_logits": bf16,
        "tie": share(sum(margin == 0 for margin, _ in flips), n),
        "median_margin": statistics.median(margin for margin, _ in flips) if flips else None,  # logit units
        ("within_one_bf16_step" if bf16 else "within_top_over_128"): within,
    }


def first_read_figures(rows: list[dict], cells: tuple) -> dict | None:
    """A level's first read: ref-test's first logits (the reference cache's bytes read under the level) against
    the reference's (read under the reference), per item that decoded anything: bit-identical x/N, argmax the
    same x/N, and the largest |difference|. ``converted``: the reference cache was converted for the level's
    reader (cache_type), so this is the conversion and the read together. None for a level without ref-test (a
    build-only factor reads as the reference by construction; a server-only one has no one-sided cell)."""
    if READ not in cells:
        return None
    read = [row for row in rows if row["cell"] == cell_label(READ) and row["first_logits_identical"] is not None]
    n = len(read)
    return {
        "cell": cell_label(READ),
        "converted": any(row["converted_digest"] is not None for row in read),
        "logits_identical": share(sum(row["first_logits_identical"] for row in read), n),
        "argmax_same": share(sum(row["first_argmax_same"] for row in read), n),
        "max_abs_difference": max((row["first_logits_max_abs"] for row in read), default=0.0),
    }
