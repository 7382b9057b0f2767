"""A grid-wide barrier for persistent kernels (grid_sync.cu), launched cooperatively so that every block is resident
at once, and the two costs the persistent decode plan weighs: a grid barrier against a kernel boundary (a launch
that only does the PDL handshake, many in one graph). The plan is in docs/perf-notes.md.

  GridSync(device).rounds(r) -> out     r rounds of publish / barrier / read a neighbour / barrier
  barrier_rounds_ref(nb, r)             what out must hold
  GridSync(device).boundaries(n)        n boundary_only launches on the current stream
"""
from __future__ import annotations

import numpy as np

from .compile import load_module
from .launch import launch

THREADS = 256


def barrier_rounds_ref(nb: int, rounds: int) -> np.ndarray:
    """out[b] = sum over rounds r of the value block (b + r + 1) % nb published in round r, r * nb + that block."""
    b = np.arange(nb, dtype=np.int64)
    return sum(r * nb + (b + r + 1) % nb for r in range(rounds)) if rounds else np.zeros(nb, np.int64)


class GridSync:
    def __init__(self, device: int | None = None, blocks: int | None = None):
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
        with self.device:
            self.module = load_module("grid_sync.cu", device=self.device.id)
            self.k_rounds = self.module.get_function("barrier_rounds")
            self.k_boundary = self.module.get_function("boundary_only")
            # one block an SM: resident together on any device this size (the cooperative launch checks it)
            self.blocks = int(blocks or self.device.attributes["MultiProcessorCount"])
            self.count = cupy.zeros((1,), cupy.uint32)
            self.gen = cupy.zeros((1,), cupy.uint32)
            self.slots = cupy.zeros((self.blocks,), cupy.int32)
            self.x = cupy.zeros((1,), cupy.int32)

    def rounds(self, rounds: int, out=None, pdl: bool = True):
        """Run barrier_rounds on the current stream; out: (blocks,) int64 (made here if None); pdl: with a
        programmatic edge when captured, as a decode step's launches."""
        cp = self.cp
        out = cp.empty((self.blocks,), cp.int64) if out is None else out
        if out.shape != (self.blocks,) or out.dtype != cp.int64:
            raise ValueError(f"out must be ({self.blocks},) int64")
        launch(self.k_rounds, (self.blocks,), (THREADS,), (self.count, self.gen, self.slots, out, np.int32(rounds)),
               pdl=pdl, cooperative=True)
        return out

    def boundaries(self, n: int, pdl: bool = True) -> None:
        for _ in range(n):
            launch(self.k_boundary, (self.blocks,), (THREADS,), (self.x,), pdl=pdl)
