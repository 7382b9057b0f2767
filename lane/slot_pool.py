"""A card's expert cache: fixed-size slots, each one expert's raw GGUF bytes (gate rows, up rows, down rows).

The table maps (layer, expert) -> slot (or -1). The bytes live wherever the card keeps them: a shared-memory
segment for a CPU card (so that other lanes can read them, as GPU lanes open a peer's VRAM through CUDA IPC), VRAM
for a GPU card (the buffer only needs numpy-style slicing; `write` copies host bytes into a slot's view). A slot
changes in three steps, so that the copy can run in the background (lane/slot_loader.py): drop (the table forgets
the old occupant: nothing computes from the slot any more), write (the bytes), land (the table has the new one).
"""
from __future__ import annotations

import numpy as np

from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import expert_bytes, slot_bytes, split_slot


def host_write(dst, parts: list[np.ndarray]) -> None:
    """The expert's matrices one after the other at the start of a slot (numpy memory)."""
    off = 0
    for part in parts:
        dst[off:off + part.nbytes] = part.reshape(-1)
        off += part.nbytes


class SlotPool:
    def __init__(self, model: ModelFile, buffer, n_slots: int, write=host_write):
        """buffer: numpy (shared memory) or cupy (VRAM) bytes; write(slot view, the expert's matrices in the
        arena) copies them into a slot."""
        c = model.config
        self.model = model
        self.slot_bytes = slot_bytes(model)
        self.n_slots = n_slots
        self.data = buffer[: max(1, n_slots) * self.slot_bytes].reshape(-1, self.slot_bytes)
        self.table = np.full((c.n_layer, c.n_expert), -1, np.int32)
        self.holds = np.full((n_slots, 2), -1, np.int32)  # slot -> (layer, expert)
        self.loads = 0  # experts copied in since start (initial fill and swaps)
        self.version = 0  # bumped on every table change (a GPU card re-uploads its device table)
        self.write = write

    @property
    def used(self) -> int:
        return int((self.holds[:, 0] >= 0).sum())

    def drop(self, slot: int) -> None:
        old_l, old_e = self.holds[slot]
        if old_l >= 0:
            self.table[old_l, old_e] = -1
            self.holds[slot] = (-1, -1)
            self.version += 1

    def write_bytes(self, slot: int, layer: int, e: int) -> None:
        """Copy an expert from the arena into a slot (any thread; the slot must have been dropped)."""
        self.write(self.data[slot], expert_bytes(self.model, layer, e))

    def land(self, slot: int, layer: int, e: int) -> None:
        old = self.table[layer, e]
        if old >= 0 and old != slot:  # the expert moves: its old slot is free
            self.holds[old] = (-1, -1)
        self.holds[slot] = (layer, e)
        self.table[layer, e] = slot
        self.loads += 1
        self.version += 1

    def load(self, slot: int, layer: int, e: int) -> None:
        """drop, write and land at once (placement at start, tests)."""
        self.drop(slot)
        self.write_bytes(slot, layer, e)
        self.land(slot, layer, e)

    def fill(self, experts: list[tuple[int, int]]) -> None:
        for slot, (layer, e) in enumerate(experts[: self.n_slots]):
            self.load(slot, layer, e)

    def matrices(self, layer: int, e: int) -> list[np.ndarray] | None:
        s = self.table[layer, e]
        return None if s < 0 else split_slot(self.model, layer, self.data[s])
