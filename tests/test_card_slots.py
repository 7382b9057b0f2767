"""expert_cache's slot counts per card (coordinator/card_slots.py) and a card that had room for fewer slots than it
was given (expert_cache = auto on a GPU: the lane fits its pool, the coordinator's directory follows)."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import card_slots, directory
from coordinator.pool import CardPool
from protos import messages as M
from stratad import config

SHAPE = (4, 16)  # layers x experts: 64 experts in all
SLOT = 1000  # bytes a slot


def test_expert_cache_config_takes_auto_and_it_is_the_default():
    assert config.load(None, {"model": "m"}).expert_cache.auto
    assert config.load(None, {"model": "m", "expert_cache": "auto"}).expert_cache.auto
    assert str(config.load(None, {"model": "m"}).expert_cache) == "auto"
    assert config.load(None, {"model": "m", "expert_cache": 0.5}).expert_cache.fraction == 0.5
    with pytest.raises(config.ConfigError, match="kv_cache_host.*not 'auto'"):
        config.load(None, {"model": "m", "kv_cache_host": "auto"})
    with pytest.raises(config.ConfigError, match="expert_cache.*'auto'"):
        config.load(None, {"model": "m", "expert_cache": "most"})


def test_a_fraction_or_a_size_gives_every_card_the_same_count():
    frac = config.CacheBudget.parse(0.5)
    assert card_slots.per_card(frac, ["0", "cpu"], 64, SLOT, 0) == ([32, 32], [False, False])
    size = config.CacheBudget.parse("1MiB")
    assert card_slots.per_card(size, ["0"], 64, SLOT, 0) == ([64], [False])  # never more than every expert
    assert card_slots.per_card(config.CacheBudget.parse("10KiB"), ["0"], 64, SLOT, 0) == ([10], [False])


def test_auto_gives_gpu_cards_every_expert_to_fit_and_shares_the_host_among_cpu_cards():
    auto = config.CacheBudget.parse("auto")
    # half of 40,000 free bytes, split over two CPU cards: 10 slots each; the GPU card fits itself
    assert card_slots.per_card(auto, ["cpu", "0", "cpu"], 64, SLOT, 0, host_free=40_000) == \
        ([10, 64, 10], [False, True, False])
    assert card_slots.per_card(auto, ["cpu"], 64, SLOT, 0, host_free=10**9) == ([64], [False])
    assert card_slots.per_card(auto, ["cpu"], 64, SLOT, 0, host_free=0) == ([0], [False])
    # this host, the tiny counts: every expert fits
    assert card_slots.per_card(auto, ["cpu", "cpu"], 64, SLOT, 0) == ([64, 64], [False, False])


class _Status:
    def __init__(self, slots_total: int):
        self.pool, self.device, self.slots_total = "pool", "cuda:0", slots_total


def _pool(slots, fit, sent):
    profile = 1.0 / (1 + np.arange(SHAPE[0] * SHAPE[1], dtype=np.float64).reshape(SHAPE))
    return CardPool(slots, SHAPE, profile, "/stratad-test-none-", lambda lane, msg: sent.append((lane, msg)) or True,
                    mutual_help=False, rejoin_idle_s=30, replan_interval_s=2.0, replan_min_gain=0.02, fit=fit)


def _settle(p: CardPool) -> None:
    while p.epochs.busy:
        t = p.epochs.t
        for lane in range(p.n):
            p.on_ack(lane, t.epoch)
        for lane in list(t.dirty):
            p.on_loaded(lane, t.epoch)


def test_a_card_with_room_for_fewer_slots_holds_the_first_of_its_placement():
    sent = []
    p = _pool([64, 64], [True, True], sent)
    first = [p.placement(lane) for lane in range(2)]
    assert all(pl.fit and pl.n_slots == 64 and pl.cards == 2 and len(pl.experts) == 64 for pl in first)
    p.lane_ready(0, False, _Status(64))  # room for all
    p.lane_ready(1, False, _Status(20))  # room for 20: it filled the first 20 of its list
    assert p.slots == [64, 20]
    assert len(p.epochs.contents[1]) == 20
    assert p.epochs.contents[1] == list(first[1].experts[:20])
    _settle(p)
    # what the directory says card 1 holds, slot by slot, stays within its 20 slots; the views say the same
    assert len(p.epochs.contents[1]) == 20 and all(x is not None for x in p.epochs.contents[1])
    views = [m for lane, m in sent if isinstance(m, M.View) and lane == 0]
    card1 = [cv for cv in views[-1].cards if cv.card == 1]
    assert card1 and max(s for _, _, s in card1[0].experts) < 20
    # the two cards together hold every expert once more (64 + 20 slots for 64 experts)
    held = {x for c in p.epochs.contents for x in c if x is not None}
    assert len(held) == SHAPE[0] * SHAPE[1]
    # a restart of that lane is placed with the count it has room for
    p.lane_dead(1)
    _settle(p)
    again = p.placement(1)
    assert again.n_slots == 20 and again.fit


def test_plan_deals_by_each_cards_own_count():
    w = np.ones(SHAPE)
    out = directory.plan([[0, 1]], [w], [50, 14], [[None] * 50, [None] * 14])
    assert [len(c) for c in out] == [50, 14]
    assert len({x for c in out for x in c}) == 64  # deduplicated: 50 + 14 cover all 64


def test_lanes_of_one_gpu_fit_one_after_the_other(tmp_path, monkeypatch):
    """fitting_alone holds a lock a GPU while a lane builds a card that fits its pool: a second lane of that GPU
    waits; one of another GPU, or one with a fixed budget, does not."""
    import fcntl
    import os
    import tempfile

    import lane.main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = tmp_path / f"stratad-{os.getuid()}-gpu3-fit.lock"
    with lane.main.fitting_alone("3", True):
        fd = os.open(path, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with lane.main.fitting_alone("4", True), lane.main.fitting_alone("3", False):
            pass
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    os.close(fd)
