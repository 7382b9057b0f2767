"""The global (layer, expert) -> (card, slot) directory: planned per group of pooling cards from expert weights.

Within a group the pool is deduplicated (an expert on one card), hot experts dealt across the cards; an expert is
replicated only once every expert has a place. Re-plans keep every expert that stays where it is, so a change
moves only the slots whose contents really change.
"""
from __future__ import annotations

import numpy as np

Expert = tuple[int, int]  # (layer, expert)


def hottest_first(weights: np.ndarray) -> list[Expert]:
    """All (layer, expert) by decreasing weight, ties by (layer, expert): plans are reproducible."""
    n_expert = weights.shape[1]
    flat = weights.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))
    return [(int(i // n_expert), int(i % n_expert)) for i in order]


def pooled(weights: np.ndarray, budgets: list[int]) -> list[list[Expert]]:
    """The experts each card of one group should hold, hottest first."""
    ranked = hottest_first(weights)
    held: list[list[Expert]] = [[] for _ in budgets]
    room = list(budgets)
    for x in ranked:  # deal to the card with the most room left: hot experts spread over all cards
        c = max(range(len(room)), key=lambda i: (room[i], -i))
        if room[c] == 0:
            break
        held[c].append(x)
        room[c] -= 1
    for c in range(len(budgets)):  # spare room once all are placed: replicate the hottest
        have = set(held[c])
        for x in ranked:
            if room[c] == 0:
                break
            if x not in have:
                held[c].append(x)
                room[c] -= 1
    return held


def stable_slots(current: list[Expert | None], wanted: list[Expert]) -> list[Expert | None]:
    """Slot contents holding exactly `wanted`, leaving every expert that is already in place where it is."""
    want = set(wanted)
    out = [x if x in want else None for x in current]
    placed = set(out)
    missing = iter(x for x in wanted if x not in placed)
    return [x if x is not None else next(missing, None) for x in out]


def plan(groups: list[list[int]], group_weights: list[np.ndarray], n_slots: int,
         current: list[list[Expert | None]]) -> list[list[Expert | None]]:
    """New slot contents of every card (indexed by lane/card) for these groups."""
    out = [list(c) for c in current]
    for members, w in zip(groups, group_weights):
        for card, wanted in zip(members, pooled(w, [n_slots] * len(members))):
            out[card] = stable_slots(current[card], wanted)
    return out


def coverage(contents: list[list[Expert | None]], cards: list[int], weights: np.ndarray) -> float:
    """Share of the weight (expert work) that one of `cards` holds."""
    held = np.zeros(weights.shape, bool)
    for c in cards:
        for x in contents[c]:
            if x is not None:
                held[x] = True
    total = weights.sum()
    return float(weights[held].sum() / total) if total else float(held.mean())
