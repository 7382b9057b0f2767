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
    assert card_slots.per_card(frac, ["0", "cpu"], 64, SLOT, 0) == ([32, 32], [0, 0])
    size = config.CacheBudget.parse("1MiB")
    assert card_slots.per_card(size, ["0"], 64, SLOT, 0) == ([64], [0])  # never more than every expert
    assert card_slots.per_card(config.CacheBudget.parse("10KiB"), ["0"], 64, SLOT, 0) == ([10], [0])


def test_auto_gives_gpu_cards_every_expert_to_fit_and_shares_the_host_among_cpu_cards():
    auto = config.CacheBudget.parse("auto")
    # half of 40,000 free bytes, split over two CPU cards: 10 slots each; the GPU card fits itself
    assert card_slots.per_card(auto, ["cpu", "0", "cpu"], 64, SLOT, 0, host_free=40_000) == \
        ([10, 64, 10], [0, 1, 0])
    assert card_slots.per_card(auto, ["cpu"], 64, SLOT, 0, host_free=10**9) == ([64], [0])
    assert card_slots.per_card(auto, ["cpu"], 64, SLOT, 0, host_free=0) == ([0], [0])
    # lanes of one GPU are told how many fit there
    assert card_slots.per_card(auto, ["0", "0", "1"], 64, SLOT, 0) == ([64, 64, 64], [2, 2, 1])
    # this host, the tiny counts: every expert fits
    assert card_slots.per_card(auto, ["cpu", "cpu"], 64, SLOT, 0) == ([64, 64], [0, 0])


class _Status:
    def __init__(self, slots_total: int):
        self.pool, self.device, self.slots_total = "pool", "cuda:0", slots_total


def _pool(slots, fit: list[int], sent):
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
    p = _pool([64, 64], [1, 1], sent)
    first = [p.placement(lane) for lane in range(2)]
    assert all(pl.fit and pl.n_slots == 64 and pl.cards == 2 and pl.gpu_lanes == 1 and len(pl.experts) == 64
               for pl in first)
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
    # a restart of that lane is given every expert to fit again (its room may have changed), and tells its count
    p.lane_dead(1)
    _settle(p)
    again = p.placement(1)
    assert again.n_slots == 64 and again.fit and again.experts == ()
    p.lane_ready(1, True, _Status(30))
    assert p.slots == [64, 30] and len(p.epochs.contents[1]) == 30
    _settle(p)
    assert len({x for c in p.epochs.contents for x in c if x is not None}) == SHAPE[0] * SHAPE[1]


def test_a_fit_card_not_yet_sized_is_planned_as_the_sized_ones():
    """While card 1 still builds, card 0 (room for 20) is planned as if card 1 had 20 slots too: card 0 keeps the
    start of its placement (no reloads), rather than being left the coldest experts around card 1's 64."""
    sent = []
    p = _pool([64, 64], [2, 2], sent)
    placed0 = p.placement(0).experts
    p.placement(1)
    p.lane_ready(0, False, _Status(20))
    assert p.epochs.contents[0] == list(placed0[:20])
    assert p.epochs.t is None or 0 not in p.epochs.t.dirty  # nothing to reload on card 0
    assert p.placement(0).gpu_lanes == 2


def test_plan_deals_by_each_cards_own_count():
    w = np.ones(SHAPE)
    out = directory.plan([[0, 1]], [w], [50, 14], [[None] * 50, [None] * 14])
    assert [len(c) for c in out] == [50, 14]
    assert len({x for c in out for x in c}) == 64  # deduplicated: 50 + 14 cover all 64


def test_lanes_of_one_gpu_fit_one_after_the_other(tmp_path, monkeypatch):
    """fitting_alone holds a lock a GPU while a lane builds a card that fits its pool: a second lane of that GPU
    waits (beating meanwhile); one of another GPU, or one with a fixed budget, does not. Each is told how many lanes
    of its GPU built before it in this run; a failed build does not count."""
    import fcntl
    import os
    import tempfile
    import threading

    import lane.main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = tmp_path / f"stratad-{os.getuid()}-gpu3-fit.lock"
    beats, got = [], []
    with lane.main.fitting_alone("3", True, "/run-a-") as before:
        assert before == 0
        fd = os.open(path, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with lane.main.fitting_alone("4", True, "/run-a-") as other, lane.main.fitting_alone("3", False, "/run-a-"):
            assert other == 0

        def second():
            with lane.main.fitting_alone("3", True, "/run-a-", lambda: beats.append(1)) as b:
                got.append(b)

        t = threading.Thread(target=second)
        t.start()
        t.join(0.6)
        assert t.is_alive() and beats  # waiting, and heard from
    t.join(5)
    assert got == [1]
    with pytest.raises(RuntimeError):
        with lane.main.fitting_alone("3", True, "/run-a-") as b:
            assert b == 2
            raise RuntimeError("the build failed")
    with lane.main.fitting_alone("3", True, "/run-a-") as b:
        assert b == 2  # the failed one did not count
    with lane.main.fitting_alone("3", True, "/run-b-") as b:
        assert b == 0  # another daemon's run starts over
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    os.close(fd)


def test_lanes_of_one_gpu_share_its_room():
    """room_slots as the lanes of one GPU use it, one after the other (each its own process: the same needs): equal
    shares, and every lane's reserve still free once all have built; one lane takes what it has room for."""
    from lane.fit import room_slots

    GB, needs, reserve, sb = 1 << 30, 6 << 30, 2 << 30, 5 << 20
    for k in (1, 2, 3):
        free = 80 * GB  # the bare card
        got = []
        for i in range(k):  # lane i: its needs taken, then its pool
            free -= needs
            n = room_slots(free, needs, reserve, i, k - 1 - i, sb, 10**6)
            free -= n * sb
            got.append(n)
        assert max(got) - min(got) <= 1, got
        assert k * reserve <= free < k * reserve + k * sb  # the reserves, and less than a slot each besides
    assert room_slots(80 * GB, needs, reserve, 0, 0, sb, 100) == 100  # at most every expert
    assert room_slots(reserve // 2, needs, reserve, 0, 0, sb, 100) == 0  # no room: none, not fewer than none


def test_a_card_packs_its_layers_only_where_that_costs_no_slot():
    """[gpu] pack_layers with expert_cache = auto: the extra bytes may only come out of what the slots leave over
    (on a card that holds every expert, or of the remainder below one slot); a lane still to build on the GPU is
    left the extra too."""
    from lane.fit import packing_costs_no_slot, room_slots

    GB, sb = 1 << 30, 2 << 20
    needs, reserve = 20 * GB, 3 * GB
    assert packing_costs_no_slot(GB, 80 * GB, needs, reserve, 0, 0, sb, 6144)  # 6144 slots of 2 MB fit either way
    short = reserve + 5000 * sb  # memory-bound: 5000 slots
    assert not packing_costs_no_slot(GB, short, needs, reserve, 0, 0, sb, 6144)  # 512 slots fewer
    assert packing_costs_no_slot(sb // 2, short + sb // 2, needs, reserve, 0, 0, sb, 6144)  # within a slot's rest
    assert not packing_costs_no_slot(0, 80 * GB, needs, reserve, 0, 0, sb, 6144)  # nothing to pack
    # two lanes on one GPU: the first leaves the second its needs with the extra
    free = 2 * reserve + needs + 2 * 6144 * sb + GB
    assert room_slots(free, needs, reserve, 0, 1, sb, 6144) == 6144
    assert packing_costs_no_slot(GB // 2, free, needs, reserve, 0, 1, sb, 6144)
    assert not packing_costs_no_slot(GB, free, needs, reserve, 0, 1, sb, 6144)
