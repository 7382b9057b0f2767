"""Where a lane's expert work ran: its own card, each peer card, or from host memory (the CPU pool, or the card
reading the arena)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    card: int = 0
    peer: int = 0
    cpu: int = 0
    by_peer: dict[int, int] = field(default_factory=dict)  # card -> experts computed there
    staged: int = 0  # expert copies made to the card for prompt chunks (their computations count as card)
    host_read: int = 0  # of cpu: computed by the card reading the weights from host memory (zero-copy)

    def add(self, other: "Counters") -> None:
        self.card += other.card
        self.peer += other.peer
        self.cpu += other.cpu
        self.staged += other.staged
        self.host_read += other.host_read
        for c, n in other.by_peer.items():
            self.by_peer[c] = self.by_peer.get(c, 0) + n

    def minus(self, before: "Counters") -> "Counters":
        return Counters(self.card - before.card, self.peer - before.peer, self.cpu - before.cpu,
                        {c: n - before.by_peer.get(c, 0) for c, n in self.by_peer.items()}, self.staged - before.staged,
                        self.host_read - before.host_read)

    def copy(self) -> "Counters":
        return Counters(self.card, self.peer, self.cpu, dict(self.by_peer), self.staged, self.host_read)

    @property
    def total(self) -> int:
        return self.card + self.peer + self.cpu

    def shares(self) -> tuple[float, float, float]:
        t = self.total or 1
        return self.card / t, self.peer / t, self.cpu / t
