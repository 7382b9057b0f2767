"""The host conversation cache against the real daemon on two CPU cards: three conversations on two lanes, the
follow-up turns restored from the cache give the bits of the KV kept on a lane; a full cache evicts and serves; a
lane SIGKILLed after its request leaves only whole blocks; a restart after a crash reclaims the segment."""
from __future__ import annotations

import os
import re
import signal
import time

import numpy as np

from daemon_harness import Daemon
from stratad import kv_store, shm
from stratad.ctl import status_table

B = kv_store.BLOCK_TOKENS
BLOCK_BYTES = 4 * 2 * B * 2 * 64 * 4  # the tiny model's: 4 layers, K and V, 2 KV heads of 64, float32
GEN = 8
# prompt + GEN - 1 tokens are kept: whole blocks, so the kept KV and the cache's blocks hold the same prefix
CONVS = {name: [(7 * k + 3 * i) % 900 + 20 for i in range(n)] for k, (name, n) in
         enumerate([("A", 89), ("B", 105), ("C", 73), ("D", 489)])}


def conf(tmp_path, name, size):
    p = tmp_path / f"{name}.toml"
    p.write_text(f'prefix_cache = true\nrejoin_idle_s = 3600.0\nkv_cache_host = "{size}"\n')
    return p


def turn(c, tokens):
    s = c.generate(tokens=tokens, max_tokens=GEN, ignore_eos=True, digest=True)
    s.result()
    return s


def follow_up(prompt, first):
    return prompt + list(first.tokens) + [11, 12, 13, 14]


def kept_reference(model_path, first: list[int], follow: list[int], n: int) -> tuple[list[int], str]:
    """The follow-up's tokens and logits digest in this process, on a numpy card keeping the first n tokens of the
    first turn's sequence (the card's bits do not depend on the process: CPU lanes compute the same)."""
    from lane.numpy_card import NumpyCard
    from lane.slot_pool import SlotPool
    from stratad.engine.generation import Generation
    from stratad.engine.prefix_cache import PrefixCache
    from stratad.engine.sampling import SamplingParams
    from stratad.model.gguf_file import ModelFile
    from stratad.model.slot_layout import slot_bytes

    model = ModelFile(model_path)
    card = NumpyCard(model, SlotPool(model, np.zeros(slot_bytes(model), np.uint8), 0))
    cache = PrefixCache()
    p = SamplingParams(max_tokens=GEN, ignore_eos=True)
    list(Generation(card, model.tokenizer, first, p, 4096, cache=cache))
    cache.kv.truncate(n)
    cache.tokens = cache.tokens[:n]
    g = Generation(card, model.tokenizer, follow, p, 4096, digest=True, cache=cache)
    tokens = [t for t, _ in g if t is not None]
    assert g.cached == n
    return tokens, g.digest.hexdigest()


def settled(d, timeout_s: float = 30.0):
    """The cache's status once the lanes' background writes (after each Done) have landed: two reads apart that
    agree, with no slot still being written."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        k = d.status().kv_cache
        if k == last and k.entries * BLOCK_BYTES == k.bytes_used:
            name = kv_store.segment_name(shm.prefix_for(d.runtime_dir))
            look = kv_store.KvStore(name)
            try:
                writing = int(np.count_nonzero(look.state == kv_store.WRITING))
            finally:
                look.close()
            if not writing:
                return k
        if time.monotonic() > deadline:
            return k
        last = k
        time.sleep(0.2)


def test_three_conversations_on_two_lanes(tiny_model_path, tmp_path):
    # the reference: each conversation's follow-up right after its first turn, from the KV kept on its lane; a
    # cache of six blocks (less than the conversations' 43) evicts all along, and every request is served
    ref = Daemon(tiny_model_path, tmp_path / "ref", config=conf(tmp_path, "ref", "384KiB")).start()
    kept = {}
    try:
        with ref.client(stream_timeout_s=120) as c:
            for name, p in CONVS.items():
                first = turn(c, p)
                nxt = turn(c, follow_up(p, first))
                assert nxt.stats.lane == first.stats.lane
                assert nxt.stats.prompt_cached_tokens == len(p) + GEN - 1
                kept[name] = (first, nxt)
        k = settled(ref)
        assert k.entries == 6 and k.bytes_used == k.bytes_limit == 6 * BLOCK_BYTES and k.blocks_written > 6, k
    finally:
        ref.stop()

    d = Daemon(tiny_model_path, tmp_path / "run", config=conf(tmp_path, "run", "16MiB")).start()
    try:
        with d.client(stream_timeout_s=120) as c:
            firsts = {name: turn(c, CONVS[name]) for name in "ABC"}
            # three conversations, two lanes: C's first turn took a lane that held A or B
            for name in "ABC":
                s = turn(c, follow_up(CONVS[name], firsts[name]))
                assert s.stats.prompt_cached_tokens == len(CONVS[name]) + GEN - 1
                assert s.tokens == kept[name][1].tokens
                assert s.stats.logits_sha256 == kept[name][1].stats.logits_sha256
        settled(d)
        st = d.status()
        k = st.kv_cache
        assert k.hits >= 1 and k.tokens_served >= len(CONVS["A"]) - B, k
        assert k.entries == k.blocks_written and k.bytes_used == k.entries * BLOCK_BYTES
        assert k.bytes_limit == 16 << 20
        assert f"host conversation cache: {k.entries} blocks of {B} tokens" in status_table(st)

        # D's first turn, its lane SIGKILLed as the Done arrives (its blocks being written in the background):
        # a block it did not publish is never visible (its slots stay WRITING, owned by the dead lane)
        with d.client(stream_timeout_s=120) as c:
            first = turn(c, CONVS["D"])
            pid = d.status().lanes[first.stats.lane].pid
            os.kill(pid, signal.SIGKILL)
        assert first.tokens == kept["D"][0].tokens
        d.wait_ready(60, restarts=1)
        name = kv_store.segment_name(shm.prefix_for(d.runtime_dir))
        look = kv_store.KvStore(name)
        try:
            writing = np.flatnonzero(look.state == kv_store.WRITING)
            assert all(int(look.owner[s]) == pid for s in writing)
        finally:
            look.close()
        with d.client(stream_timeout_s=120) as c:
            nxt = turn(c, follow_up(CONVS["D"], first))
        n = nxt.stats.prompt_cached_tokens
        print(f"lane killed after D's first turn: {len(writing)} slots left unpublished, {n} tokens restored")
        # what was restored is whole: the follow-up has the bits of the same prefix's KV kept on a card
        assert n % B == 0 and n <= len(CONVS["D"]) + GEN - 1
        ref_tokens, ref_digest = kept_reference(tiny_model_path, CONVS["D"], follow_up(CONVS["D"], first), n)
        assert nxt.tokens == ref_tokens and nxt.stats.logits_sha256 == ref_digest

        # a crash of the whole daemon: the restart reclaims the segment, a clean stop leaves nothing
        assert (shm.SHM_DIR / name.lstrip("/")).exists()
        os.killpg(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        d.proc = None
        time.sleep(0.5)
        d.start()
        assert "reclaimed leftovers" in d.log_text() and name in d.log_text()
        assert d.status().kv_cache.entries == 0  # a new, empty cache
    finally:
        d.stop()
    assert d.leftovers() == []


def test_a_cache_larger_than_shared_memory_is_capped_with_a_warning(tiny_model_path, tmp_path):
    d = Daemon(tiny_model_path, tmp_path / "rt", config=conf(tmp_path, "big", "4096TiB")).start()
    try:
        k = d.status().kv_cache
        assert 0 < k.bytes_limit < 4096 << 40
        used = re.search(rf"kv_cache_host {4096 << 40} bytes is more than shared memory \({shm.SHM_DIR}\) has room "
                         r"for: ([\d.]+) MiB used", d.log_text())
        assert used and k.bytes_limit - 0.05 * 2**20 <= float(used[1]) * 2**20 < k.bytes_limit + BLOCK_BYTES + 0.05 * 2**20
        with d.client() as c:
            assert len(turn(c, CONVS["A"]).tokens) == GEN
    finally:
        assert d.stop() == 0
