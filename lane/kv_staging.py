"""A GPU card's restore from the host conversation cache (stratad/kv_store.py): the store's slots are copied by a
few threads into page-locked staging, a chunk at a time, and each chunk goes to the card's caches while the next
is read. One thread copying the whole prompt into one buffer and then uploading it cost ~0.7 s for 32K tokens of
the a3b shape on the H200 host; this overlaps the reading with the upload and spreads it over cores. Staging is two
halves of CHUNK blocks, allocated once per block size, so no request pays for page-locking a prompt-sized buffer.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CHUNK_BYTES = 128 << 20  # a staging half (two of them, page-locked, per lane)
THREADS = 8


class KvStaging:
    """The staging halves, their upload events and the reading threads of one card."""

    def __init__(self, alloc=None):
        """alloc(shape, dtype): the staging's memory (default: page-locked, cupyx.empty_pinned)."""
        if alloc is None:
            import cupyx

            alloc = cupyx.empty_pinned
        self._alloc = alloc
        self._halves: dict[int, np.ndarray] = {}  # block bytes -> (2, chunk, block bytes) page-locked
        self._free = [None, None]  # each half's last upload (an event), None when it has none in flight
        self._pool = ThreadPoolExecutor(max_workers=min(THREADS, os.cpu_count() or 1), thread_name_prefix="kv-read")

    def halves(self, block_bytes: int) -> np.ndarray:
        if block_bytes not in self._halves:
            chunk = max(1, CHUNK_BYTES // block_bytes)
            self._halves = {block_bytes: self._alloc((2, chunk, block_bytes), np.uint8)}
        return self._halves[block_bytes]

    def restore(self, store, slots: list[int], block_bytes: int, upload) -> int:
        """Read the slots' blocks and hand each chunk to upload(staged rows, first block index, half) (which issues
        its copies on the card's stream and returns an event recorded after them; half: which staging half the rows
        are, reused once that event is reached), up to the first block taken for another one meanwhile. Returns how
        many were whole; their uploads are issued, not waited for."""
        halves = self.halves(block_bytes)
        chunk = halves.shape[1]
        done = 0
        for k, c0 in enumerate(range(0, len(slots), chunk)):
            half = k % 2
            if self._free[half] is not None:
                self._free[half].synchronize()  # its previous chunk is on the card
                self._free[half] = None
            part = slots[c0:c0 + chunk]
            snap = store.snapshot(part)
            rows = halves[half]
            list(self._pool.map(lambda i: _copy(store, part[i], rows[i]), range(len(snap))))
            whole = store.confirm(part, snap, first=c0)
            if whole:
                self._free[half] = upload(rows[:whole], c0, half)
            done = c0 + whole
            if whole < len(part):
                break
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._halves.clear()


def _copy(store, slot: int, row: np.ndarray) -> None:
    n = int(store.nbytes[slot])
    np.copyto(row[:n], store.data[slot, :n])  # numpy lets the GIL go for the copy: the threads run side by side


def record(stream):
    """An event recorded on stream now (what upload returns)."""
    import cupy

    ev = cupy.cuda.Event(disable_timing=True)
    ev.record(stream)
    return ev
