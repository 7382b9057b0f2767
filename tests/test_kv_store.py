"""The host conversation cache (stratad/kv_store.py) and the numpy card's KV as its blocks (kv_blocks.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from stratad import kv_store, shm
from stratad.engine.generation import Generation
from stratad.engine.prefix_cache import PrefixCache
from stratad.engine.sampling import SamplingParams

B = kv_store.BLOCK_TOKENS


@pytest.fixture
def store(host_cache):
    return host_cache(8)


def blocks(n, fill):
    return np.full((n, 256), fill, np.uint8)


def test_chain_hashes_share_a_common_prefix():
    a = kv_store.chain_hashes(list(range(40)), "t")
    b = kv_store.chain_hashes(list(range(16)) + [7] * 16, "t")
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert kv_store.chain_hashes(list(range(40)), "other")[0] != a[0]  # another card layout never matches


def test_write_find_read_and_lru_eviction(store):
    h = kv_store.chain_hashes(list(range(6 * B)), "t")
    for i, (hh, slot) in enumerate(store.claim(h[:6])):
        store.publish(slot, hh, blocks(1, i + 1)[0])
    slots = store.find(h)
    assert len(slots) == 6
    out = np.zeros((6, 256), np.uint8)
    assert store.read(slots, out) == 6 and (out[:, 0] == np.arange(1, 7)).all()
    assert store.claim(h[:6]) == []  # already there: nothing claimed
    # another conversation of 4 blocks in a cache of 8: the first's tail goes (least recently used), its head stays
    g = kv_store.chain_hashes([9] * (4 * B), "t")
    store.touch(store.find(h))
    claimed = store.claim(g)
    assert len(claimed) == 4
    for hh, slot in claimed:
        store.publish(slot, hh, blocks(1, 99)[0])
    assert len(store.find(g)) == 4 and len(store.find(h)) == 4
    s = store.stats()
    assert (s.entries, s.bytes_used, s.bytes_limit, s.blocks_written) == (8, 8 * 256, 8 * 256, 10)


def test_a_slot_taken_during_a_read_is_a_miss(store):
    h = kv_store.chain_hashes(list(range(2 * B)), "t")
    for hh, slot in store.claim(h):
        store.publish(slot, hh, blocks(1, 5)[0])
    slots = store.find(h)
    store.seq[slots[1]] += 1  # what a claim by another process does to the slot under a reader
    store.state[slots[1]] = kv_store.WRITING
    out = np.zeros((2, 256), np.uint8)
    assert store.read(slots, out) == 1


WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from stratad import kv_store
    st = kv_store.KvStore(sys.argv[1], lane=1)
    h = kv_store.chain_hashes(list(range(3 * kv_store.BLOCK_TOKENS)), "t")
    claimed = st.claim(h)
    st.publish(claimed[0][1], claimed[0][0], np.full(256, 1, np.uint8))
    slot = claimed[1][1]
    st.data[slot, :128] = 2  # half of the second block: killed here
    print(slot, flush=True)
    time.sleep(60)
""")


def test_a_writer_killed_midway_leaves_nothing_partial_visible(store, tmp_path):
    p = subprocess.Popen([sys.executable, "-c", WRITER, store.name], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    half = int(p.stdout.readline())
    p.send_signal(signal.SIGKILL)
    p.wait()
    h = kv_store.chain_hashes(list(range(3 * B)), "t")
    assert len(store.find(h)) == 1  # the whole first block; the half-written one and its child are invisible
    assert store.state[half] == kv_store.WRITING
    # the dead writer's slots are taken again before any live block is evicted
    claimed = dict((s, hh) for hh, s in store.claim(h))
    assert half in claimed and store.stats().entries == 1


def test_a_full_cache_evicts_and_never_waits(store):
    h = kv_store.chain_hashes(list(range(8 * B)), "t")
    claimed = store.claim(h)  # every slot, and a writer that is alive (this process) keeps them
    assert len(claimed) == 8
    more = kv_store.chain_hashes([3] * (2 * B), "t")
    assert store.claim(more) == []  # nothing to evict: the write is dropped, at once
    for hh, s in claimed:
        store.publish(s, hh, blocks(1, 1)[0])
    assert len(store.claim(more)) == 2  # now the least recently used go


def run(engine, prompt, n, cache):
    g = Generation(engine, engine.model.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True), 4096,
                   digest=True, cache=cache)
    toks = [t for t, _ in g if t is not None]
    return g, toks


def test_restored_kv_gives_the_kept_kvs_bits(card, tmp_path):
    """A conversation's next turn from the KV kept on the lane and from the same KV through the store: the same
    tokens and the same logits, bit for bit."""
    name = kv_store.segment_name(shm.prefix_for(tmp_path / "x"))
    limit = 64 * card.kv_block_bytes(B)
    st = kv_store.KvStore(name, create=True, limit_bytes=limit, slot_bytes=card.kv_block_bytes(B), lane=0)
    try:
        prompt = list(range(3, 3 + 37))  # 37 tokens + 12 generated - 1 = 48: three whole blocks kept
        kept = PrefixCache()
        _, t1 = run(card, prompt, 12, kept)
        asked = []  # a lane's writer is asked to land the prompt's blocks before the store is searched
        stored = PrefixCache(st, landed=asked.append)
        stored.keep(kept.kv, list(kept.tokens))
        # blocks an earlier write of this lane has yet to land are left out of the export
        all3 = stored.unsaved(card).hashes
        part = stored.unsaved(card, writing=frozenset(all3[:2]))
        assert part.hashes == all3[2:] and part.rows == [0] and stored.unsaved(card, frozenset(all3)) is None
        assert part.parent == all3[1] and part.write(st) == 0  # its parent is not in the store: nothing written
        w = stored.unsaved(card)
        assert len(w.hashes) == 3 and w.parent is None and w.write(st) == 3
        turn2 = prompt + t1 + [5, 6, 7]
        stored.clear()  # another lane: nothing kept, everything from the store
        g_kept, a = run(card, turn2, 6, kept)
        g_store, b = run(card, turn2, 6, stored)
        assert g_kept.cached == g_store.cached == 48 and stored.from_store == 48
        assert asked[-1] == kv_store.chain_hashes(turn2[:len(turn2) - 1 - (len(turn2) - 1) % B], card.kv_layout, B)
        # the next turn on the same lane: its whole blocks are all in the kept sequence, nothing to wait for
        run(card, turn2 + b + [9], 2, stored)
        assert stored.from_store == 0 and len(asked) == 1
        assert a == b and g_kept.digest.hexdigest() == g_store.digest.hexdigest()
        s = st.stats()
        assert (s.hits, s.tokens_served) == (1, 48)
    finally:
        st.close()


def test_kv_cache_host_config():
    from stratad import config

    assert config.load(None, {"model": "m"}).kv_cache_host.fraction == 0.25
    assert config.load(None, {"model": "m", "kv_cache_host": "2GiB"}).kv_cache_host.bytes == 2 << 30
    assert config.load(None, {"model": "m", "kv_cache_host": 0}).kv_cache_host.fraction == 0.0
    with pytest.raises(config.ConfigError, match="key 'kv_cache_host'.*fraction must be within 0..1"):
        config.load(None, {"model": "m", "kv_cache_host": 3})
    with pytest.raises(config.ConfigError, match="key 'kv_cache_host'.*'40GiB'"):
        config.load(None, {"model": "m", "kv_cache_host": "lots"})
    mem = kv_store.mem_available()
    assert 0 < kv_store.host_limit(config.CacheBudget(fraction=0.5), 0) <= mem // 2
    assert kv_store.host_limit(config.CacheBudget(fraction=0.5), 2 * mem) == 0  # nothing left beside the arena
    # the CPU cards' pools, made in /dev/shm after the cache, come off what /dev/shm can give it
    st = os.statvfs(kv_store.shm.SHM_DIR)
    shm_free = int(0.9 * st.f_bavail * st.f_frsize)
    half = kv_store.host_limit(config.CacheBudget(bytes=1 << 60), 0, shm_free // 2)
    assert half <= shm_free // 2 + (256 << 20)  # other processes' segments come and go meanwhile
    assert kv_store.host_limit(config.CacheBudget(bytes=1 << 60), 0, 2 * shm_free) == 0


CHURN = textwrap.dedent("""
    import sys, time
    import numpy as np
    from stratad import kv_store
    st = kv_store.KvStore(sys.argv[1], lane=1)
    end, i = time.monotonic() + float(sys.argv[2]), 0
    print("go", flush=True)
    while time.monotonic() < end:
        for hh, slot in st.claim(kv_store.chain_hashes([i % 50000] * kv_store.BLOCK_TOKENS * 64, "t")):
            st.publish(slot, hh, np.zeros(64, np.uint8))
        i += 1
""")


def test_lookups_while_another_lane_writes(tmp_path):
    """Another process claims and publishes while this one looks up: every lookup answers (numpy reads a table it
    was given more than once, so the store's live arrays must not be handed to it)."""
    name = kv_store.segment_name(shm.prefix_for(tmp_path))
    st = kv_store.KvStore(name, create=True, limit_bytes=8192 * 64, slot_bytes=64, lane=0)
    try:
        p = subprocess.Popen([sys.executable, "-c", CHURN, name, "3"], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=os.getcwd()))
        assert p.stdout.readline().strip() == "go"
        probe = kv_store.chain_hashes([3] * B, "t")  # one hash: numpy's isin takes its table path
        n = 0
        while p.poll() is None:
            st.find(probe)
            st.present(probe)
            n += 1
        assert p.returncode == 0 and n > 100
    finally:
        st.close()
        shm.unlink(name)
