"""The lane's background writer of KV blocks (lane/block_writer.py) on a real host cache: a submit returns while
an earlier write is still running (the lane serves its next request meanwhile), writes land in order, the exports
alive are bounded, a prompt waits for its own blocks still being written, a failed write does not stop the next,
and a stop drops the writes not yet begun."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from lane.block_writer import BlockWriter
from stratad import kv_store
from stratad.engine.card import KvExport
from stratad.engine.prefix_cache import BlockWrite

B = kv_store.BLOCK_TOKENS


@pytest.fixture
def store(host_cache):
    return host_cache(16)


def write_of(hashes, fill, gate: threading.Event | None = None, begun: threading.Event | None = None) -> BlockWrite:
    """Blocks of bytes fill, fill + 1, ...; with gate, the export's copy ends only once the gate opens (begun: set
    when the write starts waiting for it)."""
    blocks = np.stack([np.full(256, fill + i, np.uint8) for i in range(len(hashes))])

    def wait():
        if begun is not None:
            begun.set()
        if gate is not None and not gate.wait(30):
            raise TimeoutError("the test's gate never opened")
    return BlockWrite(list(hashes), list(range(len(hashes))), KvExport(blocks, wait))


def submit(w: BlockWriter, job: BlockWrite) -> None:
    with w.room() as put:
        put(job)


def read(store, hashes) -> list[int]:
    slots = store.find(hashes)
    out = np.zeros((len(slots), 256), np.uint8)
    store.read(slots, out)
    return [int(b[0]) for b in out]


def in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    t.join(0.5)
    return t


def test_submits_return_while_a_write_runs_and_writes_land_in_order(store):
    h = kv_store.chain_hashes(list(range(9 * B)), "t")
    gate = threading.Event()
    w = BlockWriter(store, lane=0)
    try:
        submit(w, write_of(h[:3], 10, gate))  # its copy still running: held at the gate
        submit(w, write_of(h[3:6], 20))  # waits behind it; the lane is not held
        assert store.present(h) == {} and w.writing() == frozenset(h[:6])  # the next export leaves them out
        third = in_thread(submit, w, write_of(h[6:9], 30))
        assert third.is_alive()  # two exports alive already: the third waits for room
        gate.set()
        third.join(30)
        w.idle()
        assert read(store, h) == [10, 11, 12, 20, 21, 22, 30, 31, 32] and w.writing() == frozenset()
        with w.room():  # room taken and given back without a write
            pass
        with w.room(), w.room():
            pass
    finally:
        gate.set()
        w.close()


def test_a_prompt_waits_for_its_blocks_still_being_written(store):
    h = kv_store.chain_hashes(list(range(4 * B)), "t")
    other = kv_store.chain_hashes([5] * (2 * B), "t")
    gate = threading.Event()
    w = BlockWriter(store, lane=0)
    try:
        submit(w, write_of(h[:2], 1, gate))
        w.wait_for(other)  # none of its blocks is being written: at once
        waiter = in_thread(w.wait_for, h)
        assert waiter.is_alive()
        gate.set()
        waiter.join(30)
        assert not waiter.is_alive() and read(store, h) == [1, 2]
    finally:
        gate.set()
        w.close()


def test_a_failed_write_is_logged_and_the_next_lands(store, caplog):
    h = kv_store.chain_hashes(list(range(4 * B)), "t")
    w = BlockWriter(store, lane=3)
    bad = write_of(h[:2], 1)
    bad.export = KvExport(bad.export.blocks, lambda: (_ for _ in ()).throw(RuntimeError("copy failed")))
    submit(w, bad)
    submit(w, write_of(h[:2], 40))
    w.close()  # lets both land first
    assert read(store, h[:2]) == [40, 41] and w.writing() == frozenset()  # the failed write's blocks too
    assert "lane 3: writing KV blocks to the host cache failed" in caplog.text and "copy failed" in caplog.text


def test_a_stop_drops_the_writes_not_yet_begun(store):
    h = kv_store.chain_hashes(list(range(4 * B)), "t")
    gate, begun = threading.Event(), threading.Event()
    w = BlockWriter(store, lane=0)
    submit(w, write_of(h[:2], 1, gate, begun))
    submit(w, write_of(h[2:], 3))
    assert begun.wait(30)
    closing = in_thread(w.close, True)
    assert closing.is_alive()  # the write under way lands
    gate.set()
    closing.join(30)
    assert not closing.is_alive() and read(store, h) == [1, 2] and w.writing() == frozenset()


def test_a_write_whose_parent_is_not_in_the_cache_is_skipped(store):
    """Its blocks could not be reached by any lookup (which walks a chain from its start): not written until the
    parent is there."""
    h = kv_store.chain_hashes(list(range(4 * B)), "t")
    w = BlockWriter(store, lane=0)
    try:
        child = write_of(h[2:], 30)
        child.parent = h[1]
        submit(w, child)
        w.idle()
        assert store.present(h) == {}
        submit(w, write_of(h[:2], 10))
        child = write_of(h[2:], 30)
        child.parent = h[1]
        submit(w, child)
        w.idle()
        assert read(store, h) == [10, 11, 30, 31]
    finally:
        w.close()


def test_a_landed_write_lets_its_rows_go(store):
    """Once a write has landed (or was skipped, or failed) nothing holds its exported rows, the writer's loop
    waiting for the next job included: a GPU card's next export of that size can reuse the page-locked buffer
    (page-locking a 32K-token history's ~3 GB anew holds the lane: the likely cause of a 1.45 s wait in session
    25's agents run)."""
    import gc
    import weakref

    h = kv_store.chain_hashes(list(range(6 * B)), "t")
    w = BlockWriter(store, lane=0)
    try:
        skipped = write_of(h[4:], 50)
        skipped.parent = b"\0" * 32  # not in the cache
        failed = write_of(h[2:4], 30)
        failed.export = KvExport(failed.export.blocks, lambda: (_ for _ in ()).throw(RuntimeError("copy failed")))
        jobs = [write_of(h[:2], 10), skipped, failed]
        rows = [weakref.ref(j.export.blocks) for j in jobs]
        for j in jobs:
            submit(w, j)
        w.idle()
        gc.collect()
        assert all(r() is None for r in rows) and all(j.export is None for j in jobs)
        assert read(store, h[:2]) == [10, 11]
    finally:
        w.close()
