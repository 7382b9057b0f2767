"""The CPU "virtual card": the numpy reference forward, with each expert computed from where it is placed.

Experts in the card's slot pool are computed from the slot's bytes; experts another card holds (its View) from
that card's slot pool, a shared-memory segment (the CPU cards' stand-in for CUDA IPC); the others by the numba
CPU pool (lane/cpu_pool/, the GPU lanes' too) straight from the arena. All run the canonical expert function:
the output bits do not depend on placement (DESIGN.md).
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict

import numpy as np

from stratad.engine.chunks import PROMPT_CHUNK, chunks
from lane.counters import Counters
from lane.cpu_pool import CpuPool, LayerJobs
from lane.slot_pool import SlotPool
from protos import messages as M
from stratad import shm
from stratad.engine import canonical
from stratad.engine import kv_blocks
from stratad.engine.card import HostSampled, KvExport
from stratad.engine.reference import ReferenceEngine
from stratad.model import quants
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import KINDS, split_slot

log = logging.getLogger("stratad.lane")


class PeerCard:
    """Another card's slot pool, attached read-only."""

    def __init__(self, view: M.CardView, slot_bytes: int):
        self.card, self.generation = view.card, view.generation
        self.segment = shm.Segment(view.pool)
        self.data = self.segment.array().reshape(-1, slot_bytes) if self.segment.size >= slot_bytes else \
            np.zeros((0, slot_bytes), np.uint8)


class NumpyCard(HostSampled):
    kind = "cpu"
    prompt_chunk = PROMPT_CHUNK
    device_ident = "cpu"
    HALF_LIFE_TOKENS = 256  # live expert counts decay so placement follows the current traffic

    def __init__(self, model: ModelFile, pool: SlotPool, counts: np.ndarray | None = None, decoded_cache: int = 512,
                 pool_ident: str = ""):
        c = model.config
        self.pool_ident = pool_ident  # the shared segment other lanes attach
        self.model, self.pool = model, pool
        self.engine = ReferenceEngine(model, experts=self.experts)
        self.counters = Counters()  # since start
        self.counts = counts if counts is not None else np.zeros((c.n_layer, c.n_expert))
        self.peers: dict[int, PeerCard] = {}
        self.peer_card = np.full((c.n_layer, c.n_expert), -1, np.int32)  # (layer, expert) -> card, from the View
        self.peer_slot = np.full((c.n_layer, c.n_expert), -1, np.int32)
        self.epoch = 0
        self._decoded: OrderedDict = OrderedDict()  # (card, generation, slot, layer, expert) -> IntBlocks x3
        # experts no card holds: the numba CPU pool, straight from the arena (the GPU lanes' CPU pool too)
        self.cpu_pool = CpuPool(int(os.environ.get("NUMBA_NUM_THREADS", "1")))
        self._cap = decoded_cache

    def set_view(self, view: M.View) -> None:
        """Use these other cards' slots from now on (called between tokens only)."""
        keep = {cv.card: cv for cv in view.cards}
        for card in list(self.peers):
            if card not in keep or self.peers[card].generation != keep[card].generation:
                self.peers.pop(card).segment.close()
        self.peer_card[:] = -1
        self.peer_slot[:] = -1
        for cv in view.cards:
            if cv.card not in self.peers:
                try:
                    self.peers[cv.card] = PeerCard(cv, self.pool.slot_bytes)
                except Exception:  # noqa: BLE001 - the peer is gone: its experts fall back to the CPU
                    continue
            n = len(self.peers[cv.card].data)
            for layer, e, slot in cv.experts:
                if slot < n:
                    self.peer_card[layer, e], self.peer_slot[layer, e] = cv.card, slot
        self.epoch = view.epoch

    def _source(self, layer: int, e: int):
        """(where: "card" / peer card index / "cpu", cache key, the expert's three matrices' bytes)."""
        slot = int(self.pool.table[layer, e])
        if slot >= 0:
            return "card", (-1, 0, slot, layer, e), lambda: self.pool.matrices(layer, e)
        card = int(self.peer_card[layer, e])
        if card >= 0:
            p, s = self.peers[card], int(self.peer_slot[layer, e])
            return card, (card, p.generation, s, layer, e), lambda: split_slot(self.model, layer, p.data[s])
        return "cpu", None, None  # computed by the CPU pool, not decoded here

    def _blocks(self, layer: int, e: int):
        where, key, mats = self._source(layer, e)
        hit = self._decoded.get(key)
        if hit is None:
            hit = tuple(quants.decode_int(self.model.expert_type(layer, k), m) for k, m in zip(KINDS, mats()))
            self._decoded[key] = hit
            if len(self._decoded) > self._cap:
                self._decoded.popitem(last=False)
        else:
            self._decoded.move_to_end(key)
        return hit, where

    def experts(self, layer: int, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        if layer == 0:
            self.counts *= 0.5 ** (ids.shape[0] / self.HALF_LIFE_TOKENS)
        np.add.at(self.counts[layer], ids.reshape(-1), 1.0)
        qa, da = canonical.quantize_act(x)
        out = np.zeros(ids.shape + (x.shape[-1],), np.float32)
        miss = np.zeros(ids.shape, bool)
        for e in np.unique(ids):
            t, j = np.nonzero(ids == e)
            where, _, _ = self._source(layer, int(e))
            if where == "cpu":  # the CPU pool takes the whole layer's misses in one call, below
                miss[t, j] = True
                continue
            blocks, _ = self._blocks(layer, int(e))
            out[t, j] = canonical.expert(*blocks, qa[t], da[t])
            self._count(where, len(t))
        if miss.any():
            t, j = np.nonzero(miss)
            pairs = np.stack([t, ids[t, j]], axis=1).astype(np.int32)
            out[t, j] = self.cpu_pool.run(LayerJobs.from_model(self.model, layer, pairs, qa, da))
            self._count("cpu", len(t))
        return out

    def _count(self, where, n: int) -> None:
        """where: "card", "cpu" or the index of the peer card that computed."""
        if isinstance(where, str):
            setattr(self.counters, where, getattr(self.counters, where) + n)
        else:
            self.counters.peer += n
            self.counters.by_peer[where] = self.counters.by_peer.get(where, 0) + n

    def close(self) -> None:
        for p in self.peers.values():
            p.segment.close()
        self.peers.clear()

    def new_kv(self):
        return self.engine.new_kv()

    # ---- KV blocks for the host conversation cache (KvBlockCard) ------------------------------------------------
    kv_layout = kv_blocks.LAYOUT

    def kv_block_bytes(self, block_tokens: int) -> int:
        c = self.model.config
        return kv_blocks.block_bytes(c.n_layer, c.n_head_kv, c.head_dim, block_tokens)

    def kv_host_buffer(self, n_blocks: int, block_tokens: int) -> np.ndarray:
        return np.empty((n_blocks, self.kv_block_bytes(block_tokens)), np.uint8)

    def export_kv(self, kv, start: int, n_blocks: int, block_tokens: int) -> KvExport:
        return KvExport(kv_blocks.export(kv, start, n_blocks, block_tokens))

    def import_kv(self, kv, start: int, blocks: np.ndarray, block_tokens: int) -> None:
        kv_blocks.restore(kv, start, blocks, block_tokens)

    def import_kv_from(self, kv, start: int, store, slots: list[int], block_tokens: int,
                       hashes: list[bytes] | None = None) -> int:
        """By way of one host buffer: the store's read, then import_kv. The same contract as the GPU card's (the
        blocks restored up to the first taken for another block meanwhile; kv then holds (start + that) *
        block_tokens positions, untouched when none); a store that fails to give its blocks restores none (logged:
        the prompt is read instead)."""
        buf = self.kv_host_buffer(len(slots), block_tokens)
        try:
            got = store.read(slots, buf, hashes)
        except Exception:  # noqa: BLE001 - the cache is an optimisation: the prompt is read
            log.exception("reading the host conversation cache failed: the prompt is read instead")
            return 0
        if got:
            self.import_kv(kv, start, buf[:got], block_tokens)
        return got

    def forward(self, tokens, kv, logits: str = "last"):
        outs = []
        for chunk, rows, _ in chunks(tokens, logits, self.prompt_chunk):
            out = self.engine.forward(chunk, kv, "all" if logits == "all" else "last" if rows else "none")
            if rows:  # a chunk read with "none" gives the engine's hidden states, which are no logits
                outs.append(out)
        return np.concatenate(outs) if outs else None
