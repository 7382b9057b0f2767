"""The cards' expert caches as one pool: roles, placement from live counts, and epoch-safe changes.

The coordinator tells this module what happens (lanes up / down, requests start / finish, acks); it decides roles
(split, rejoin), plans each group's deduplicated placement, runs the epoch transitions and sends the lanes their
Views, Loads and RoleChanges through `send(lane, msg)`.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

import numpy as np

from coordinator import directory
from coordinator.epochs import Epochs
from coordinator.roles import Roles
from protos import messages as M
from stratad import shm

log = logging.getLogger("stratad.coordinator")
PRIOR = 0.05  # weight of the static profile beside live counts
ROLE_LOG = 50


class CardPool:
    def __init__(self, slots: list[int], shape: tuple[int, int], profile: np.ndarray, shm_prefix: str,
                 send: Callable[[int, object], bool], mutual_help: bool, rejoin_idle_s: float,
                 replan_interval_s: float, replan_min_gain: float, fit: list[int] | None = None):
        """slots: each card's slot count; fit: per card 0, or (expert_cache = auto on a GPU) the number of such cards
        on its GPU: it holds only what it has room for, up to its count, and tells how many once ready."""
        n_cards = len(slots)
        self.n, self.slots, self.shape = n_cards, list(slots), shape
        self.most = list(slots)  # a fit card's count before it told its own (a restart asks again)
        self.fit = list(fit) if fit is not None else [0] * n_cards
        self.sized = [not f for f in self.fit]  # whether the card's count is its own (a fit one: once ready)
        self.placed: list[tuple] = [()] * n_cards  # per card: the experts its last Placement listed
        self.profile = profile / profile.sum() if profile.sum() else np.zeros(shape)
        self.prefix, self.send = shm_prefix, send
        self.roles = Roles(n_cards, mutual_help, rejoin_idle_s)
        self.epochs = Epochs(self.slots)
        self.ready = [False] * n_cards
        self.generation = [0] * n_cards
        self.pools: list[tuple[str, str]] = [("", "")] * n_cards  # per card: (pool, device) as its lane reported
        self.counts: list[shm.Segment | None] = [None] * n_cards
        self.replan_interval_s, self.replan_min_gain = replan_interval_s, replan_min_gain
        self.last_replan = 0.0
        self.replan_pending = False
        self.planned_for: tuple | None = None
        self.sent_roles: list[M.Role | None] = [None] * n_cards
        self.role_log: deque[M.RoleEvent] = deque(maxlen=ROLE_LOG)
        self.role_since = [time.time()] * n_cards
        # the first placement: all cards pooled on the profile, loaded by each lane before it reports ready
        self.epochs.contents = directory.plan(self.roles.groups(), [self._group_weights(g) for g in
                                                                    self.roles.groups()], self.slots,
                                              self.epochs.contents)

    # ---- names ----------------------------------------------------------------------------------------------
    def counts_name(self, lane: int) -> str:
        return f"{self.prefix}lane{lane}-counts"

    # ---- weights --------------------------------------------------------------------------------------------
    def live(self, lane: int) -> np.ndarray:
        seg = self.counts[lane]
        if seg is None:
            return np.zeros(self.shape)
        c = seg.array(np.float64, shape=self.shape).copy()
        s = c.sum()
        return c / s if s > 0 else c

    def _group_weights(self, members: list[int]) -> np.ndarray:
        busy = [j for j in members if self.roles.busy[j]]
        w = sum((self.live(j) for j in (busy or members)), np.zeros(self.shape))
        return w + PRIOR * self.profile + 1e-9 * (self.profile == 0)

    def learned(self) -> np.ndarray:
        """What the cards have seen: every lane's live counts (each normalised) over the starting profile."""
        w = sum((self.live(j) for j in range(self.n)), np.zeros(self.shape)) + PRIOR * self.profile
        s = w.sum()
        return w / s if s > 0 else w

    # ---- events ---------------------------------------------------------------------------------------------
    def placement(self, lane: int, warmup_tokens: int = 0) -> M.Placement:
        self.placed[lane] = tuple(x for x in self.epochs.contents[lane] if x is not None)
        return M.Placement(epoch=self.epochs.epoch, n_slots=self.slots[lane], warmup_tokens=warmup_tokens,
                           experts=self.placed[lane], fit=bool(self.fit[lane]), gpu_lanes=max(1, self.fit[lane]),
                           cards=self.n)

    def lane_ready(self, lane: int, restarted: bool, status: M.LaneStatus) -> None:
        if self.fit[lane]:  # it holds the first of its placement that it had room for
            n = min(status.slots_total, self.slots[lane])
            if n < self.slots[lane]:
                log.info("card %d has room for %d expert slots of the %d it was given", lane, n, self.slots[lane])
            self.slots[lane], self.sized[lane] = n, True
            held = list(self.placed[lane][:n])
            self.epochs.hold(lane, held + [None] * (n - len(held)))
        self.ready[lane] = True
        self.pools[lane] = (status.pool, status.device)
        if self.counts[lane] is not None:
            self.counts[lane].close()
        try:
            self.counts[lane] = shm.Segment(self.counts_name(lane))
        except Exception:  # noqa: BLE001 - a lane without a counts segment still serves; placement uses the prior
            self.counts[lane] = None
        if restarted:
            self.roles.lane_up(lane)
        self.changed()

    def lane_dead(self, lane: int) -> None:
        self.ready[lane] = False
        self.generation[lane] += 1
        self.roles.lane_down(lane)
        if self.counts[lane] is not None:
            self.counts[lane].close()
            self.counts[lane] = None
        owners, done = self.epochs.lane_gone(lane)
        if self.fit[lane]:  # its restart is given every expert again and tells its own count
            self.slots[lane], self.sized[lane] = self.most[lane], False
            self.epochs.hold(lane, [None] * self.most[lane])
        self._after_transition_step(owners, done)
        self.changed()

    def pick_lane(self, free: list[int]) -> int | None:
        return self.roles.pick_lane(free)

    def request_started(self, lane: int) -> None:
        self.roles.start(lane)
        self.changed()

    def request_finished(self, lane: int) -> None:
        self.roles.finish(lane)
        self.changed()

    def on_ack(self, lane: int, epoch: int) -> None:
        self._after_transition_step(self.epochs.ack(lane, epoch), False)

    def on_loaded(self, lane: int, epoch: int) -> None:
        self._after_transition_step(None, self.epochs.loaded(lane, epoch))

    def tick(self, now: float) -> None:
        if self.roles.rejoin_due():
            self.changed()
        elif now - self.last_replan >= self.replan_interval_s:
            self.last_replan = now
            self._replan(min_gain=self.replan_min_gain)

    # ---- planning -------------------------------------------------------------------------------------------
    def changed(self) -> None:
        """Roles or lanes changed: tell lanes their roles and which cards they may use now (a lane that left a
        group stops using its cards from its next token; nothing is overwritten, so no ack is needed), then
        re-plan (at once if no transition is running)."""
        for i in range(self.n):
            r = self.roles.role(i)
            if self.ready[i] and r != self.sent_roles[i]:
                self.sent_roles[i] = r
                self.role_since[i] = time.time()
                self.role_log.append(M.RoleEvent(time=self.role_since[i], lane=i, role=r))
                self.send(i, M.RoleChange(role=r, epoch=self.epochs.epoch))
        self._send_views()
        # a new group structure (split, rejoin, a lane up or down) needs a new placement now; a request starting
        # or ending inside a group only shifts the weights: that waits for a clear gain (no churn per request)
        self._replan(min_gain=None if self._structure() != self.planned_for else self.replan_min_gain)

    def _structure(self) -> tuple:
        return tuple(map(tuple, self.roles.groups())), tuple(self.ready)

    def _replan(self, min_gain: float | None) -> None:
        if self.epochs.busy:
            self.replan_pending = True
            return
        self.replan_pending = False
        self.planned_for = self._structure()
        groups = self.roles.groups()
        weights = [self._group_weights(g) for g in groups]
        target = directory.plan(groups, weights, self._budgets(), self.epochs.contents)
        if min_gain is not None:  # adaptive swap: only for a clear gain on the live traffic
            gain = sum(directory.coverage(target, g, w) - directory.coverage(self.epochs.contents, g, w)
                       for g, w in zip(groups, weights))
            if gain < min_gain:
                return
            log.info("adaptive re-plan: coverage gain %.3f", gain)
        live = {i for i in range(self.n) if self.ready[i]}
        self.epochs.begin(target, live)
        self._send_views()

    def _budgets(self) -> list[int]:
        """Slot counts to plan with: a fit card that has not told its own count yet is planned as the smallest fit
        card that has (cards alike; it keeps the start of its placement), so that the others are not planned around
        room it may not have."""
        told = [n for n, f, s in zip(self.slots, self.fit, self.sized) if f and s]
        guess = min(told) if told else None
        return [n if s or guess is None else min(n, guess) for n, s in zip(self.slots, self.sized)]

    def _after_transition_step(self, owners: list[int] | None, done: bool) -> None:
        if owners:
            t = self.epochs.t
            for o in owners:
                self.send(o, M.Load(epoch=t.epoch, slots=tuple(t.dirty[o])))
        if done:
            self._send_views()
            if self.replan_pending:
                self._replan(min_gain=None if self._structure() != self.planned_for else self.replan_min_gain)

    def _send_views(self) -> None:
        vis = self.epochs.visible()
        views: dict[int, M.CardView] = {}  # a card's view is the same for every lane using it: built once (a235b:
        # 12,032 experts, a message of thousands of slots per card, each validated)

        def view(c: int) -> M.CardView:
            if c not in views:
                views[c] = M.CardView(card=c, pool=self.pools[c][0], device=self.pools[c][1],
                                      generation=self.generation[c],
                                      experts=tuple((x[0], x[1], s) for s, x in enumerate(vis[c]) if x is not None))
            return views[c]

        for i in range(self.n):
            if not self.ready[i]:
                continue
            cards = tuple(view(c) for c in self.roles.cards_for(i)[1:] if self.ready[c])
            self.send(i, M.View(epoch=self.epochs.epoch, cards=cards))  # an unreachable lane's death is noticed

    def users(self, card: int) -> tuple[int, ...]:
        """Lanes computing from this card's cache, its own lane first."""
        if not self.ready[card]:
            return ()
        return (card,) + tuple(i for i in range(self.n) if i != card and self.ready[i]
                               and self.roles.busy[i] and card in self.roles.cards_for(i))

    def close(self) -> None:
        for s in self.counts:
            if s is not None:
                s.close()
