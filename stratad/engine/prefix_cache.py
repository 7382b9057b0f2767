"""A lane's last sequence kept for the next request: the KV of the tokens it has read, reused for the longest
common prefix of the next prompt (agents send the whole conversation again on every turn). With the host
conversation cache (stratad/kv_store.py, shared by every lane) a prompt whose longest prefix is there rather than
on this lane uploads those blocks and reads only the rest; after a request the sequence's new whole blocks go
there. A restored KV holds the same bits as the kept one it was written from.

Reuse is not bit-identical to reading the prompt afresh: the reused tokens' KV was computed in other chunks (or
one token at a time, for generated tokens), and a prompt chunk and a decode step round differently. Where the
experts are computed still changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from stratad import kv_store
from stratad.engine.card import KvBlockCard, KvExport


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (vectorised: conversations run to 100K tokens)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


@dataclass
class BlockWrite:
    """A sequence's blocks not yet in the store, exported from the card (the KV may change once the lane serves
    again): written by write() in the background."""
    hashes: list[bytes]
    rows: list[int]  # each hash's row of export.blocks
    export: KvExport | None  # None once released
    parent: bytes | None = None  # the chain's block before the first of these (None: they start the chain)

    def release(self) -> None:
        """Let the exported rows go once their copy has ended (a GPU card's page-locked buffer goes back to the
        card's export buffers, where a next export finds it instead of page-locking gigabytes anew)."""
        if self.export is not None:
            ex, self.export = self.export, None
            try:
                ex.wait()  # a buffer given back while its copy runs would be written under its next export
            except BaseException:
                del ex  # a traceback a log handler keeps would hold the rows through this frame
                raise
            ex.release()

    def write(self, store: kv_store.KvStore) -> int:
        """Claim slots and publish the blocks (a block another lane wrote meanwhile is skipped); blocks written.
        Nothing where the parent is not in the store (an earlier write of it failed, or it was evicted): blocks no
        lookup could reach are not written, a later export of the sequence sends them with the parent."""
        self.export.wait()
        if self.parent is not None and not store.present([self.parent]):
            return 0
        row = dict(zip(self.hashes, self.rows))
        claimed = store.claim(self.hashes)
        for h, slot in claimed:
            store.publish(slot, h, self.export.blocks[row[h]])
        return len(claimed)


class PrefixCache:
    """Holds one KV (the engine's object) and the tokens whose entries it has, in order; with a store, the host
    cache's blocks too."""

    def __init__(self, store: kv_store.KvStore | None = None, landed: Callable[[list[bytes]], None] | None = None):
        """landed: called with a prompt's block hashes past the kept sequence's before the store is searched for
        them; returns once none is still being written (a lane's writer of its earlier sequences' blocks)."""
        self.kv = None
        self.tokens: list[int] = []
        self.store = store
        self.landed = landed
        self.from_store = 0  # tokens of the last take() uploaded from the store

    def take(self, engine, prompt: list[int]):
        """(kv, n): a KV holding the prompt's first n tokens (n < len(prompt): the last prompt token is always
        read, its logits are the first step's), from this lane's kept sequence or the store, whichever holds
        more; a fresh KV and 0 without a useful match."""
        n = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        kv, self.kv, self.tokens = self.kv, None, []  # in use until keep()
        self.from_store = 0
        if kv is None or n == 0:
            kv, n = None, 0
        if self.store is not None and isinstance(engine, KvBlockCard):
            kv, n = self._restore(engine, prompt, kv, n)
        if kv is None:
            return engine.new_kv(), 0
        kv.truncate(n)
        return kv, n

    def _restore(self, engine, prompt: list[int], kv, n: int):
        """Upload the store's blocks of the prompt's prefix past what kv holds (its n tokens), if it has more."""
        st, B = self.store, self.store.block_tokens
        st.count(kv_store.LOOKUPS)
        hashes = kv_store.chain_hashes(prompt[:(len(prompt) - 1) // B * B], engine.kv_layout, B)
        first = n // B if kv is not None else 0  # the kept sequence's whole blocks stay; the rest is uploaded
        if self.landed is not None and hashes[first:]:  # only what the kept sequence does not hold is waited for
            self.landed(hashes[first:])
        slots = st.find(hashes)
        if len(slots) * B <= n:
            st.touch(slots)
            return kv, n
        fresh = kv is None
        if fresh:
            kv = engine.new_kv()
        # fewer where a block was evicted meanwhile, or the store failed mid-read: the prompt is read from there
        got = engine.import_kv_from(kv, first, st, slots[first:], B, hashes[first:len(slots)])
        if not got:
            return (None, 0) if fresh else (kv, n)
        self.from_store = max(0, (first + got) * B - n)
        st.count(kv_store.HITS)
        st.count(kv_store.TOKENS, self.from_store)
        return kv, (first + got) * B

    def keep(self, kv, tokens: list[int]) -> None:
        """After a request: kv holds the entries of these tokens (kv.length == len(tokens))."""
        self.kv, self.tokens = kv, tokens

    def unsaved(self, engine, writing: frozenset[bytes] = frozenset()) -> BlockWrite | None:
        """The kept sequence's whole blocks the store lacks, exported now (None: nothing to write); those it has
        are touched (the conversation is live). writing: blocks an earlier write of this lane has yet to land,
        left out."""
        if self.store is None or self.kv is None or not isinstance(engine, KvBlockCard):
            return None
        st, B = self.store, self.store.block_tokens
        hashes = kv_store.chain_hashes(self.tokens, engine.kv_layout, B)
        have = st.present(hashes)
        st.touch([have[h] for h in hashes if h in have])
        missing = [i for i, h in enumerate(hashes) if h not in have and h not in writing]
        if not missing:
            return None
        lo = missing[0]  # exported as one run from the first missing block; only the missing ones are written
        run = engine.export_kv(self.kv, lo, len(hashes) - lo, B)
        return BlockWrite([hashes[i] for i in missing], [i - lo for i in missing], run,
                          hashes[lo - 1] if lo else None)

    def clear(self) -> None:
        self.kv, self.tokens = None, []
