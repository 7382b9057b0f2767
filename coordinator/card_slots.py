"""How many expert slots each card gets from the expert_cache budget.

A fraction or a size gives every card the same count. `auto` gives each card as many as it has room for, up to
every expert: a CPU card's slots are shared memory of this host, so the coordinator divides half of what the host
has left beside the model (and that /dev/shm can take) among the CPU cards; a GPU card's room is known only to its
lane once the card is built, so it is given every expert with `fit` and tells how many it kept (lane/cupy_card.py);
lanes of one GPU share it (each is told how many fit there).
"""
from __future__ import annotations

import os

from stratad import kv_store, shm
from stratad.config import CacheBudget

HOST_SHARE = 0.5  # of the host memory left beside the model: the rest for the conversation cache and the system


def per_card(budget: CacheBudget, cards: list[str], total: int, slot_bytes: int, model_bytes: int,
             host_free: int | None = None) -> tuple[list[int], list[int]]:
    """(slots, fit) per card; total: every expert of the model; fit: 0 for a card given its count, else the number
    of cards of its GPU that fit (their lanes share what it has). host_free: bytes the host has left beside the
    model for CPU cards (default: MemAvailable less the model, at most what /dev/shm has free)."""
    if not budget.auto:
        n = int(budget.fraction * total) if budget.fraction is not None else budget.bytes // slot_bytes
        n = max(0, min(total, n))
        return [n] * len(cards), [0] * len(cards)
    n_cpu = sum(card == "cpu" for card in cards)
    cpu = total
    if n_cpu:
        if host_free is None:
            st = os.statvfs(shm.SHM_DIR)
            host_free = min(max(0, kv_store.mem_available() - model_bytes), st.f_bavail * st.f_frsize)
        cpu = max(0, min(total, int(HOST_SHARE * host_free) // n_cpu // slot_bytes))
    return [cpu if card == "cpu" else total for card in cards], [0 if card == "cpu" else cards.count(card)
                                                                 for card in cards]
