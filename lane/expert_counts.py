"""A finished step's routing, counted per (layer, expert) and per source.

A GPU card tallies every step: how often each expert was routed (the live counts placement follows) and where each
routed entry ran (the card, a peer pool, the arena, the CPU pool). Both come from one (n_layer, n_expert) count
matrix, so the host work is a bincount over the step's ids and then O(n_layer * n_expert), not per entry (a prompt
chunk has hundreds of thousands of entries, and the card waits for the next chunk meanwhile).
"""
from __future__ import annotations

import numpy as np


def routed_counts(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """ids int (n_layer, T, k) -> int64 (n_layer, n_expert): how many of the step's entries chose each expert."""
    L = ids.shape[0]
    flat = ids.reshape(L, -1) + (np.arange(L) * n_expert)[:, None]  # int64: layer l's experts at l * n_expert
    if flat.size and (int(ids.min()) < 0 or int(ids.max()) >= n_expert):
        raise ValueError(f"routed expert ids outside [0, {n_expert})")
    return np.bincount(flat.ravel(), minlength=L * n_expert).reshape(L, n_expert)


def entries_by_source(ids: np.ndarray, counts: np.ndarray, src: np.ndarray,
                      staged: dict[int, np.ndarray]) -> dict[int, int]:
    """ids (n_layer, T, k) of a step and their routed_counts, src (n_layer, n_expert) the source of each expert (0
    this card, s > 0 the s-th other source, -1 none: the CPU pool), staged {layer: experts copied to this card for
    the step} (they ran on the card) -> {source: entries}."""
    where = src
    if staged:
        where = src.copy()
        for layer, experts in staged.items():
            where[layer, experts] = 0
    L = ids.shape[0]
    if ids.size < where.size:  # few entries (a decode step): each one's source
        per = np.bincount((where[np.arange(L)[:, None], ids.reshape(L, -1)] + 1).ravel())
    else:  # many (a prompt chunk): each expert's source, weighed by its count
        per = np.bincount(where.ravel() + 1, weights=counts.ravel())
    return {s - 1: int(n) for s, n in enumerate(per) if n}  # index s + 1: source s
