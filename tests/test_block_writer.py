"""The lane's background writer of KV blocks (lane/block_writer.py) on a real host cache: a submit returns while
an earlier write is still running (the lane serves its next request meanwhile), writes land in order, one export
waits at most, a failed write does not stop the next, and close lets the submitted writes land."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from lane.block_writer import BlockWriter
from stratad import kv_store, shm
from stratad.engine.card import KvExport
from stratad.engine.prefix_cache import BlockWrite

B = kv_store.BLOCK_TOKENS


@pytest.fixture
def store(tmp_path):
    name = kv_store.segment_name(shm.prefix_for(tmp_path))
    st = kv_store.KvStore(name, create=True, limit_bytes=16 * 256, slot_bytes=256, lane=0)
    yield st
    st.close()
    assert not shm.unlink(name)  # the creator unlinked it


def write_of(hashes, fill, gate: threading.Event | None = None) -> BlockWrite:
    """Blocks of bytes fill, fill + 1, ...; with gate, the export's copy ends only once the gate opens."""
    blocks = np.stack([np.full(256, fill + i, np.uint8) for i in range(len(hashes))])

    def wait():
        if gate is not None and not gate.wait(30):
            raise TimeoutError("the test's gate never opened")
    return BlockWrite(list(hashes), list(range(len(hashes))), KvExport(blocks, wait))


def read(store, hashes) -> list[int]:
    slots = store.find(hashes)
    out = np.zeros((len(slots), 256), np.uint8)
    store.read(slots, out)
    return [int(b[0]) for b in out]


def test_submits_return_while_a_write_runs_and_writes_land_in_order(store):
    h = kv_store.chain_hashes(list(range(9 * B)), "t")
    gate = threading.Event()
    w = BlockWriter(store, lane=0)
    try:
        w.submit(write_of(h[:3], 10, gate))  # its copy still running: held at the gate
        w.submit(write_of(h[3:6], 20))  # waits behind it; the lane is not held
        assert store.find(h) == [] and w.writing() == frozenset(h[:6])  # the lane's next export leaves them out
        third = threading.Thread(target=w.submit, args=(write_of(h[6:9], 30),))
        third.start()
        third.join(0.5)
        assert third.is_alive()  # a second export waiting already: this one waits for room
        gate.set()
        third.join(30)
        w.idle()
        assert read(store, h) == [10, 11, 12, 20, 21, 22, 30, 31, 32] and w.writing() == frozenset()
    finally:
        gate.set()
        w.close()


def test_a_failed_write_is_logged_and_the_next_lands(store, caplog):
    h = kv_store.chain_hashes(list(range(4 * B)), "t")
    w = BlockWriter(store, lane=3)
    bad = write_of(h[:2], 1)
    bad.export = KvExport(bad.export.blocks, lambda: (_ for _ in ()).throw(RuntimeError("copy failed")))
    w.submit(bad)
    w.submit(write_of(h[:2], 40))
    w.close()  # lets both land first
    assert read(store, h[:2]) == [40, 41] and w.writing() == frozenset()  # the failed write's blocks too
    assert "lane 3: writing KV blocks to the host cache failed" in caplog.text and "copy failed" in caplog.text
