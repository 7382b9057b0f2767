"""Changing what the cards hold without any lane ever computing from a slot whose contents changed under it.

A change is one transition of two epochs:
1. revoke (epoch E): every live lane gets a View without the slots about to change and acknowledges it at a token
   boundary; until all have, nothing is overwritten;
2. load: each owner fills its changed slots, reports Loaded;
3. publish (epoch E+1): every lane gets a View with the new contents.
One transition at a time; a re-plan asked for meanwhile starts when this one ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.directory import Expert


@dataclass
class Transition:
    epoch: int
    target: list[list[Expert | None]]
    dirty: dict[int, list[tuple[int, int, int]]]  # card -> (slot, layer, expert)
    phase: str = "revoke"
    waiting: set[int] = field(default_factory=set)


class Epochs:
    def __init__(self, slots: list[int]):
        """slots: each card's slot count."""
        self.contents: list[list[Expert | None]] = [[None] * n for n in slots]
        self.epoch = 0
        self.t: Transition | None = None

    @property
    def busy(self) -> bool:
        return self.t is not None

    def visible(self) -> list[list[Expert | None]]:
        """What lanes may compute from now: during a transition, the slots being changed are hidden."""
        if self.t is None or self.t.phase == "publish":
            return self.contents
        out = [list(c) for c in self.contents]
        for card, slots in self.t.dirty.items():
            for slot, _, _ in slots:
                out[card][slot] = None
        return out

    def begin(self, target: list[list[Expert | None]], live: set[int]) -> str:
        """Start a transition; returns "revoke" (send Views, wait for acks) or "publish" (nothing to load)."""
        assert self.t is None
        dirty = {}
        for card, (old, new) in enumerate(zip(self.contents, target)):
            changed = [(s, *x) for s, (a, x) in enumerate(zip(old, new)) if a != x and x is not None]
            dropped = [s for s, (a, x) in enumerate(zip(old, new)) if a != x and x is None]
            for s in dropped:  # emptied slots need no load, only hiding
                self.contents[card][s] = None
            if changed and card in live:
                dirty[card] = changed
        self.epoch += 1
        if not dirty:
            self.t = None
            return "publish"
        self.t = Transition(self.epoch, target, dirty, waiting=set(live))
        return "revoke"

    def ack(self, lane: int, epoch: int) -> list[int] | None:
        """A lane acknowledged; returns the owners to send Load to once everyone has."""
        t = self.t
        if t is None or t.phase != "revoke" or epoch != t.epoch:
            return None
        t.waiting.discard(lane)
        return self._maybe_load()

    def _maybe_load(self) -> list[int] | None:
        t = self.t
        if t.waiting:
            return None
        t.phase, t.waiting = "load", set(t.dirty)
        return sorted(t.dirty)

    def loaded(self, lane: int, epoch: int) -> bool:
        """An owner filled its slots; True when the transition is complete (publish the new epoch)."""
        t = self.t
        if t is None or t.phase != "load" or epoch != t.epoch or lane not in t.waiting:
            return False
        t.waiting.discard(lane)
        for slot, layer, e in t.dirty[lane]:
            self.contents[lane][slot] = (layer, e)
        return self._maybe_publish()

    def _maybe_publish(self) -> bool:
        if self.t.waiting:
            return False
        self.epoch += 1
        self.t = None
        return True

    def hold(self, lane: int, held: list[Expert | None]) -> None:
        """A card that is not live holds `held`, one a slot in order, as many slots as it has (expert_cache = auto:
        what it had room for once ready; every expert's worth of empty slots once dead); no transition names it."""
        assert self.t is None or lane not in self.t.dirty
        self.contents[lane] = list(held)

    def lane_gone(self, lane: int) -> tuple[list[int] | None, bool]:
        """A lane died: its card holds nothing any more; it no longer blocks the transition.
        Returns (owners to Load now, or None; whether the transition completed)."""
        self.contents[lane] = [None] * len(self.contents[lane])
        t = self.t
        if t is None:
            return None, False
        t.dirty.pop(lane, None)
        t.waiting.discard(lane)
        if t.phase == "revoke":
            return self._maybe_load(), False
        return None, self._maybe_publish()
