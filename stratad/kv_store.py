"""The host conversation cache: KV blocks of a fixed number of tokens in one shared-memory segment, keyed by the
hash chain of their token prefix (so conversations sharing a system prompt share its blocks), least recently used
first out, bounded in bytes. The coordinator creates and unlinks the segment; every lane attaches it, writes its
sequences' new blocks and restores the longest prefix of a prompt from it.

Visibility: a slot is FREE, WRITING (owner pid) or READY. A writer claims slots under a lock (flock on the
segment's file: the kernel drops it if the holder dies), copies the data without it, then publishes each slot with
one aligned 8-byte store of READY after the data and the hash (x86 keeps stores in order). A writer killed midway
leaves its slots WRITING: never visible, reclaimed as soon as their owner is dead. Readers take no lock: each slot
has a sequence number bumped by every claim, read before and after the copy (a seqlock); a slot taken for another
block during the copy reads as a miss. Eviction takes a free slot, else a dead writer's, else the least recently
used READY one; a write that finds none drops its blocks (a request never waits for the cache).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import time
from dataclasses import dataclass

import numpy as np

from stratad import shm

MAGIC = 0x5354524B56303031  # "STRKV001"
BLOCK_TOKENS = 16  # tokens a block (the GPU card's V cache is in blocks of 16 positions)
MAX_LANES = 64  # lanes with a counters row in the header
HEADER = 4096
FREE, WRITING, READY = 0, 1, 2
# per-lane counters (each lane writes only its own row): lookups, hits (requests served some blocks), tokens
# served from the cache, blocks written
LOOKUPS, HITS, TOKENS, WRITTEN = range(4)
# the slot table: one array a field, so that lookups and eviction are vectorised
_FIELDS = (("seq", np.uint64, ()), ("state", np.uint64, ()), ("owner", np.uint64, ()), ("used", np.int64, ()),
           ("key", np.uint64, ()), ("nbytes", np.uint64, ()), ("hash", np.uint8, (32,)))


def segment_name(shm_prefix: str) -> str:
    return f"{shm_prefix}kvstore"


def chain_hashes(tokens, tag: str, block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """The hash of each whole block of tokens: sha256(parent's hash + the block's ids as int32), the first block's
    parent being the hash of the card layout's tag (blocks of another layout never match)."""
    ids = np.asarray(tokens, np.int32)
    parent = hashlib.sha256(tag.encode()).digest()
    out = []
    for i in range(len(ids) // block_tokens):
        parent = hashlib.sha256(parent + ids[i * block_tokens:(i + 1) * block_tokens].tobytes()).digest()
        out.append(parent)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@dataclass
class Snapshot:
    """KvStore.snapshot's record of slots about to be read."""
    seq: np.ndarray
    hash: np.ndarray
    time: int

    def __len__(self) -> int:
        return len(self.seq)

    def part(self, a: int, b: int) -> "Snapshot":
        """The record of slots[a:b] (a chain read in parts: each part confirmed against the one snapshot)."""
        return Snapshot(self.seq[a:b], self.hash[a:b], self.time)


@dataclass(frozen=True)
class StoreStats:
    entries: int
    bytes_used: int
    bytes_limit: int
    block_tokens: int
    lookups: int
    hits: int
    tokens_served: int
    blocks_written: int


class KvStore:
    """The segment, created (create=True: the coordinator) or attached (a lane, `lane` its counters row)."""

    def __init__(self, name: str, *, create: bool = False, limit_bytes: int = 0, slot_bytes: int = 0,
                 block_tokens: int = BLOCK_TOKENS, lane: int | None = None):
        if create:
            if slot_bytes <= 0:
                raise ValueError("a KV block must have a size")
            n = limit_bytes // slot_bytes
            if n < 1:
                raise ValueError(f"kv_cache_host of {limit_bytes} bytes holds no block of {slot_bytes} bytes")
            shm.unlink(name)  # a crashed daemon's, if the runtime dir's reclaim missed it
            self.seg = shm.Segment(name, self._size(n, slot_bytes), create=True)
            h = self.seg.array(np.uint64, 0, (8,))
            h[1:4] = (block_tokens, slot_bytes, n)
            h[0] = MAGIC  # last: an attacher sees a whole header or none
        else:
            self.seg = shm.Segment(name)
            h = self.seg.array(np.uint64, 0, (8,))
            if int(h[0]) != MAGIC:
                raise ValueError(f"shared-memory segment {name} is not a KV store")
        self.name, self.lane = name, lane
        self.block_tokens, self.slot_bytes, self.n_slots = (int(x) for x in h[1:4])
        self.counters = self.seg.array(np.uint64, 512, (MAX_LANES, 4))
        off = HEADER
        for field, dtype, shape in _FIELDS:
            count = self.n_slots * int(np.prod(shape, dtype=np.int64))
            setattr(self, field, self.seg.array(dtype, off, (self.n_slots,) + shape))
            off += -(-count * np.dtype(dtype).itemsize // 64) * 64
        self.data = self.seg.array(np.uint8, _round(off), (self.n_slots, self.slot_bytes))
        self._lock_fd = os.open(shm.SHM_DIR / name.lstrip("/"), os.O_RDWR)

    @staticmethod
    def _size(n: int, slot_bytes: int) -> int:
        off = HEADER
        for _, dtype, shape in _FIELDS:
            off += -(-n * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // 64) * 64
        return _round(off) + n * slot_bytes

    # ---- reading ----------------------------------------------------------------------------------------------
    def present(self, hashes: list[bytes]) -> dict[bytes, int]:
        """hash -> a READY slot holding it, for those of hashes that are here."""
        if not hashes:
            return {}
        keys = np.frombuffer(b"".join(h[:8] for h in hashes), np.uint64)
        want, out = set(hashes), {}
        # a snapshot: other lanes publish meanwhile, and isin reads its input more than once (a table lookup
        # indexed by values it range-checked on an earlier read)
        state, key = self.state.copy(), self.key.copy()
        for s in np.flatnonzero((state == READY) & np.isin(key, keys)):
            h = bytes(self.hash[s])
            if h in want:
                out.setdefault(h, int(s))
        return out

    def find(self, hashes: list[bytes]) -> list[int]:
        """Slots of the longest run of hashes[0..] that is READY here (a chain: a block without its parent is of
        no use)."""
        where, out = self.present(hashes), []
        for h in hashes:
            if h not in where:
                break
            out.append(where[h])
        return out

    def read(self, slots: list[int], out: np.ndarray, hashes: list[bytes] | None = None) -> int:
        """Copy the slots' blocks into out (rows), in order; the number copied whole before the first that was
        taken for another block meanwhile (hashes: see snapshot). Touches them (most recent last in the chain
        first out)."""
        snap = self.snapshot(slots, hashes)
        for i, s in enumerate(slots[:len(snap)]):
            n = min(int(self.nbytes[s]), out.shape[1])  # a slot taken for a larger block meanwhile: not whole
            out[i, :n] = self.data[s, :n]
        return self.confirm(slots, snap)

    def snapshot(self, slots: list[int], hashes: list[bytes] | None = None) -> "Snapshot":
        """The slots' sequence numbers and hashes, up to the first that is not READY or (hashes: the blocks the
        slots were found holding, find()'s) holds another block: a reader copies their data after this and keeps
        what confirm() says is still whole (the seqlock's first read). Without hashes a slot taken for another
        block and published again between find() and this reads as whole."""
        idx = np.asarray(slots, np.int64)
        seq, state, h = self.seq[idx].copy(), self.state[idx].copy(), self.hash[idx].copy()
        ok = state == READY
        if hashes is not None:
            if len(hashes) != len(idx):
                raise ValueError(f"{len(hashes)} hashes for {len(idx)} slots")
            want = np.frombuffer(b"".join(hashes), np.uint8).reshape(len(idx), 32) if len(idx) else h
            ok &= (h == want).all(axis=1)
        n = int(np.argmin(ok)) if not ok.all() else len(idx)
        return Snapshot(seq[:n], h[:n], time.monotonic_ns())

    def confirm(self, slots: list[int], snap: "Snapshot", first: int = 0) -> int:
        """How many of slots (those snap covers) were not taken for another block since snapshot(): their data
        read meanwhile is whole. Touches those, slot i at snap's time less first + i (a chain's tail is older than
        its head: evicted first; first: the place of slots[0] in a chain read in parts)."""
        idx = np.asarray(slots[:len(snap.seq)], np.int64)
        ok = (self.seq[idx] == snap.seq) & (self.state[idx] == READY) & (self.hash[idx] == snap.hash).all(axis=1)
        n = int(np.argmin(ok)) if not ok.all() else len(idx)
        self.used[idx[:n]] = snap.time - first - np.arange(n)
        return n

    def count(self, which: int, n: int = 1) -> None:
        if self.lane is not None and 0 <= self.lane < MAX_LANES:
            self.counters[self.lane, which] += n

    # ---- writing ----------------------------------------------------------------------------------------------
    def claim(self, hashes: list[bytes]) -> list[tuple[bytes, int]]:
        """Slots for the blocks not already here (hash, slot), marked WRITING by this process; as many as can be
        had without taking a live writer's slot or one of this chain (a full cache evicts, never waits)."""
        pid = os.getpid()
        out = []
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            present = self.present(hashes)  # this chain's blocks already here are kept, not evicted for it
            todo = [h for h in hashes if h not in present]
            if not todo:
                return []
            state = self.state.copy()
            # a dead writer's slots first (reclaimed as soon as seen), then free ones, then the least recently used
            free = [int(s) for s in np.flatnonzero(state == WRITING) if not _alive(int(self.owner[s]))]
            free += list(np.flatnonzero(state == FREE))
            if len(free) < len(todo):
                ready = np.flatnonzero(state == READY)
                ready = ready[~np.isin(ready, list(present.values()))]
                free += list(ready[np.argsort(self.used[ready], kind="stable")][:len(todo) - len(free)])
            for h, s in zip(todo, free):
                s = int(s)
                self.seq[s] += 1
                self.state[s] = WRITING
                self.owner[s] = pid
                self.key[s] = 0
                out.append((h, s))
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        return out

    def publish(self, slot: int, h: bytes, block: np.ndarray) -> None:
        """Write a claimed slot's data, then make it visible: the hash and size first, READY last."""
        n = block.nbytes
        if n > self.slot_bytes:
            raise ValueError(f"a block of {n} bytes does not fit a slot of {self.slot_bytes}")
        self.data[slot, :n] = block.reshape(-1).view(np.uint8)
        self.hash[slot] = np.frombuffer(h, np.uint8)
        self.nbytes[slot] = n
        self.key[slot] = np.frombuffer(h[:8], np.uint64)[0]
        self.used[slot] = time.monotonic_ns()
        self.state[slot] = READY
        self.count(WRITTEN)

    def touch(self, slots: list[int]) -> None:
        t = time.monotonic_ns()
        for i, s in enumerate(slots):
            self.used[s] = t - i

    # ---- status -----------------------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        entries = int(np.count_nonzero(self.state == READY))
        c = self.counters.sum(axis=0)
        return StoreStats(entries=entries, bytes_used=entries * self.slot_bytes,
                          bytes_limit=self.n_slots * self.slot_bytes, block_tokens=self.block_tokens,
                          lookups=int(c[LOOKUPS]), hits=int(c[HITS]), tokens_served=int(c[TOKENS]),
                          blocks_written=int(c[WRITTEN]))

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        for field, _, _ in _FIELDS:
            setattr(self, field, None)
        self.data = self.counters = None
        self.seg.close()


def _round(n: int) -> int:
    return -(-n // 4096) * 4096


def block_bytes(config, cards) -> int:
    """A slot's bytes for these cards' KV layouts: float32 on CPU cards (engine/kv_blocks.py), float16 on GPU
    cards (lane/cupy_card.py); the larger where both serve."""
    per = config.n_layer * 2 * BLOCK_TOKENS * config.n_head_kv * config.head_dim
    return per * (4 if "cpu" in cards else 2)


def host_limit(budget, reserved: int, shm_reserved: int = 0) -> int:
    """kv_cache_host in bytes: a size as given, or a fraction of the memory available beside `reserved` (the
    model's mapping and the CPU cards' pools: the arena and the lanes keep what they need); never more than
    /dev/shm can hold beside `shm_reserved` (the CPU cards' pools, made there after this) (a page that does not
    fit there would kill its writer)."""
    st = os.statvfs(shm.SHM_DIR)
    shm_free = max(0, int(0.9 * st.f_bavail * st.f_frsize) - shm_reserved)
    if budget.bytes is not None:
        return min(budget.bytes, shm_free)
    return min(int(budget.fraction * max(0, mem_available() - reserved)), shm_free)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")
