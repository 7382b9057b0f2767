"""Placement at Qwen3-235B-A22B's shape (94 layers x 128 experts = 12,032): the vectorised deal gives exactly the
plan of the one-expert-at-a-time greedy it replaced, and planning, views and a replan check stay in milliseconds."""
from __future__ import annotations

import time

import numpy as np
import pytest

from coordinator import directory
from coordinator.pool import CardPool

A235B = (94, 128)


def greedy_pooled(weights: np.ndarray, budgets: list[int]) -> list[list[tuple[int, int]]]:
    """The definition: each expert, hottest first, to the card with the most room (ties: lower card); then each
    card's spare room to the hottest experts it lacks."""
    ranked = directory.hottest_first(weights)
    held, room = [[] for _ in budgets], list(budgets)
    for x in ranked:
        c = max(range(len(room)), key=lambda i: (room[i], -i))
        if room[c] == 0:
            break
        held[c].append(x)
        room[c] -= 1
    for c in range(len(budgets)):
        for x in ranked:
            if room[c] == 0:
                break
            if x not in held[c]:
                held[c].append(x)
                room[c] -= 1
    return held


def test_pooled_is_the_greedy_deal():
    rng = np.random.default_rng(1)
    for trial in range(200):
        w = rng.random((int(rng.integers(1, 6)), int(rng.integers(1, 20))))
        if trial % 3 == 0:
            w = np.round(w * 3)  # many ties
        n = int(rng.integers(1, 5))
        budgets = [int(b) for b in rng.integers(0, w.size + 3, n)]  # unequal, some above the expert count
        assert directory.pooled(w, budgets) == greedy_pooled(w, budgets), (trial, budgets)
    w = rng.random(A235B)
    assert directory.pooled(w, [3008] * 4) == greedy_pooled(w, [3008] * 4)


class _Ready:
    pool, device, slots_total = "pool", "cpu", 1 << 30


@pytest.mark.parametrize("n_cards", [2, 8])
def test_card_pool_at_a235b_shape(n_cards):
    """2-core CPU box: construction ~7 ms, a replan check ~7 ms, a request start ~11 ms with 8 cards (before:
    43 / 47 / 96 ms); bounds leave room for a loaded machine."""
    rng = np.random.default_rng(0)
    profile = np.stack([1.0 / (1 + rng.permutation(A235B[1])) for _ in range(A235B[0])])
    sent = []
    t0 = time.perf_counter()
    p = CardPool([A235B[0] * A235B[1] // n_cards] * n_cards, A235B, profile, "/stratad-test-none-",
                 lambda lane, msg: sent.append((lane, msg)) or True, mutual_help=True, rejoin_idle_s=30,
                 replan_interval_s=2.0, replan_min_gain=0.02)
    for i in range(n_cards):
        p.lane_ready(i, False, _Ready)
    for i in range(n_cards):
        p.on_ack(i, p.epochs.epoch)
    for i in range(n_cards):
        p.on_loaded(i, p.epochs.epoch)
    start = time.perf_counter() - t0
    held = {x for c in p.epochs.contents for x in c if x is not None}
    assert len(held) == A235B[0] * A235B[1]  # every expert on some card
    t0 = time.perf_counter()
    p.request_started(0)
    p.last_replan = 0
    p.tick(time.time())
    p.request_finished(0)
    step = time.perf_counter() - t0
    assert start < 2.0 and step < 0.5, (start, step)
