"""The built-in items: deterministic grade-school arithmetic, four choices each.

Deterministic across processes (seeded random.Random, never hash()), because
item order and choice order feed content-addressed results.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from stagereplay.inputs.items import LETTERS, Item

BUILTIN_SOURCE = "builtin:arith-v1"

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Greg", "Hana", "Ivan", "Jo")

# A template draws numbers and returns (question, correct value, likely mistakes).
_Template = Callable[[random.Random], tuple[str, int, list[int]]]


def _pencils(rng: random.Random) -> tuple[str, int, list[int]]:
    boxes, per_box = rng.randint(3, 9), rng.randint(4, 12)
    total = boxes * per_box
    sold = rng.randint(2, total // 2)
    q = (
        f"A shop has {boxes} boxes with {per_box} pencils in each box. "
        f"It sells {sold} pencils. How many pencils are left?"
    )
    # Forgetting the sale, selling one box too many/few, adding instead of subtracting.
    return q, total - sold, [total, total - sold - per_box, total - sold + per_box, boxes + per_box - sold]


def _apples(rng: random.Random) -> tuple[str, int, list[int]]:
    name = rng.choice(_NAMES)
    start, bags, per_bag = rng.randint(2, 30), rng.randint(2, 8), rng.randint(3, 12)
    q = (
        f"{name} has {start} apples. {name} buys {bags} bags with {per_bag} apples in each bag. "
        f"How many apples does {name} have now?"
    )
    return q, start + bags * per_bag, [bags * per_bag, start + bags + per_bag, start + (bags - 1) * per_bag]


def _train(rng: random.Random) -> tuple[str, int, list[int]]:
    start = rng.randint(30, 100)
    off, on = rng.randint(3, start // 2), rng.randint(3, 40)
    q = (
        f"A train carries {start} passengers. At the first stop {off} people get off "
        f"and {on} people get on. How many passengers are on the train now?"
    )
    return q, start - off + on, [start - off - on, start + off + on, start - off]


def _groups(rng: random.Random) -> tuple[str, int, list[int]]:
    groups, size = rng.randint(2, 9), rng.randint(3, 15)
    students, extra = groups * size, rng.randint(2, 6)
    q = (
        f"{students} students are split equally into {groups} groups. "
        f"Then {extra} more students join each group. How many students are in each group now?"
    )
    return q, size + extra, [size, students + extra, size + extra * groups, size + extra + 1]


def _cookies(rng: random.Random) -> tuple[str, int, list[int]]:
    per_hour, hours = rng.randint(6, 20), rng.randint(2, 8)
    baked = per_hour * hours
    friends = rng.randint(2, 6)
    each = rng.randint(1, max(1, baked // (2 * friends)))
    q = (
        f"A baker makes {per_hour} cookies each hour for {hours} hours. "
        f"The baker gives {each} cookies to each of {friends} friends. How many cookies are left?"
    )
    return q, baked - each * friends, [baked, baked - each, baked - each - friends, baked - each * friends + each]


_TEMPLATES: tuple[_Template, ...] = (_pencils, _apples, _train, _groups, _cookies)


def _pick_distractors(rng: random.Random, correct: int, mistakes: list[int]) -> list[int]:
    wrong: list[int] = []
    candidates = list(mistakes)
    rng.shuffle(candidates)  # so the same kind of mistake is not always picked first
    for value in candidates:
        if value > 0 and value != correct and value not in wrong:
            wrong.append(value)
        if len(wrong) == 3:
            return wrong
    # Templates can collide (e.g. zero sold); pad with near misses, which are always plausible.
    offsets = [-10, -3, -2, -1, 1, 2, 3, 5, 10]
    while len(wrong) < 3:
        value = correct + rng.choice(offsets)
        if value > 0 and value != correct and value not in wrong:
            wrong.append(value)
    return wrong


def make_default_items(n: int = 200, seed: int = 0) -> list[Item]:
    """Deterministic grade-school arithmetic items: same (n, seed) -> same list in any process."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    items = []
    positions: list[int] = []
    for i in range(n):
        template = _TEMPLATES[i % len(_TEMPLATES)]  # cycle so every template is equally represented
        question, correct, mistakes = template(rng)
        values = _pick_distractors(rng, correct, mistakes)
        if not positions:
            # Deal answer positions from shuffled blocks of four so A-D stay balanced
            # (exactly, for n divisible by 4) and position bias cannot masquerade as accuracy.
            positions = list(range(4))
            rng.shuffle(positions)
        values.insert(positions.pop(), correct)
        choices = tuple(str(v) for v in values)
        items.append(
            Item(
                item_id=f"arith-{i:03d}",
                question=question,
                choices=choices,  # type: ignore[arg-type]
                answer=LETTERS[values.index(correct)],
                source=BUILTIN_SOURCE,
            )
        )
    return items
