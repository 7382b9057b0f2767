"""The global (layer, expert) -> card directory, planned from an expert profile and each card's slot budget.

`independent`: every card fills its slots with the hottest experts on its own (lanes that do not help each
other). `pooled`: one deduplicated pool sliced across all cards (an expert on one card), the hottest replicated
only once every expert that fits has a place.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Directory:
    epoch: int
    mode: str
    slots: tuple[tuple[tuple[int, int], ...], ...]  # per card, (layer, expert) in slot order

    def owners(self, n_layer: int, n_expert: int) -> np.ndarray:
        """(n_layer, n_expert) -> bitmask of the cards holding each expert."""
        m = np.zeros((n_layer, n_expert), np.int64)
        for c, held in enumerate(self.slots):
            for layer, e in held:
                m[layer, e] |= 1 << c
        return m

    def coverage(self, profile: np.ndarray) -> float:
        """Share of the profile's expert work that some card holds."""
        held = self.owners(*profile.shape) != 0
        total = profile.sum()
        return float(profile[held].sum() / total) if total else float(held.mean())


def hottest_first(profile: np.ndarray) -> list[tuple[int, int]]:
    """All (layer, expert) by decreasing count, ties broken by (layer, expert) so plans are reproducible."""
    n_layer, n_expert = profile.shape
    flat = profile.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))
    return [(int(i // n_expert), int(i % n_expert)) for i in order]


def plan(profile: np.ndarray, budgets: list[int], mode: str = "independent", epoch: int = 0) -> Directory:
    ranked = hottest_first(profile)
    if mode == "independent":
        return Directory(epoch, mode, tuple(tuple(ranked[:b]) for b in budgets))
    if mode != "pooled":
        raise ValueError(f"unknown placement mode {mode!r}")
    held: list[list[tuple[int, int]]] = [[] for _ in budgets]
    room = list(budgets)
    # deal the ranked experts to the card with the most room left: hot experts spread over all cards
    for x in ranked:
        c = max(range(len(room)), key=lambda i: (room[i], -i))
        if room[c] == 0:
            break
        held[c].append(x)
        room[c] -= 1
    # spare room (all experts placed): replicate the hottest on the cards that do not hold them yet
    for c in range(len(budgets)):
        have = set(held[c])
        for x in ranked:
            if room[c] == 0:
                break
            if x not in have:
                held[c].append(x)
                room[c] -= 1
    return Directory(epoch, mode, tuple(tuple(h) for h in held))
