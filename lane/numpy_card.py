"""The CPU "virtual card": the numpy reference forward, with each expert computed from where it is placed.

Experts in the card's slot pool are computed from the slot's bytes; the others by the CPU pool from the arena.
Both run the canonical expert function, so the output bits do not depend on placement (DESIGN.md).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from lane.slot_pool import SlotPool
from stratad.engine import canonical
from stratad.engine.reference import ReferenceEngine
from stratad.model import quants
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import KINDS, expert_bytes


@dataclass
class Counters:
    card: int = 0
    peer: int = 0
    cpu: int = 0

    def add(self, other: "Counters") -> None:
        self.card += other.card
        self.peer += other.peer
        self.cpu += other.cpu

    @property
    def total(self) -> int:
        return self.card + self.peer + self.cpu

    def shares(self) -> tuple[float, float, float]:
        t = self.total or 1
        return self.card / t, self.peer / t, self.cpu / t


class NumpyCard:
    kind = "cpu"

    def __init__(self, model: ModelFile, pool: SlotPool, decoded_cache: int = 512):
        self.model, self.pool = model, pool
        self.engine = ReferenceEngine(model, experts=self.experts)
        self.counters = Counters()  # since start
        self._decoded: OrderedDict = OrderedDict()  # (source, layer, expert, slot) -> IntBlocks x3
        self._cap = decoded_cache

    def _blocks(self, layer: int, e: int):
        slot = int(self.pool.table[layer, e])
        key = (layer, e, slot)
        hit = self._decoded.get(key)
        if hit is None:
            mats = self.pool.matrices(layer, e) if slot >= 0 else expert_bytes(self.model, layer, e)
            hit = tuple(quants.decode_int(self.model.expert_type(layer, k), m) for k, m in zip(KINDS, mats))
            self._decoded[key] = hit
            if len(self._decoded) > self._cap:
                self._decoded.popitem(last=False)
        else:
            self._decoded.move_to_end(key)
        return hit, slot >= 0

    def experts(self, layer: int, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        qa, da = canonical.quantize_act(x)
        out = np.zeros(ids.shape + (x.shape[-1],), np.float32)
        for e in np.unique(ids):
            t, j = np.nonzero(ids == e)
            blocks, on_card = self._blocks(layer, int(e))
            out[t, j] = canonical.expert(*blocks, qa[t], da[t])
            if on_card:
                self.counters.card += len(t)
            else:
                self.counters.cpu += len(t)
        return out

    def new_kv(self):
        return self.engine.new_kv()

    def forward(self, tokens, kv, logits: str = "last"):
        return self.engine.forward(tokens, kv, logits)
