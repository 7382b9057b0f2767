"""The global (layer, expert) -> (card, slot) directory: planned per group of pooling cards from expert weights.

Within a group the pool is deduplicated (an expert on one card), hot experts dealt across the cards; an expert is
replicated only once every expert has a place. Re-plans keep every expert that stays where it is, so a change
moves only the slots whose contents really change.
"""
from __future__ import annotations

import numpy as np

Expert = tuple[int, int]  # (layer, expert)


def _ranked(weights: np.ndarray) -> np.ndarray:
    """Flat (layer * n_expert + expert) indices by decreasing weight, ties by index: plans are reproducible."""
    flat = weights.reshape(-1)
    return np.lexsort((np.arange(flat.size), -flat))


def hottest_first(weights: np.ndarray) -> list[Expert]:
    """All (layer, expert) by decreasing weight, ties by (layer, expert)."""
    n_expert = weights.shape[1]
    return [(int(i // n_expert), int(i % n_expert)) for i in _ranked(weights)]


def pooled(weights: np.ndarray, budgets: list[int]) -> list[list[Expert]]:
    """The experts each card of one group should hold, hottest first: each expert in turn to the card with the
    most room left (ties to the lower card), so hot experts spread over all cards; once every expert has a place,
    each card's spare room replicates the hottest it lacks. Vectorised (a235b: 12,032 experts): a card's u-th
    expert is dealt while its room is budget - u, and the deal takes every card at room r, lowest first, before
    any at r - 1, so the deal order is sorting (room before, card)."""
    n_expert = weights.shape[1]
    ranked = _ranked(weights)
    card = np.repeat(np.arange(len(budgets)), budgets)
    room_before = np.concatenate([np.arange(b, 0, -1) for b in budgets]) if card.size else card
    deal = card[np.lexsort((card, -room_before))][:ranked.size]
    held_idx = [list(ranked[:deal.size][deal == c]) for c in range(len(budgets))]
    for c, b in enumerate(budgets):  # spare room once all are placed: replicate the hottest not yet held
        spare = b - len(held_idx[c])
        if spare > 0:
            mine = np.zeros(ranked.size, bool)
            mine[held_idx[c]] = True
            held_idx[c] += list(ranked[~mine[ranked]][:spare])
    return [[(int(i // n_expert), int(i % n_expert)) for i in h] for h in held_idx]


def stable_slots(current: list[Expert | None], wanted: list[Expert]) -> list[Expert | None]:
    """Slot contents holding exactly `wanted`, leaving every expert that is already in place where it is."""
    want = set(wanted)
    out = [x if x in want else None for x in current]
    placed = set(out)
    missing = iter(x for x in wanted if x not in placed)
    return [x if x is not None else next(missing, None) for x in out]


def plan(groups: list[list[int]], group_weights: list[np.ndarray], slots: list[int],
         current: list[list[Expert | None]]) -> list[list[Expert | None]]:
    """New slot contents of every card (indexed by lane/card; slots: each card's count) for these groups."""
    out = [list(c) for c in current]
    for members, w in zip(groups, group_weights):
        for card, wanted in zip(members, pooled(w, [slots[m] for m in members])):
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
