"""Page-locked host buffers for a GPU card's KV exports (the kept sequence's new blocks copied out for the host
conversation cache), kept and reused.

An export of a 32K-token history is ~3 GB; page-locking that much anew holds the lane (it exports before taking its
next request) for about a second. CuPy's pinned pool would keep every freed buffer, but by exact size: exports of
other sizes neither reuse them nor give them back, so a long agent session would page-lock more and more host
memory. Here a buffer is rounded up to a granule, an export takes the smallest idle one that holds it, and at most
`keep` idle buffers stay (the largest); the others are freed.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable

import numpy as np


class ExportBuffers:
    def __init__(self, alloc: Callable[[int], Any], granule: int = 64 << 20, keep: int = 2):
        """alloc(nbytes): memory of at least nbytes with the buffer protocol (a GPU card: page-locked, freed when
        dropped)."""
        if granule < 1 or keep < 0:
            raise ValueError("granule must be positive and keep not negative")
        self._alloc, self.granule, self.keep = alloc, granule, keep
        self._idle: list[tuple[int, Any]] = []  # (capacity, memory), largest first
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype=np.uint8) -> tuple[np.ndarray, Callable[[], None]]:
        """An array of shape on a buffer, and the function that gives the buffer back: call it once nothing reads
        or writes the array any more (a second call does nothing)."""
        nbytes = max(1, math.prod(shape) * np.dtype(dtype).itemsize)
        with self._lock:
            fits = [i for i, (cap, _) in enumerate(self._idle) if cap >= nbytes]
            cap, mem = self._idle.pop(fits[-1]) if fits else (0, None)  # the smallest that holds it
        if mem is None:
            cap = -(-nbytes // self.granule) * self.granule
            mem = self._alloc(cap)
        given = []

        def give() -> None:
            if given:
                return
            given.append(True)
            with self._lock:
                self._idle.append((cap, mem))
                self._idle.sort(key=lambda e: -e[0])
                del self._idle[self.keep:]

        return np.ndarray(shape, dtype, buffer=mem), give

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(cap for cap, _ in self._idle)
