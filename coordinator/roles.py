"""Lane roles, split and rejoin: which lanes form a group whose cards pool their expert caches.

A group is a set of lanes whose cards hold one deduplicated expert pool. Without mutual help a group serves at
most one sequence: its busy lane is the `lead` (or `solo` when alone), the others are its `peer`s. A second
request *splits* a peer off into a group of its own; a lane left idle for `rejoin_idle_s` *rejoins* the group of a
busy lane. With mutual help all lanes stay in one group and every busy lane is `mutual` (lead when it is the only
one). Pure logic: the coordinator applies what it returns.
"""
from __future__ import annotations

import time

from protos.messages import Role


class Roles:
    def __init__(self, n_lanes: int, mutual_help: bool, rejoin_idle_s: float):
        self.n, self.mutual, self.rejoin_idle_s = n_lanes, mutual_help, rejoin_idle_s
        self.group = [0] * n_lanes  # everyone starts pooled: idle cards lend to whoever comes first
        self.busy = [False] * n_lanes
        self.idle_since = [time.monotonic()] * n_lanes
        self.down = [False] * n_lanes

    # ---- queries --------------------------------------------------------------------------------------------
    def members(self, g: int) -> list[int]:
        return [i for i in range(self.n) if self.group[i] == g and not self.down[i]]

    def groups(self) -> list[list[int]]:
        return [m for g in sorted(set(self.group)) if (m := self.members(g))]

    def role(self, i: int) -> Role:
        if self.down[i]:
            return Role.DOWN
        mates = self.members(self.group[i])
        busy = [j for j in mates if self.busy[j]]
        if not self.busy[i]:
            return Role.PEER if len(mates) > 1 else Role.SOLO
        if len(mates) == 1:
            return Role.SOLO
        return Role.MUTUAL if len(busy) > 1 else Role.LEAD

    def cards_for(self, i: int) -> list[int]:
        """The cards whose caches lane i computes from (its own first)."""
        return [i] + [j for j in self.members(self.group[i]) if j != i]

    # ---- events ---------------------------------------------------------------------------------------------
    def pick_lane(self, free: list[int]) -> int | None:
        """Of the free lanes, the one for a new request, preferring one that splits nothing: an idle lane alone in
        its group (warm for its own traffic), then an idle lane of an idle group, then a peer split off a busy
        group."""
        free = [i for i in free if not self.busy[i] and not self.down[i]]
        if not free:
            return None
        if self.mutual:
            return free[0]

        def busy_in(i):
            return any(self.busy[j] for j in self.members(self.group[i]))

        alone = [i for i in free if len(self.members(self.group[i])) == 1]
        if alone:
            return alone[0]
        idle_group = [i for i in free if not busy_in(i)]
        if idle_group:
            return idle_group[0]
        # split: take a peer from the group with the most cards
        return max(free, key=lambda i: (len(self.members(self.group[i])), -i))

    def start(self, i: int) -> None:
        """Lane i takes a request (split off its group if that group already serves one)."""
        if not self.mutual and any(self.busy[j] for j in self.members(self.group[i]) if j != i):
            self.group[i] = self._new_group_id()
        self.busy[i] = True

    def finish(self, i: int) -> None:
        self.busy[i] = False
        self.idle_since[i] = time.monotonic()

    def lane_down(self, i: int) -> None:
        self.down[i], self.busy[i] = True, False

    def lane_up(self, i: int) -> None:
        """A restarted lane comes back alone and idle; rejoin brings it back into a group later."""
        self.down[i] = False
        self.busy[i] = False
        if not self.mutual:
            self.group[i] = self._new_group_id()
        self.idle_since[i] = time.monotonic()

    def rejoin_due(self, now: float | None = None) -> bool:
        """Idle lanes alone in their group for rejoin_idle_s join a busy group (the one with the fewest cards per
        busy lane), or, with nobody busy, all idle lanes pool together. True when anything changed."""
        if self.mutual:
            return False
        now = time.monotonic() if now is None else now
        changed = False
        for i in range(self.n):
            if self.down[i] or self.busy[i] or len(self.members(self.group[i])) > 1:
                continue
            if now - self.idle_since[i] < self.rejoin_idle_s:
                continue
            busy_groups = [g for g in set(self.group) if any(self.busy[j] for j in self.members(g))]
            if busy_groups:
                target = min(busy_groups, key=lambda g: (len(self.members(g)), g))
            else:
                others = [g for g in set(self.group) if g != self.group[i] and self.members(g)]
                if not others:
                    continue
                target = min(others)
            self.group[i] = target
            changed = True
        return changed

    def _new_group_id(self) -> int:
        return max(self.group) + 1
