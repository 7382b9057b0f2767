"""Background slot loads: the old occupant is dropped at once, the new one lands only after its bytes are in, each
epoch is reported once, and a failed copy stops the lane rather than handing out a bad slot."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lane.slot_loader import SlotLoader
from lane.slot_pool import SlotPool, host_write
from stratad.model.slot_layout import expert_bytes, slot_bytes


def pool_of(model, n: int, write=None) -> SlotPool:
    kw = {} if write is None else {"write": write}
    return SlotPool(model, np.zeros(n * slot_bytes(model), np.uint8), n, **kw)


def wait_landed(loader: SlotLoader, timeout_s: float = 10.0) -> list[int]:
    out, t0 = [], time.monotonic()
    while loader.busy and time.monotonic() - t0 < timeout_s:
        out += loader.landed()
        time.sleep(0.001)
    return out


def test_loads_land_after_their_bytes(tiny_model):
    gate = threading.Event()

    def slow_write(dst, parts):  # the copy waits until the test lets it go
        gate.wait(10)
        host_write(dst, parts)

    pool = pool_of(tiny_model, 4, slow_write)
    gate.set()
    pool.fill([(0, 0), (0, 1), (1, 0), (1, 1)])
    gate.clear()
    loader = SlotLoader(pool)
    try:
        v0 = pool.version
        loader.begin(7, [(1, 0, 5), (2, 1, 6)])
        assert pool.table[0, 1] == -1 and pool.table[1, 0] == -1  # dropped at once: nothing computes from them
        assert pool.version > v0
        assert loader.landed() == [] and pool.table[0, 5] == -1  # not landed while the copy waits
        gate.set()
        assert wait_landed(loader) == [7]
        assert pool.table[0, 5] == 1 and pool.table[1, 6] == 2 and pool.table[0, 0] == 0
        raw = np.concatenate([p.reshape(-1) for p in expert_bytes(tiny_model, 1, 6)])
        assert np.array_equal(pool.data[2, :raw.size], raw)
        loader.begin(8, [])  # an epoch with nothing for this card is still reported
        assert wait_landed(loader) == [8] or loader.landed() == [8]
    finally:
        gate.set()
        loader.close()


def test_a_failed_copy_is_an_error(tiny_model):
    def broken(dst, parts):
        raise OSError("device lost")

    pool = pool_of(tiny_model, 2)
    pool.fill([(0, 0), (0, 1)])
    pool.write = broken
    loader = SlotLoader(pool)
    try:
        loader.begin(3, [(0, 1, 2)])
        with pytest.raises(RuntimeError, match="device lost"):
            for _ in range(1000):
                loader.landed()
                time.sleep(0.005)
        assert pool.table[1, 2] == -1 and pool.table[0, 0] == -1
    finally:
        loader.close()
