"""Slot changes in the background: a lane keeps decoding while its cache is refilled.

The coordinator's Load (an epoch's slots for this card) arrives between tokens. begin() drops the slots' old
occupants from the table at once (nothing computes from a slot being overwritten: its experts run on another card
or the CPU until the new bytes land) and hands the copies to a worker thread; landed() — called between tokens —
puts the finished copies in the table (the card uses them from its next step) and returns the epochs whose slots
have all landed, so that the lane can report Loaded.
"""
from __future__ import annotations

import queue
import threading

from lane.slot_pool import SlotPool


class SlotLoader:
    def __init__(self, pool: SlotPool):
        self.pool = pool
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._pending: dict[int, int] = {}  # epoch -> slots not yet landed
        self._thread = threading.Thread(target=self._work, name="slot-loader", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def begin(self, epoch: int, slots) -> None:
        slots = list(slots)
        for slot, _, _ in slots:
            self.pool.drop(slot)
        self._pending[epoch] = self._pending.get(epoch, 0) + len(slots)
        for job in slots:
            self._todo.put((epoch, *job))
        if not slots:
            self._done.put((epoch, None, None, None, None))

    def landed(self) -> list[int]:
        finished = []
        while True:
            try:
                epoch, slot, layer, e, err = self._done.get_nowait()
            except queue.Empty:
                return finished
            if slot is not None:
                if err is not None:  # the coordinator would hand this slot to other lanes: stop here instead
                    raise RuntimeError(f"slot {slot}: loading expert ({layer}, {e}) failed: {err}")
                self.pool.land(slot, layer, e)
                self._pending[epoch] -= 1
            if self._pending.get(epoch, 0) == 0:
                self._pending.pop(epoch, None)
                finished.append(epoch)

    def _work(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            epoch, slot, layer, e = job
            err = None
            try:
                self.pool.write_bytes(slot, layer, e)
            except Exception as ex:  # noqa: BLE001 - reported by landed(), on the lane's thread
                err = repr(ex)
            self._done.put((epoch, slot, layer, e, err))

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=30)
