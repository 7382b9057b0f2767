"""Which of the experts no card holds the CPU pool computes in a GPU card's decode steps, beside the card reading
the others from the arena over the bus (config host_cpu_share).

The two run at once: the card's side stream fetches and computes its share while the host computes the rest into
pinned rows, so a layer's misses take the longer of the two instead of their sum over one path. The split is by
expert (an expert's h is quantised whole before its down rows, so it is not cut between the two), chosen per layer
from the routing counts: in order of expected use, each expert goes to the side further below its share of the
layer's expected use. Where an expert runs does not change its bits (the exactness rule), so the split is free to
follow the counts.
"""
from __future__ import annotations

import numpy as np


def check_share(share: float) -> float:
    """share itself, where it is a part of a whole (NaN is not)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"host_cpu_share must be in [0, 1], not {share}")
    return share


def cpu_side(off: np.ndarray, counts: np.ndarray, share: float) -> np.ndarray:
    """off bool (n_layer, n_expert): the experts no card holds; counts (n_layer, n_expert): their expected use
    (routing counts; all zero: every expert alike); share in [0, 1]: the part of each layer's expected use the CPU
    pool takes. Returns bool (n_layer, n_expert): the experts the CPU pool computes (a subset of off)."""
    if check_share(share) == 0.0:  # the rule below would still give a layer's first expert to the CPU
        return np.zeros_like(off)
    L, E = off.shape
    c = np.asarray(counts, np.float64)
    # a floor under the counts: never-routed experts still alternate, and an all-zero profile splits by count of
    # experts
    w = np.where(off, c + 1e-6 * (1.0 + c.max(initial=0.0)), 0.0)
    order = np.lexsort((np.broadcast_to(np.arange(E), (L, E)), -w), axis=1)  # heaviest first, ties by index
    rows = np.arange(L)
    cpu, bus = np.zeros(L), np.zeros(L)
    out = np.zeros_like(off)
    for r in range(E):
        e = order[:, r]
        we, o = w[rows, e], off[rows, e]
        to_cpu = o & (cpu * (1.0 - share) <= bus * share)  # cpu / share <= bus / (1 - share): the CPU is behind
        out[rows, e] = to_cpu
        cpu += np.where(to_cpu, we, 0.0)
        bus += np.where(o & ~to_cpu, we, 0.0)
    return out
