"""lane/kv_staging.py on the CPU (host buffers instead of page-locked ones, an upload that records what it was
given): chunking, the order of blocks, each half reused only after its upload is done, and a block taken for another
one meanwhile ending the restore there. The GPU card's use of it: tests/test_gpu_card.py."""
from __future__ import annotations

import os

import numpy as np
import pytest

from lane import kv_staging
from stratad import kv_store, shm

BB = 64  # block bytes


class Event:
    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True


@pytest.fixture
def store():
    name = f"/stratad-test-{os.getpid()}-staging"
    st = kv_store.KvStore(name, create=True, limit_bytes=16 * BB, slot_bytes=BB, lane=0)
    yield st
    st.close()
    shm.unlink(name)


def publish(st, n):
    hashes = [bytes([i + 1]) * 32 for i in range(n)]
    for h, slot in st.claim(hashes):
        st.publish(slot, h, np.full(BB, hashes.index(h) + 1, np.uint8))
    return st.find(hashes)


@pytest.mark.parametrize("n", [1, 5, 6, 7])
def test_chunks_in_order_and_halves_reused_after_their_upload(store, monkeypatch, n):
    monkeypatch.setattr(kv_staging, "CHUNK_BYTES", 2 * BB)
    slots = publish(store, n)
    got, events = [], []

    def upload(rows, first, half):
        assert half == len(events) % 2
        for ev in events[-2:-1]:  # the half this chunk used was last uploaded two chunks ago
            assert ev.waited
        got.append((first, rows[:, 0].tolist()))
        events.append(Event())
        return events[-1]

    staging = kv_staging.KvStaging(alloc=np.empty)
    assert staging.restore(store, slots, BB, upload) == n
    assert [f for f, _ in got] == list(range(0, n, 2))
    assert sum((v for _, v in got), []) == list(range(1, n + 1))
    staging.close()


def test_a_block_taken_meanwhile_ends_the_restore(store, monkeypatch):
    monkeypatch.setattr(kv_staging, "CHUNK_BYTES", 2 * BB)
    slots = publish(store, 6)
    store.state[slots[3]] = kv_store.WRITING
    seen = []
    staging = kv_staging.KvStaging(alloc=np.empty)
    assert staging.restore(store, slots, BB, lambda rows, first, half: seen.append((first, len(rows))) or Event()) == 3
    assert seen == [(0, 2), (2, 1)]
    store.state[slots[0]] = kv_store.WRITING
    assert staging.restore(store, slots, BB, lambda rows, first, half: pytest.fail("nothing is whole")) == 0
    staging.close()
