"""A card's expert cache: fixed-size slots, each one expert's raw GGUF bytes (gate rows, up rows, down rows).

The table maps (layer, expert) -> slot (or -1). The bytes live wherever the card keeps them: a shared-memory
segment for a CPU card (so that other lanes can read them, as GPU lanes open a peer's VRAM through CUDA IPC), a
CuPy array in VRAM for a GPU card (the buffer only needs numpy-style slicing and assignment from host arrays).
"""
from __future__ import annotations

import numpy as np

from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import expert_bytes, slot_bytes, split_slot


class SlotPool:
    def __init__(self, model: ModelFile, buffer, n_slots: int, asarray=np.asarray):
        """buffer: numpy (shared memory) or cupy (VRAM) bytes; asarray moves host bytes to where buffer is."""
        c = model.config
        self.model = model
        self.slot_bytes = slot_bytes(model)
        self.n_slots = n_slots
        self.data = buffer[: max(1, n_slots) * self.slot_bytes].reshape(-1, self.slot_bytes)
        self.table = np.full((c.n_layer, c.n_expert), -1, np.int32)
        self.holds = np.full((n_slots, 2), -1, np.int32)  # slot -> (layer, expert)
        self.loads = 0  # experts copied in since start (initial fill and swaps)
        self.asarray = asarray

    @property
    def used(self) -> int:
        return int((self.holds[:, 0] >= 0).sum())

    def load(self, slot: int, layer: int, e: int) -> None:
        """Copy an expert from the arena into a slot (the old occupant is dropped first)."""
        old_l, old_e = self.holds[slot]
        if old_l >= 0:
            self.table[old_l, old_e] = -1
        raw = np.concatenate([part.reshape(-1) for part in expert_bytes(self.model, layer, e)])
        self.data[slot, : raw.size] = self.asarray(raw)
        self.holds[slot] = (layer, e)
        self.table[layer, e] = slot
        self.loads += 1

    def fill(self, experts: list[tuple[int, int]]) -> None:
        for slot, (layer, e) in enumerate(experts[: self.n_slots]):
            self.load(slot, layer, e)

    def matrices(self, layer: int, e: int) -> list[np.ndarray] | None:
        s = self.table[layer, e]
        return None if s < 0 else split_slot(self.model, layer, self.data[s])
