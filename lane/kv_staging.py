"""A GPU card's restore from the host conversation cache (stratad/kv_store.py) where the card could not page-lock
the store itself (CupyCard.pin_store; then it copies from the store's pages directly): the store's slots are copied
by a few threads into page-locked staging, a chunk at a time, and each chunk goes to the card's caches while the next
is read. One thread copying the whole prompt into one buffer and then uploading it cost ~0.7 s for 32K tokens of
the a3b shape on the H200 host; this overlaps the reading with the upload and spreads it over cores. Staging is two
halves of CHUNK blocks, allocated once per block size, so no request pays for page-locking a prompt-sized buffer.

A staging half is written again only once its last upload's event is reached and every reading thread has ended
its copy, and is never dropped (a new block size) with an upload from it in flight; a restore returns, or raises,
only once every upload it issued is done, so that a failed one leaves nothing running into the staging or the KV.
Its host side (reading, chunking, the halves' reuse, the failures) is tested on the CPU with a stand-in upload
(tests/test_kv_staging.py), the card's copies on a GPU by tests/test_gpu_kv_restore.py.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

CHUNK_BYTES = 128 << 20  # a staging half (two of them, page-locked, per lane)
THREADS = 8
log = logging.getLogger("stratad.lane")


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
            self.wait()  # the halves about to be dropped (another block size) may still be read by an upload
            self._halves = {}  # dropped before the new ones are allocated: never both at once
            chunk = max(1, CHUNK_BYTES // block_bytes)
            self._halves = {block_bytes: self._alloc((2, chunk, block_bytes), np.uint8)}
        return self._halves[block_bytes]

    def wait(self) -> None:
        """Return once no upload from the staging is in flight. An event whose wait raised (the device failed) is
        kept: the half it guards is never written again nor dropped, and the next wait raises too."""
        for half, ev in enumerate(self._free):
            if ev is not None:
                ev.synchronize()
                self._free[half] = None

    def restore(self, store, slots: list[int], block_bytes: int, upload, hashes: list[bytes] | None = None) -> int:
        """Read the slots' blocks and hand each chunk to upload(staged rows, first block index, half), which issues
        its copies on the card's stream and returns an event recorded after them (half: the staging half the rows
        are in, written again once that event is reached), up to the first block that is not whole: one taken for
        another block since the restore began (hashes: the blocks the slots must hold, find()'s; without them a
        slot's block when the restore began), or one the store failed to give (an exception reading it: logged,
        the prompt is read from there). Returns how many blocks were handed over, in order from slots[0], once
        every upload is done. An exception from upload (the card's) is raised once every upload that returned is
        done (one that raises must itself leave nothing running from its rows: the card synchronises its stream);
        no reading thread is left writing the staging either way."""
        halves = self.halves(block_bytes)
        chunk = halves.shape[1]
        done = 0
        try:
            try:
                # every slot's sequence number and hash now, before any is read: a slot taken for another block
                # later, even one published whole again before its chunk's turn, no longer matches
                snap = store.snapshot(slots, hashes)
            except Exception:  # noqa: BLE001 - the cache is an optimisation: the prompt is read
                log.exception("reading the host conversation cache failed: the prompt is read instead")
                snap = ()
            for k, c0 in enumerate(range(0, len(snap), chunk)):
                half = k % 2
                if self._free[half] is not None:
                    self._free[half].synchronize()  # its previous chunk is on the card
                    self._free[half] = None
                part, rows = slots[c0:min(c0 + chunk, len(snap))], halves[half]
                try:
                    whole = self._read(store, part, snap.part(c0, c0 + len(part)), rows, c0)
                except Exception:  # noqa: BLE001 - the cache is an optimisation: the prompt's rest is read
                    log.exception("reading the host conversation cache failed at block %d of %d: the prompt is "
                                  "read from there", c0, len(slots))
                    break
                if whole:
                    self._free[half] = upload(rows[:whole], c0, half)
                done = c0 + whole
                if whole < len(part):
                    break
        except BaseException:
            self._wait_quietly()
            raise
        self.wait()
        return done

    def _read(self, store, part: list[int], snap, rows: np.ndarray, first: int) -> int:
        """The slots' blocks into rows by the threads; how many were whole (confirmed). Returns, or raises the
        first thread's error, only once every copy has ended: a thread still copying would write over the half's
        next chunk."""
        futures = [self._pool.submit(_copy, store, s, rows[i]) for i, s in enumerate(part)]
        wait(futures)
        for f in futures:
            f.result()
        return store.confirm(part, snap, first=first)

    def _wait_quietly(self) -> None:
        """wait() on the way out of a failed restore: the restore's own error is the one raised."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001
            log.exception("waiting for the KV uploads of a failed restore failed too")

    def close(self) -> None:
        """Waits for the uploads in flight before the staging goes (where that wait fails, the device has: the
        halves stay with this object rather than go back to the pinned pool while a copy may read them)."""
        self._pool.shutdown(wait=True)
        try:
            self.wait()
        except Exception:  # noqa: BLE001
            log.exception("waiting for the KV uploads in flight failed: their staging is not freed")
            return
        self._halves.clear()


def _copy(store, slot: int, row: np.ndarray) -> None:
    # at most a row: a slot taken meanwhile for a larger block (a CPU card's, where both kinds serve) is cut here
    # and found not whole by confirm(), rather than failing the copy
    n = min(int(store.nbytes[slot]), row.size)
    np.copyto(row[:n], store.data[slot, :n])  # numpy lets the GIL go for the copy: the threads run side by side


def record(stream):
    """An event recorded on stream now (what upload returns)."""
    import cupy

    ev = cupy.cuda.Event(disable_timing=True)
    ev.record(stream)
    return ev
