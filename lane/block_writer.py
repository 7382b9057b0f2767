"""A lane's writes of its sequences' new KV blocks to the host conversation cache, on one thread of their own.

After each request (its Done sent) the lane exports the kept sequence's blocks the cache lacks and hands them
here: the lane takes its next request at once, whatever the write still has to do (a 32K-token history is
gigabytes). Writes land in the order given, so a block's parent is in the cache before it. An export holds its
blocks in host memory until written: `room()` admits one while at most `pending` others are waiting or being
written, else it waits (only back-to-back long prompts on one lane get there).

The blocks of writes not yet landed are `writing()`: the next export leaves them out (copied from the card twice,
the claim would skip them anyway). A request whose prompt needs some of them waits for those writes first
(`wait_for`), so it restores them rather than reading them again. Should such a write fail, its blocks are left to
a later export; a write whose chain's parent is not in the cache then is skipped (BlockWrite.write: the cache's
lookups walk a chain from its start, so no lookup could reach its blocks).
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Callable, Iterator

from stratad.engine.prefix_cache import BlockWrite
from stratad.kv_store import KvStore

log = logging.getLogger("stratad.lane")


class BlockWriter:
    def __init__(self, store: KvStore, lane: int, pending: int = 1):
        self.store, self.lane = store, lane
        self._room = threading.Semaphore(pending + 1)  # exports alive: the one being written and those waiting
        self._jobs: queue.Queue[BlockWrite | None] = queue.Queue()
        self._changed = threading.Condition()
        self._writing: dict[bytes, int] = {}  # a submitted block's hash -> writes of it not yet landed
        self._thread = threading.Thread(target=self._run, name=f"lane{lane}-kv-writer", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def room(self) -> Iterator[Callable[[BlockWrite], None]]:
        """Room for one more export (waits while `pending` + 1 are alive); yields submit, which queues the write
        made inside (not calling it gives the room back)."""
        self._room.acquire()
        submitted = False

        def submit(w: BlockWrite) -> None:
            nonlocal submitted
            self._count(w, 1)
            submitted = True
            self._jobs.put(w)
        try:
            yield submit
        finally:
            if not submitted:
                self._room.release()

    def writing(self) -> frozenset[bytes]:
        """The hashes of the blocks submitted and not yet landed (or failed)."""
        with self._changed:
            return frozenset(self._writing)

    def wait_for(self, hashes: list[bytes]) -> None:
        """Until none of these blocks is still being written."""
        with self._changed:
            self._changed.wait_for(lambda: not any(h in self._writing for h in hashes))

    def idle(self) -> None:
        """Until every write submitted so far has landed (or failed)."""
        self._jobs.join()

    def close(self, drop: bool = False) -> None:
        """The thread ends once the writes submitted so far have landed; drop: those not yet begun are dropped (the
        daemon is stopping and its cache goes with it)."""
        if drop:
            while True:
                try:
                    w = self._jobs.get_nowait()
                except queue.Empty:
                    break
                self._done(w)
        self._jobs.put(None)
        self._thread.join()

    def _count(self, w: BlockWrite, d: int) -> None:
        with self._changed:
            for h in w.hashes:
                n = self._writing.get(h, 0) + d
                if n:
                    self._writing[h] = n
                else:
                    del self._writing[h]
            self._changed.notify_all()

    def _done(self, w: BlockWrite | None) -> None:
        if w is not None:
            try:
                w.release()  # whatever still refers to w (the loop's variable, a logged traceback) holds no rows
            except Exception:  # noqa: BLE001 - a failed copy: its rows are dropped, not given back for reuse
                log.exception("lane %d: an exported KV copy failed", self.lane)
            self._count(w, -1)
            self._room.release()
        self._jobs.task_done()

    def _run(self) -> None:
        while True:
            w = self._jobs.get()
            try:
                if w is None:
                    return
                w.write(self.store)
            except Exception:  # noqa: BLE001 - the cache is an optimisation: serving goes on without this write
                log.exception("lane %d: writing KV blocks to the host cache failed", self.lane)
            finally:
                self._done(w)
