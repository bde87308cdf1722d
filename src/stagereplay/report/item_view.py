"""The per-item view: for each item, where and why its live and prefill continuations part.

One record per item and checkpoint, built from the ledger tables (never computed
anew: the first divergence, the margins and the per-layer cache differences are
the comparison row's, the labels the trajectory rows', the outcomes the
transplant rows'), and the checkpoint's vocabulary table (written by the prompts job) to spell the suffix tokens. The HTML
card (render.py) and ``stagereplay show`` lay these records out; neither counts
anything of its own.

Records come in the card's order: by checkpoint as summary.json lists them, then
by first divergent position (earliest first), items whose suffixes agree last.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from stagereplay.design.jobs import trajectory_label
from stagereplay.inputs import items as items_mod

OUTCOMES = ("follows_donor", "follows_recipient", "neither")


@dataclass(frozen=True)
class SideView:
    """One continuation of an item: its label (as the ledger names it), tokens and labels."""

    label: str  # e.g. "live/bf16/rep0"
    tokens: tuple[str, ...]  # each suffix token spelled alone
    margins: tuple[float, ...]  # top-1 minus top-2 logit at each suffix step
    stop: str
    parsed_answer: str | None
    parsed_correct: bool
    readout_answer: str
    readout_correct: bool
    readout_margin: float


@dataclass(frozen=True)
class TransplantView:
    selection: str
    direction: str  # "donor -> recipient"
    subset: str
    outcome: str


@dataclass(frozen=True)
class ItemRecord:
    checkpoint: str
    precision: str
    item_id: str
    question: str
    choices: tuple[str, ...]
    answer: str  # the correct letter
    live: SideView
    prefill: SideView
    first_divergence: int | None  # first differing suffix position; None when the suffixes agree
    cache_exact: bool
    layers_differ: int | None
    k_max_abs: tuple[float, ...]  # per layer, live vs prefill
    v_max_abs: tuple[float, ...]
    k_mean_abs: tuple[float, ...]
    v_mean_abs: tuple[float, ...]
    transplants: tuple[TransplantView, ...]

    @property
    def divergent(self) -> bool:
        return self.first_divergence is not None

    def transplant_outcomes(self) -> str:
        """'3: follows_donor 2, neither 1' (outcomes in a fixed order), or 'none'."""
        if not self.transplants:
            return "none"
        counts = {outcome: sum(t.outcome == outcome for t in self.transplants) for outcome in OUTCOMES}
        named = ", ".join(f"{outcome} {count}" for outcome, count in counts.items() if count)
        return f"{len(self.transplants)}: {named}"

    @property
    def layers(self) -> int:
        return len(self.k_max_abs)

    def sides(self) -> tuple[SideView, SideView]:
        return self.live, self.prefill

    def margins_at_divergence(self) -> tuple[float | None, float | None]:
        return tuple(_at(side.margins, self.first_divergence) for side in self.sides())


def _at(values: tuple, index: int | None):
    return values[index] if index is not None and index < len(values) else None


def spell(vocabulary: dict[int, str], token_ids: list[int]) -> tuple[str, ...]:
    """Each token as the prompts job spelled it from the checkpoint's tokenizer (ledger.text.spelling)."""
    return tuple(vocabulary[token] for token in token_ids)


def _side_view(row: dict, vocabulary: dict[int, str]) -> SideView:
    return SideView(
        label=trajectory_label(row),
        tokens=spell(vocabulary, row["suffix_tokens"]),
        margins=tuple(row["suffix_margins"]),
        stop=row["suffix_stop"],
        parsed_answer=row["answer"],
        parsed_correct=row["correct"],
        readout_answer=row["readout_answer"],
        readout_correct=row["readout_correct"],
        readout_margin=row["readout_margin"],
    )


def item_records(
    checkpoints: list[str],
    items_path: str | Path,
    trajectories: pa.Table,
    comparisons: pa.Table,
    transplants: pa.Table | None,
    vocabularies: dict[str, dict[int, str]],
) -> list[ItemRecord]:
    """One record per E1 live-vs-prefill pair, in the card's order (``checkpoints``: summary.json's order)."""
    items = {item.item_id: item for item in items_mod.load_items(items_path)}
    by_label = {(row["checkpoint"], row["item_id"], trajectory_label(row)): row for row in trajectories.to_pylist()}
    moved: dict[tuple[str, str], list[TransplantView]] = {}
    for row in transplants.to_pylist() if transplants is not None else []:
        moved.setdefault((row["checkpoint"], row["item_id"]), []).append(
            TransplantView(row["selection"], f"{row['donor']} -> {row['recipient']}", row["subset"], row["outcome"])
        )
    records = []
    for pair in comparisons.to_pylist():
        if pair["experiment"] != "E1" or pair["relation"] != "construction":
            continue
        checkpoint, item_id = pair["checkpoint"], pair["item_id"]
        item, vocabulary = items[item_id], vocabularies[checkpoint]
        records.append(
            ItemRecord(
                checkpoint=checkpoint,
                precision=pair["precision"],
                item_id=item_id,
                question=item.question,
                choices=item.choices,
                answer=item.answer,
                live=_side_view(by_label[(checkpoint, item_id, pair["a"])], vocabulary),
                prefill=_side_view(by_label[(checkpoint, item_id, pair["b"])], vocabulary),
                first_divergence=pair["first_divergence"],
                cache_exact=pair["cache_exact"],
                layers_differ=pair["layers_differ"],
                k_max_abs=tuple(pair["k_max_abs"]),
                v_max_abs=tuple(pair["v_max_abs"]),
                k_mean_abs=tuple(pair["k_mean_abs"]),
                v_mean_abs=tuple(pair["v_mean_abs"]),
                transplants=tuple(moved.get((checkpoint, item_id), ())),
            )
        )
    order = {name: index for index, name in enumerate(checkpoints)}
    return sorted(
        records,
        key=lambda r: (
            order.get(r.checkpoint, len(order)),
            r.first_divergence is None,
            r.first_divergence or 0,
            r.item_id,
        ),
    )


def read_vocabularies(paths: dict[str, str | Path]) -> dict[str, dict[int, str]]:
    """Each checkpoint's token spellings from its vocabulary table (no tokenizer, no engine is loaded)."""
    from stagereplay.ledger.tables import read_vocabulary

    return {name: read_vocabulary(path) for name, path in paths.items()}


# --- text, for the terminal and for Markdown ---------------------------------------------


_SHOWN = {"\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(token: str) -> str:
    """A token as a reader can see it: line breaks and tabs as arrows, any other control or separator
    character as its code point (one would break a terminal line or vanish in HTML)."""
    return "".join(
        _SHOWN.get(char, f"‹U+{ord(char):04X}›" if not char.isprintable() and char != " " else char) for char in token
    )


def label_text(side: SideView) -> str:
    parsed = side.parsed_answer or "unparsable"
    return (
        f"parsed {parsed} ({'correct' if side.parsed_correct else 'wrong'}); readout {side.readout_answer}"
        f" ({'correct' if side.readout_correct else 'wrong'}, letter margin {side.readout_margin:.4g})"
    )


def divergence_text(record: ItemRecord) -> str:
    n = max(len(record.live.tokens), len(record.prefill.tokens))
    if not record.divergent:
        return f"suffixes agree: {len(record.live.tokens)}/{len(record.live.tokens)} tokens the same"
    live_margin, prefill_margin = record.margins_at_divergence()
    return (
        f"first divergence at suffix token {record.first_divergence} (of {n}); top-1 minus top-2 logit there:"
        f" live {_number(live_margin)}, prefill {_number(prefill_margin)}"
    )


def cache_text(record: ItemRecord) -> str:
    if record.cache_exact:
        return f"boundary caches bit-exact in all {record.layers} layers"
    return (
        f"boundary caches differ in {record.layers_differ}/{record.layers} layers; max |Δ| over layers"
        f" K {max(record.k_max_abs, default=0):.3g}, V {max(record.v_max_abs, default=0):.3g}"
    )


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def marked_suffix(side: SideView, at: int | None, mark: tuple[str, str] = ("⟦", "⟧")) -> str:
    """The suffix as text, the token at ``at`` wrapped in ``mark``."""
    return "".join(
        f"{mark[0]}{visible(token)}{mark[1]}" if index == at else visible(token)
        for index, token in enumerate(side.tokens)
    )


def show_text(record: ItemRecord) -> str:
    """``stagereplay show``: the same as the card's entry, as plain text."""
    lines = [
        f"item {record.item_id} ({record.checkpoint}, E1 live vs prefill, {record.precision})",
        f"question: {record.question}",
        *[f"  {letter}) {choice}" for letter, choice in zip(items_mod.LETTERS, record.choices)],
        f"  correct: {record.answer}",
        divergence_text(record),
        f"live    ({record.live.label}, stop {record.live.stop}): {marked_suffix(record.live, record.first_divergence)}",
        f"prefill ({record.prefill.label}, stop {record.prefill.stop}):"
        f" {marked_suffix(record.prefill, record.first_divergence)}",
        f"labels, live:    {label_text(record.live)}",
        f"labels, prefill: {label_text(record.prefill)}",
        cache_text(record),
    ]
    if record.layers:
        lines.append(
            "per-layer max |Δ| K: "
            + " ".join(f"{value:.3g}" for value in record.k_max_abs)
            + "; V: "
            + " ".join(f"{value:.3g}" for value in record.v_max_abs)
        )
    if record.transplants:
        lines.append(f"transplants ({record.transplant_outcomes()}):")
        lines += [f"  {t.selection}: {t.direction} [{t.subset}]: {t.outcome}" for t in record.transplants]
    else:
        lines.append("transplants: none for this item")
    return "\n".join(lines)


def ledger_item(root: str | Path, item_id: str) -> list[ItemRecord]:
    """The records of one item of a finished ledger (one per checkpoint), for ``stagereplay show``."""
    from stagereplay.ledger.layout import LedgerLayout
    from stagereplay.ledger.tables import (
        COMPARISON_SCHEMA,
        TRAJECTORY_SCHEMA,
        TRANSPLANT_SCHEMA,
        LedgerError,
        checkpoint_order,
        read_table,
    )

    ledger = LedgerLayout(root)
    if not Path(ledger.table("comparisons")).is_file():
        raise LedgerError(
            f"{root} holds no comparisons table ({ledger.table('comparisons')}) — give the ledger_dir of a finished run"
        )
    comparisons = read_table(ledger.table("comparisons"), COMPARISON_SCHEMA)
    known = sorted({row["item_id"] for row in comparisons.select(["item_id"]).to_pylist()})
    if item_id not in known:
        listed = ", ".join(known[:3]) + (", …" if len(known) > 3 else "")
        raise LedgerError(
            f'item {item_id!r} is not in {root} ({len(known)} items: {listed}) — valid ids are the "id" of each line'
            f" of {ledger.items}, or the item_id column of {ledger.table('comparisons')}"
        )
    chosen = comparisons.filter(pa.compute.equal(comparisons.column("item_id"), item_id))
    trajectories = read_table(ledger.table("trajectories"), TRAJECTORY_SCHEMA)
    trajectories = trajectories.filter(pa.compute.equal(trajectories.column("item_id"), item_id))
    transplants = None
    if Path(ledger.table("transplants")).is_file():
        transplants = read_table(ledger.table("transplants"), TRANSPLANT_SCHEMA)
        transplants = transplants.filter(pa.compute.equal(transplants.column("item_id"), item_id))
    checkpoints = checkpoint_order(comparisons)
    vocabularies = read_vocabularies({name: ledger.vocab(name) for name in checkpoints})
    return item_records(checkpoints, ledger.items, trajectories, chosen, transplants, vocabularies)
