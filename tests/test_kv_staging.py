"""lane/kv_staging.py on the CPU (host buffers instead of page-locked ones, an upload that records what it was
given): chunking, the order of blocks, each half reused only after its upload is done, and a restore that meets a
block rewritten while it is read, a store that fails or an upload that fails: the blocks handed over are the store's
bit for bit, and nothing (no upload, no reading thread) is left running when it returns or raises. The numpy card's
restore (its import_kv_from) and the prefix cache's fallback to reading the prompt, through the real tiny model. The
store is always a real KvStore in shared memory; another lane's rewrite is its real claim() and publish(). The GPU
card's use of the staging: tests/test_gpu_card.py."""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from lane import kv_staging
from stratad import kv_store, shm
from stratad.engine.generation import Generation
from stratad.engine.prefix_cache import PrefixCache
from stratad.engine.sampling import SamplingParams

BB = 64  # block bytes
B = kv_store.BLOCK_TOKENS


class Event:
    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True


def make_store(name, n_slots, slot_bytes):
    return kv_store.KvStore(name, create=True, limit_bytes=n_slots * slot_bytes, slot_bytes=slot_bytes, lane=0)


@pytest.fixture
def store():
    name = f"/stratad-test-{os.getpid()}-staging"
    st = make_store(name, 16, BB)
    yield st
    st.close()
    shm.unlink(name)


@pytest.fixture
def full_store():
    """Exactly 6 slots of twice the blocks' size: another lane's claim() evicts one of the chain's (the least
    recently used), and may publish a block larger than the restored ones (a CPU card's, where both kinds serve)."""
    name = f"/stratad-test-{os.getpid()}-staging-full"
    st = make_store(name, 6, 2 * BB)
    yield st
    st.close()
    shm.unlink(name)


def publish(st, n):
    hashes = [bytes([i + 1]) * 32 for i in range(n)]
    for h, slot in st.claim(hashes):
        st.publish(slot, h, np.full(BB, hashes.index(h) + 1, np.uint8))
    return st.find(hashes), hashes


def take_for_another(st, slot, nbytes=BB, value=99):
    """Another lane evicting `slot` for a block of its own and publishing it whole (claim() picks the least recently
    used READY slot: every other one is touched first)."""
    st.touch([s for s in range(st.n_slots) if s != slot])
    (h, got), = st.claim([bytes([value]) * 32])
    assert got == slot
    st.publish(got, h, np.full(nbytes, value, np.uint8))


class Uploads:
    """The stand-in upload: what each chunk held (its rows copied: the half is written again later), the events
    returned, and whether any was left unwaited when the restore returned."""

    def __init__(self, fail_at: int | None = None, then=None):
        self.chunks, self.events, self.fail_at, self.then = [], [], fail_at, then

    def __call__(self, rows, first, half):
        assert half == len(self.events) % 2
        for ev in self.events[-2:-1]:  # the half this chunk uses was last uploaded two chunks ago
            assert ev.waited
        if first == self.fail_at:
            raise RuntimeError("the card failed")
        self.chunks.append((first, rows.copy()))
        self.events.append(Event())
        if self.then is not None:
            self.then(first)
        return self.events[-1]

    def blocks(self):
        return np.concatenate([r for _, r in self.chunks]) if self.chunks else np.zeros((0, BB), np.uint8)

    def all_waited(self):
        return all(ev.waited for ev in self.events)


@pytest.fixture
def chunks_of_two(monkeypatch):
    monkeypatch.setattr(kv_staging, "CHUNK_BYTES", 2 * BB)


@pytest.mark.parametrize("n", [1, 5, 6, 7])
def test_chunks_in_order_and_halves_reused_after_their_upload(store, chunks_of_two, n):
    slots, _ = publish(store, n)
    up = Uploads()
    staging = kv_staging.KvStaging(alloc=np.empty)
    assert staging.restore(store, slots, BB, up) == n
    assert [f for f, _ in up.chunks] == list(range(0, n, 2))
    assert (up.blocks() == np.arange(1, n + 1, dtype=np.uint8)[:, None]).all()  # every byte of every block
    assert up.all_waited()  # restore returns with no upload in flight
    staging.close()


def test_a_block_taken_meanwhile_ends_the_restore(store, chunks_of_two):
    slots, _ = publish(store, 6)
    store.state[slots[3]] = kv_store.WRITING
    seen = []
    staging = kv_staging.KvStaging(alloc=np.empty)
    assert staging.restore(store, slots, BB, lambda rows, first, half: seen.append((first, len(rows))) or Event()) == 3
    assert seen == [(0, 2), (2, 1)]
    store.state[slots[0]] = kv_store.WRITING
    assert staging.restore(store, slots, BB, lambda rows, first, half: pytest.fail("nothing is whole")) == 0
    staging.close()


@pytest.mark.parametrize("at", [2, 3, 5])
@pytest.mark.parametrize("nbytes", [BB, 2 * BB])
def test_a_block_rewritten_while_a_thread_reads_it(full_store, chunks_of_two, monkeypatch, at, nbytes):
    """Another lane evicts block `at`'s slot and publishes its own block in it after the restore's snapshot, just
    before a reading thread copies it (so the copy reads the other block's bytes; nbytes 2 * BB: a block larger than
    the staging's rows, which failed the copy with a ValueError): the restore ends before it, the blocks handed
    over are the store's, and every upload is done."""
    st = full_store
    slots, _ = publish(st, 6)
    real, fired = kv_staging._copy, []

    def copy(store, slot, row):
        if slot == slots[at] and not fired:
            fired.append(True)
            take_for_another(store, slot, nbytes)
        real(store, slot, row)

    monkeypatch.setattr(kv_staging, "_copy", copy)
    up = Uploads()
    staging = kv_staging.KvStaging(alloc=np.empty)
    assert staging.restore(st, slots, BB, up) == at and fired
    assert (up.blocks() == np.arange(1, at + 1, dtype=np.uint8)[:, None]).all()
    assert up.all_waited()
    staging.close()


@pytest.mark.parametrize("with_hashes", [False, True])
def test_a_block_published_again_before_its_chunks_turn(full_store, chunks_of_two, with_hashes):
    """Block 3's slot is evicted and another block published in it whole while chunk 0 uploads, before chunk 1 is
    read: the restore's one snapshot (taken before any chunk) sees the slot changed (each chunk's own snapshot took
    the other block for block 3). With find()'s hashes a swap between find() and the restore is caught too."""
    st = full_store
    slots, hashes = publish(st, 6)
    up = Uploads(then=lambda first: first == 0 and take_for_another(st, slots[3]))
    staging = kv_staging.KvStaging(alloc=np.empty)
    assert staging.restore(st, slots, BB, up, hashes if with_hashes else None) == 3
    assert (up.blocks() == np.arange(1, 4, dtype=np.uint8)[:, None]).all()
    slots, hashes = publish(st, 6)
    take_for_another(st, slots[4], value=98)  # after find(), before the restore
    up = Uploads()
    got = staging.restore(st, slots, BB, up, hashes if with_hashes else None)
    if with_hashes:
        assert got == 4 and (up.blocks() == np.arange(1, 5, dtype=np.uint8)[:, None]).all()
    else:  # what the restore cannot know without the hashes: the other block, whole, taken for block 4
        assert got == 6 and up.blocks()[4, 0] == 98
    staging.close()


def test_the_store_failing_mid_restore_ends_it_at_the_blocks_uploaded(store, chunks_of_two, caplog):
    """The store closed (its arrays gone) while chunk 1 uploads: chunk 2's reading threads fail; the restore logs
    it and returns the 4 blocks uploaded, all of them done."""
    slots, _ = publish(store, 7)
    up = Uploads(then=lambda first: first == 2 and store.close())
    staging = kv_staging.KvStaging(alloc=np.empty)
    with caplog.at_level(logging.ERROR, "stratad.lane"):
        assert staging.restore(store, slots, BB, up) == 4
    assert (up.blocks() == np.arange(1, 5, dtype=np.uint8)[:, None]).all() and up.all_waited()
    assert "reading the host conversation cache failed at block 4 of 7" in caplog.text
    staging.close()


def test_a_reading_thread_failing_waits_for_the_others(store, chunks_of_two, monkeypatch):
    """One thread's copy fails while the other's is still running: the restore returns only once that copy has
    ended (a copy still running would write over the half's next use), with the blocks of the chunks before."""
    if min(kv_staging.THREADS, os.cpu_count() or 1) < 2:
        pytest.skip("one reading thread here")
    slots, _ = publish(store, 6)
    real, ended = kv_staging._copy, []

    def copy(st, slot, row):
        if slot == slots[2]:  # the chunk's first copy fails at once
            raise OSError("the store failed")
        if slot == slots[3]:
            time.sleep(0.3)
            real(st, slot, row)
            ended.append(time.monotonic())
        else:
            real(st, slot, row)

    monkeypatch.setattr(kv_staging, "_copy", copy)
    up = Uploads()
    staging = kv_staging.KvStaging(alloc=np.empty)
    assert staging.restore(store, slots, BB, up) == 2
    returned = time.monotonic()
    assert ended and ended[0] <= returned and up.all_waited()
    staging.close()


def test_an_upload_failing_is_raised_once_the_others_are_done(store, chunks_of_two):
    """The card failing chunk 2's upload: restore raises its error with chunks 0 and 1 done; the staging serves the
    next restore whole."""
    slots, _ = publish(store, 6)
    up = Uploads(fail_at=4)
    staging = kv_staging.KvStaging(alloc=np.empty)
    with pytest.raises(RuntimeError, match="the card failed"):
        staging.restore(store, slots, BB, up)
    assert [f for f, _ in up.chunks] == [0, 2] and up.all_waited()
    up = Uploads()
    assert staging.restore(store, slots, BB, up) == 6
    assert (up.blocks() == np.arange(1, 7, dtype=np.uint8)[:, None]).all() and up.all_waited()
    staging.close()


def test_new_halves_and_close_wait_for_an_upload_in_flight():
    """Halves of another block size replace the old ones, and close() drops them, only once the upload last issued
    from them is done (an upload's event kept past a restore: none is today, restore waits for all)."""
    staging = kv_staging.KvStaging(alloc=np.empty)
    staging.halves(BB)
    staging._free[1] = ev = Event()
    staging.halves(2 * BB)
    assert ev.waited and staging._free == [None, None]
    staging._free[0] = ev = Event()
    staging.close()
    assert ev.waited


# ---- the numpy card's restore, and the lane's fallback to reading the prompt ----------------------------------
PROMPT = list(range(3, 3 + 70))  # 70 tokens + 12 generated - 1 = 81: five whole blocks kept


def run(card, prompt, n, cache):
    g = Generation(card, card.model.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True), 4096,
                   digest=True, cache=cache)
    return g, [t for t, _ in g if t is not None]


@pytest.fixture(scope="module")
def turn1(card):
    kept = PrefixCache()
    _, toks = run(card, PROMPT, 12, kept)
    return kept.kv, list(kept.tokens), toks


@pytest.fixture
def card_store(card, turn1, tmp_path):
    """A store (twice the card's block size a slot) holding turn 1's five blocks, and their slots and hashes."""
    kv, tokens, _ = turn1
    name = kv_store.segment_name(shm.prefix_for(tmp_path / "x"))
    st = make_store(name, 5, 2 * card.kv_block_bytes(B))
    w = PrefixCache(st)
    w.keep(kv, tokens)
    assert w.unsaved(card).write(st) == 5
    hashes = kv_store.chain_hashes(tokens, card.kv_layout, B)
    slots = st.find(hashes)
    assert len(slots) == 5
    yield st, slots, hashes
    st.close()
    shm.unlink(name)


def during_read(card, monkeypatch, at: int, action):
    """action() run while the store copies block `at` into the card's host buffer (after its snapshot, the copy's
    source already taken: the copy reads what action leaves there)."""
    real, fired = card.kv_host_buffer, []

    class Buffer(np.ndarray):
        def __setitem__(self, key, value):
            if isinstance(key, tuple) and key[0] == at and not fired:
                fired.append(True)
                action()
            np.ndarray.__setitem__(self, key, value)

    monkeypatch.setattr(card, "kv_host_buffer", lambda n, bt: real(n, bt).view(Buffer))
    return fired


def kv_bits(kv, n):
    return [(k[:n].copy(), v[:n].copy()) for k, v in zip(kv.k, kv.v)]


@pytest.mark.parametrize("with_hashes", [False, True])
@pytest.mark.parametrize("larger", [False, True])
def test_numpy_card_restore_with_a_block_rewritten_mid_read(card, turn1, card_store, monkeypatch, with_hashes,
                                                            larger):
    """Block 3's slot taken by another lane for a block of its own (of the card's size, or larger) while the store
    copies it: 3 blocks restored, kv holds their 48 positions with the kept KV's bits."""
    st, slots, hashes = card_store
    bb = card.kv_block_bytes(B)
    fired = during_read(card, monkeypatch, 3, lambda: take_for_another(st, slots[3], 2 * bb if larger else bb))
    kv = card.new_kv()
    assert card.import_kv_from(kv, 0, st, slots, B, hashes if with_hashes else None) == 3 and fired
    assert kv.length == 3 * B
    for (k, v), (k0, v0) in zip(kv_bits(kv, 3 * B), kv_bits(turn1[0], 3 * B)):
        assert np.array_equal(k, k0) and np.array_equal(v, v0)


def test_numpy_card_restore_with_the_store_failing_mid_read(card, card_store, monkeypatch, caplog):
    """The store closed while it copies block 2: nothing restored (logged), kv as it was."""
    st, slots, _ = card_store
    during_read(card, monkeypatch, 2, st.close)
    kv = card.new_kv()
    with caplog.at_level(logging.ERROR, "stratad.lane"):
        assert card.import_kv_from(kv, 0, st, slots, B) == 0
    assert kv.length == 0 and "the prompt is read instead" in caplog.text


def reference(card, turn1, follow, n):
    """The follow-up from the kept KV's first n positions (no store): tokens and logits digest."""
    kept = PrefixCache()
    _, toks = run(card, PROMPT, 12, kept)  # turn 1 again (the module's KV is the stores' source: left as it is)
    kept.kv.truncate(n)
    kept.tokens = kept.tokens[:n]
    g, toks = run(card, follow, 6, kept)
    assert g.cached == n
    return toks, g.digest.hexdigest()


def test_the_lane_reads_the_rest_of_the_prompt_after_a_cut_or_failed_restore(card, turn1, card_store, monkeypatch):
    """Through the prefix cache and a Generation, as a lane serves: a block rewritten mid-read restores the 3
    blocks before it and the prompt is read from there; a store failing mid-read restores nothing and the whole
    prompt is read. Either way the tokens and the logits' digest are those of a lane that kept exactly that much
    of the conversation (bit for bit)."""
    st, slots, _ = card_store
    follow = PROMPT + turn1[2] + [5, 6, 7]
    bb = card.kv_block_bytes(B)
    during_read(card, monkeypatch, 3, lambda: take_for_another(st, slots[3], bb))
    cache = PrefixCache(st)
    g, toks = run(card, follow, 6, cache)
    assert g.cached == 3 * B and cache.from_store == 3 * B
    assert (toks, g.digest.hexdigest()) == reference(card, turn1, follow, 3 * B)

    during_read(card, monkeypatch, 1, st.close)
    cache = PrefixCache(st)
    g, toks = run(card, follow, 6, cache)
    assert g.cached == 0 and cache.from_store == 0
    fresh, want = run(card, follow, 6, None)
    assert fresh.cached == 0 and (toks, g.digest.hexdigest()) == (want, fresh.digest.hexdigest())
