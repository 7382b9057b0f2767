"""The GPU card's restore from the host conversation cache when it does not go through whole (device only; the host
side of the same cases runs on the CPU in tests/test_kv_staging.py): a block rewritten by another lane while a
reading thread copies it, the store failing mid-restore, and the card's own copies failing. The restore returns
(or raises) with nothing left running; the caches hold the store's bits for the positions kv says it holds; the
staging serves the next restore whole. Staging halves of two blocks, so every case spans several chunks. The same
from the store page-locked for the card (pin_store: no staging on the host)."""
from __future__ import annotations

import contextlib
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest

from stratad.engine.generation import Generation
from stratad.engine.prefix_cache import PrefixCache
from stratad.engine.sampling import SamplingParams
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile

pytestmark = pytest.mark.gpu
PROMPT = "The first chat talks about caches and slots, and the second one about routing."


@pytest.fixture(scope="module")
def setup(cp, tmp_path_factory):
    """A card whose KV held a turn of n >= 5 whole blocks, those blocks published in a real store (slots twice their
    size), their hashes, and the caches' bits for them."""
    from lane import kv_staging
    from lane.cupy_card import CupyCard
    from stratad import kv_store

    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    make_model(path, "tiny", expert_quant="IQ3_S", router_skew=1.0, seed=3)
    model = ModelFile(path)
    c, B = model.config, kv_store.BLOCK_TOKENS
    card = CupyCard(model, 0, c.n_layer * c.n_expert, 4096)
    card.pool.fill([(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)])
    kept = PrefixCache()
    prompt = model.tokenizer.encode(PROMPT * 3)
    list(Generation(card, model.tokenizer, prompt, SamplingParams(max_tokens=6), 4096, cache=kept))
    n = kept.kv.length // B
    assert n >= 5
    ex = card.export_kv(kept.kv, 0, n, B)
    ex.wait()
    before = [(k[:, :n * B].get(), v[:, :n * B // 16].get()) for k, v in card.kv_caches]
    bb = ex.blocks.shape[1]
    name = f"/stratad-test-{os.getpid()}-gpukv"
    st = kv_store.KvStore(name, create=True, limit_bytes=n * 2 * bb, slot_bytes=2 * bb, lane=0)
    s = SimpleNamespace(card=card, st=st, hashes=[bytes([i + 1]) * 32 for i in range(n)], blocks=ex.blocks.copy(),
                        before=before, n=n, B=B)
    republish(s)
    old = kv_staging.CHUNK_BYTES
    kv_staging.CHUNK_BYTES = 2 * bb
    try:
        yield s
    finally:
        kv_staging.CHUNK_BYTES = old
        card.close()
        st.close()
        kv_store.shm.unlink(name)


def republish(s):
    """The chain's blocks missing from the store (another lane's took a slot) published again."""
    for h, slot in s.st.claim(s.hashes):
        s.st.publish(slot, h, s.blocks[s.hashes.index(h)])
    slots = s.st.find(s.hashes)
    assert len(slots) == s.n
    return slots


def fresh(card):
    for k, v in card.kv_caches:
        k.fill(0)
        v.fill(0)
    return card.new_kv()


def holds(s, kv, blocks):
    B = s.B
    assert kv.length == blocks * B and int(s.card.pos.get()[0]) == kv.length
    for (k, v), (k0, v0) in zip(s.card.kv_caches, s.before):
        assert np.array_equal(k[:, :blocks * B].get(), k0[:, :blocks * B])
        assert np.array_equal(v[:, :blocks * B // 16].get(), v0[:, :blocks * B // 16])


def whole_again(s):
    """The staging serves the next restore whole, bit for bit."""
    slots = republish(s)
    kv = fresh(s.card)
    assert s.card.import_kv_from(kv, 0, s.st, slots, s.B, s.hashes) == s.n
    holds(s, kv, s.n)


def test_a_block_rewritten_while_a_thread_reads_it(setup, monkeypatch):
    """Another lane evicts block 3's slot and publishes a block of its own (larger than the card's) in it just
    before a reading thread copies it: 3 blocks restored."""
    from lane import kv_staging

    s = setup
    slots = republish(s)
    real, fired = kv_staging._copy, []

    def copy(store, slot, row):
        if slot == slots[3] and not fired:
            fired.append(True)
            store.touch([x for x in range(store.n_slots) if x != slot])
            (h, got), = store.claim([b"\x99" * 32])
            assert got == slot
            store.publish(got, h, np.full(store.slot_bytes, 99, np.uint8))
        real(store, slot, row)

    monkeypatch.setattr(kv_staging, "_copy", copy)
    kv = fresh(s.card)
    assert s.card.import_kv_from(kv, 0, s.st, slots, s.B, s.hashes) == 3 and fired
    holds(s, kv, 3)
    monkeypatch.undo()
    whole_again(s)


def test_the_store_failing_mid_restore(setup, monkeypatch, caplog):
    """A reading thread's copy of block 4 (chunk 2) failing: the first 4 blocks restored, the error logged."""
    from lane import kv_staging

    s = setup
    slots = republish(s)
    real = kv_staging._copy

    def copy(store, slot, row):
        if slot == slots[4]:
            raise OSError("the store failed")
        real(store, slot, row)

    monkeypatch.setattr(kv_staging, "_copy", copy)
    kv = fresh(s.card)
    with caplog.at_level(logging.ERROR, "stratad.lane"):
        assert s.card.import_kv_from(kv, 0, s.st, slots, s.B, s.hashes) == 4
    assert "reading the host conversation cache failed at block 4" in caplog.text
    holds(s, kv, 4)
    monkeypatch.undo()
    whole_again(s)


@pytest.mark.parametrize("path", ["staged", "pinned"])
def test_the_cards_copies_failing(setup, monkeypatch, path):
    """The card's copies raising for chunk 1 of a restore after one kept block (its copy into device staging
    already issued, chunk 0's copies maybe still running), through the staging or from the page-locked store: the
    error is raised once the stream is idle and no upload event is left; kv holds its first block, as before."""
    with (pinning(setup) if path == "pinned" else contextlib.nullcontext(setup)) as s:
        _copies_failing(s, monkeypatch)


def _copies_failing(s, monkeypatch):
    slots = republish(s)
    kv = fresh(s.card)
    assert s.card.import_kv_from(kv, 0, s.st, slots[:1], s.B, s.hashes[:1]) == 1
    real, calls = s.card._kv_copies, []

    def copies(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the card failed")
        return real(*a, **k)

    monkeypatch.setattr(s.card, "_kv_copies", copies)
    with pytest.raises(RuntimeError, match="the card failed"):
        s.card.import_kv_from(kv, 1, s.st, slots[1:], s.B, s.hashes[1:])
    assert s.card.stream.done and (s.card._staging is None or s.card._staging._free == [None, None])
    holds(s, kv, 1)
    monkeypatch.undo()
    whole_again(s)


@contextlib.contextmanager
def pinning(s):
    """The store page-locked for the card (lane/main.py does this at start): restores copy straight from it."""
    assert s.card.pin_store(s.st)
    try:
        yield s
    finally:
        s.card._store_lock.release()
        s.card._store_lock = None


@pytest.fixture
def pinned(setup):
    with pinning(setup) as s:
        yield s


def test_a_restore_from_the_page_locked_store(pinned):
    """Straight from the store's pages, in chunks of two blocks: the caches hold the store's bits (the same as the
    staged restore's, whole_again above); a restore after a kept block goes on from it."""
    s = pinned
    whole_again(s)
    slots = republish(s)
    kv = fresh(s.card)
    assert s.card.import_kv_from(kv, 0, s.st, slots[:1], s.B, s.hashes[:1]) == 1
    assert s.card.import_kv_from(kv, 1, s.st, slots[1:], s.B, s.hashes[1:]) == s.n - 1
    holds(s, kv, s.n)


def take_at_record(s, monkeypatch, slot: int, nth: int) -> list:
    """Another lane takes `slot` for a block of its own (a different size) right after the card's nth recorded
    event (kv_staging.record: a chunk's copies into staging issued). Returns the calls seen."""
    from lane import kv_staging

    real, calls = kv_staging.record, []

    def record(stream):
        ev = real(stream)
        calls.append(1)
        if len(calls) == nth:
            s.st.touch([x for x in range(s.st.n_slots) if x != slot])
            (h, got), = s.st.claim([bytes([0x90 + nth]) * 32])  # no block of the chain's
            assert got == slot
            s.st.publish(got, h, np.full(s.st.slot_bytes, 90 + nth, np.uint8))
        return ev

    monkeypatch.setattr(kv_staging, "record", record)
    return calls


def test_a_block_rewritten_while_the_card_copies_from_the_page_locked_store(pinned, monkeypatch):
    """Another lane takes block 3's slot right after the card's copies of chunk 1 (blocks 2, 3) are issued: the
    confirm after they end finds it, 3 blocks count; the caches hold the store's bits for them, and nothing of the
    rewritten slot reaches them."""
    s = pinned
    slots = republish(s)
    calls = take_at_record(s, monkeypatch, slots[3], 2)
    kv = fresh(s.card)
    assert s.card.import_kv_from(kv, 0, s.st, slots, s.B, s.hashes) == 3 and len(calls) >= 2
    holds(s, kv, 3)
    monkeypatch.undo()
    whole_again(s)


def test_a_restore_whose_first_block_is_taken_leaves_the_kv_as_it_was(pinned, monkeypatch):
    """Block 2's slot taken while the copy of the restore's first chunk (blocks 2, 3) runs: nothing is restored
    and the kept KV is untouched (the caller reads the prompt from its own kept positions)."""
    s = pinned
    slots = republish(s)
    kv = fresh(s.card)
    assert s.card.import_kv_from(kv, 0, s.st, slots[:2], s.B, s.hashes[:2]) == 2
    take_at_record(s, monkeypatch, slots[2], 1)
    assert s.card.import_kv_from(kv, 2, s.st, slots[2:], s.B, s.hashes[2:]) == 0
    holds(s, kv, 2)
    monkeypatch.undo()
    whole_again(s)


