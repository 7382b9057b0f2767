"""Roles, placement and epoch transitions as pure logic (the daemon tests run them for real)."""
from __future__ import annotations

import time

import numpy as np

from coordinator import directory
from coordinator.epochs import Epochs
from coordinator.roles import Roles
from protos.messages import Role


def test_roles_split_and_rejoin():
    r = Roles(3, mutual_help=False, rejoin_idle_s=10)
    assert [r.role(i) for i in range(3)] == [Role.PEER] * 3
    a = r.pick_lane([0, 1, 2])
    r.start(a)
    assert r.role(a) == Role.LEAD and sorted(r.cards_for(a)) == [0, 1, 2]
    b = r.pick_lane([i for i in range(3) if i != a])
    r.start(b)  # split: b leaves a's group
    assert r.role(b) == Role.SOLO and r.cards_for(b) == [b]
    assert r.role(a) == Role.LEAD and b not in r.cards_for(a)
    r.finish(b)
    assert not r.rejoin_due(time.monotonic() + 1)  # not idle long enough
    assert r.rejoin_due(time.monotonic() + 11)
    assert r.role(b) == Role.PEER and b in r.cards_for(a)


def test_roles_prefer_a_warm_idle_lane_over_splitting():
    r = Roles(3, mutual_help=False, rejoin_idle_s=100)
    r.start(0)
    r.start(r.pick_lane([1, 2]))  # splits 1 or 2 off
    solo = next(i for i in (1, 2) if r.role(i) == Role.SOLO)
    r.finish(solo)
    assert r.pick_lane([1, 2]) == solo  # alone in its group: no new split


def test_roles_mutual_help():
    r = Roles(2, mutual_help=True, rejoin_idle_s=1)
    r.start(0)
    assert r.role(0) == Role.LEAD and r.role(1) == Role.PEER
    r.start(1)
    assert r.role(0) == Role.MUTUAL and r.role(1) == Role.MUTUAL
    assert r.cards_for(0) == [0, 1] and r.cards_for(1) == [1, 0]
    r.lane_down(1)
    assert r.role(1) == Role.DOWN and r.cards_for(0) == [0]


def test_pooled_placement_is_deduplicated_and_covers_the_hottest():
    rng = np.random.default_rng(0)
    w = rng.zipf(1.5, size=(4, 16)).astype(float)
    held = directory.pooled(w, [20, 20])
    flat = [x for h in held for x in h]
    assert len(flat) == 40 and len(set(flat)) == 40  # no duplicates while experts remain unplaced
    top = set(directory.hottest_first(w)[:40])
    assert set(flat) == top
    held = directory.pooled(w, [40, 40])  # room for everything: the rest replicates the hottest
    assert len(set(held[0]) | set(held[1])) == 64


def test_stable_slots_move_only_what_changes():
    cur = [(0, 1), (0, 2), (0, 3), None]
    new = directory.stable_slots(cur, [(0, 3), (0, 9), (0, 1)])
    assert new[0] == (0, 1) and new[2] == (0, 3) and (0, 9) in new and (0, 2) not in new


def test_epoch_transition_waits_for_every_ack_before_loading():
    ep = Epochs([2, 2])
    ep.contents = [[(0, 0), (0, 1)], [(0, 2), (0, 3)]]
    target = [[(0, 0), (0, 5)], [(0, 2), (0, 3)]]
    assert ep.begin(target, {0, 1}) == "revoke"
    assert ep.visible()[0] == [(0, 0), None]  # the changing slot is hidden at once
    assert ep.ack(0, ep.epoch) is None  # lane 1 still may compute from the old contents
    assert ep.ack(1, ep.epoch) == [0]  # now the owner may overwrite
    assert not ep.loaded(1, ep.epoch)  # not an owner of this transition
    assert ep.loaded(0, ep.t.epoch)
    assert ep.contents[0] == [(0, 0), (0, 5)] and not ep.busy


def test_epoch_transition_survives_a_lane_death():
    ep = Epochs([1, 1])
    ep.contents = [[(0, 0)], [(0, 1)]]
    ep.begin([[(0, 4)], [(0, 5)]], {0, 1})
    ep.ack(0, ep.epoch)
    owners, done = ep.lane_gone(1)  # the silent lane died: no longer waited for, its card is empty
    assert owners == [0] and not done
    assert ep.contents[1] == [None]
    assert ep.loaded(0, ep.t.epoch)
