"""A lane's writes of its sequences' new KV blocks to the host conversation cache, on one thread of their own.

After each request (its Done sent) the lane exports the kept sequence's blocks the cache lacks and hands them
here: the lane takes its next request at once, whatever the write still has to do (a 32K-token history is
gigabytes). Writes land in the order given, so a block's parent is in the cache before it. At most `pending`
exports wait behind the one being written (each holds its blocks in host memory); a further submit waits for
room, which only back-to-back long prompts on one lane reach. The blocks of writes not yet landed are `writing()`:
the next export leaves them out (they would be copied from the card twice, and the claim would skip them anyway).
"""
from __future__ import annotations

import logging
import queue
import threading

from stratad.engine.prefix_cache import BlockWrite
from stratad.kv_store import KvStore

log = logging.getLogger("stratad.lane")


class BlockWriter:
    def __init__(self, store: KvStore, lane: int, pending: int = 1):
        self.store, self.lane = store, lane
        self._jobs: queue.Queue[BlockWrite | None] = queue.Queue(maxsize=pending)
        self._lock = threading.Lock()
        self._writing: dict[bytes, int] = {}  # a submitted block's hash -> writes of it not yet landed
        self._thread = threading.Thread(target=self._run, name=f"lane{lane}-kv-writer", daemon=True)
        self._thread.start()

    def submit(self, w: BlockWrite) -> None:
        self._count(w, 1)
        self._jobs.put(w)

    def writing(self) -> frozenset[bytes]:
        """The hashes of the blocks submitted and not yet landed (or failed)."""
        with self._lock:
            return frozenset(self._writing)

    def _count(self, w: BlockWrite, d: int) -> None:
        with self._lock:
            for h in w.hashes:
                n = self._writing.get(h, 0) + d
                if n:
                    self._writing[h] = n
                else:
                    del self._writing[h]

    def idle(self) -> None:
        """Until every write submitted so far has landed (or failed)."""
        self._jobs.join()

    def close(self) -> None:
        """The writes submitted so far land, then the thread ends."""
        self._jobs.put(None)
        self._thread.join()

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
                if w is not None:
                    self._count(w, -1)
                self._jobs.task_done()
