"""A GPU card's MoE step: each routed expert computed where it is — the card's slots, another card's slots or the
CPU pool.

All run the canonical expert function (GPU kernels of lane/kernels/experts.cu, numba kernels of lane/cpu_pool.py),
so the bits do not depend on placement. Per layer: the routed ids come to the host (one small copy), the card's
and the peers' hits are launched at once, the CPU pool computes the misses while they run, its rows go back up,
and the outputs are combined in router order on the card. Another card's slot pool is opened through its CUDA IPC
handle (from the View the coordinator sends); this version computes with peers on the same device (two logical
cards on one GPU); a peer on another GPU is not used yet and its experts run on the CPU pool.
"""
from __future__ import annotations

import os

import cupy as cp
import numpy as np

from lane.cpu_pool import CpuPool, LayerJobs
from lane.kernels.experts import ExpertKernels
from lane.slot_pool import SlotPool
from stratad.model.gguf_file import ModelFile


class GpuExperts:
    def __init__(self, model: ModelFile, pool: SlotPool, max_tokens: int, cpu_threads: int, stream: cp.cuda.Stream):
        c = model.config
        self.model, self.c, self.pool, self.stream = model, c, pool, stream
        self.k, self.max_tokens = c.n_expert_used, max_tokens
        max_pairs = max_tokens * self.k
        self.kernels = {}
        for layer in range(c.n_layer):
            key = (model.expert_type(layer, "gate"), model.expert_type(layer, "down"))
            if model.expert_type(layer, "up") != key[0]:
                raise ValueError(f"layer {layer}: gate and up experts of different types are not supported on GPU")
            if key not in self.kernels:
                self.kernels[key] = ExpertKernels(c.d_model, c.d_ff_expert, key[0], key[1], max_pairs,
                                                  slot_stride=pool.slot_bytes)
        self.cpu = CpuPool(cpu_threads or os.cpu_count() or 1)
        self.qa = cp.empty((max_tokens, c.d_model), cp.int8)
        self.da = cp.empty((max_tokens, c.d_model // 32), cp.float32)
        self.pairs = cp.zeros((max_pairs, 2), cp.int32)
        self.n_pairs = cp.zeros((1,), cp.int32)
        self.rows = cp.empty((max_pairs, c.d_model), cp.float32)  # one launch's results, in pair order
        self.peers: dict[int, tuple[int, str, int]] = {}  # card -> (generation, IPC handle, opened pointer)
        self.peer_card = np.full((c.n_layer, c.n_expert), -1, np.int32)
        self.peer_slot = np.full((c.n_layer, c.n_expert), -1, np.int32)
        self.outputs = cp.empty((max_tokens, self.k, c.d_model), cp.float32)  # router order

    # ---- peers ----------------------------------------------------------------------------------------------
    def set_view(self, view, own_device: str) -> None:
        """Use these other cards' slots from now on (between tokens: nothing in flight uses the old ones)."""
        self.stream.synchronize()
        same = {cv.card: cv for cv in view.cards if cv.device == own_device and cv.pool}
        for card, (gen, handle, ptr) in list(self.peers.items()):
            if card not in same or same[card].generation != gen or same[card].pool != handle:
                cp.cuda.runtime.ipcCloseMemHandle(ptr)
                del self.peers[card]
        self.peer_card[:] = -1
        self.peer_slot[:] = -1
        for cv in same.values():
            if cv.card not in self.peers:
                try:
                    ptr = cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(cv.pool))
                except cp.cuda.runtime.CUDARuntimeError:  # the peer is gone: its experts run on the CPU
                    continue
                self.peers[cv.card] = (cv.generation, cv.pool, ptr)
            for layer, e, slot in cv.experts:
                self.peer_card[layer, e], self.peer_slot[layer, e] = cv.card, slot

    def close(self) -> None:
        self.stream.synchronize()
        for _, _, ptr in self.peers.values():
            cp.cuda.runtime.ipcCloseMemHandle(ptr)
        self.peers.clear()

    # ---- compute --------------------------------------------------------------------------------------------
    def __call__(self, layer: int, h: cp.ndarray, ids: cp.ndarray, weights: cp.ndarray, counters,
                 counts: np.ndarray) -> cp.ndarray:
        """h (T, d_model) normalised input, ids / weights (T, k) router output -> combined output (T, d_model).
        Counts where each expert ran (counters) and the live routing counts (counts, for placement)."""
        T, k = ids.shape
        kern = self.kernels[(self.model.expert_type(layer, "gate"), self.model.expert_type(layer, "down"))]
        with self.stream:
            kern.quantize(h, self.qa[:T], self.da[:T], stream=self.stream)
            host_ids = cp.asnumpy(ids, stream=self.stream)  # the layer's one wait for the card
        np.add.at(counts[layer], host_ids.reshape(-1), 1.0)
        slots = self.pool.table[layer][host_ids]  # (T, k)
        peer = np.where(slots < 0, self.peer_card[layer][host_ids], -1)
        peer_slots = self.peer_slot[layer][host_ids]
        tok = np.repeat(np.arange(T, dtype=np.int32), k).reshape(T, k)
        # (device pointer of a slot pool, which pairs, their slots, where they count)
        launches = [(self.pool.data.data.ptr, slots >= 0, slots, "card")]
        launches += [(ptr, peer == card, peer_slots, card) for card, (_, _, ptr) in self.peers.items()]
        miss = (slots < 0) & (peer < 0)
        n_cpu = int(miss.sum())
        out = self.outputs[:T]
        flat = out.reshape(T * k, -1)  # rows in (token, router position) order, as the masks enumerate them
        with self.stream:
            if n_cpu:  # the quantised input comes down before the cards' experts are queued
                qa = cp.asnumpy(self.qa[:T], stream=self.stream).reshape(T, -1, 32)
                da = cp.asnumpy(self.da[:T], stream=self.stream)
            for ptr, mask, where_slots, where in launches:
                n = int(mask.sum())
                if not n:
                    continue
                pairs = np.stack([tok[mask], where_slots[mask]], axis=1).astype(np.int32)
                self.pairs[:n].set(pairs, stream=self.stream)
                self.n_pairs.set(np.array([n], np.int32), stream=self.stream)
                kern.run(ptr, self.pairs, self.n_pairs, self.qa, self.da, self.rows, stream=self.stream)
                flat[cp.asarray(np.flatnonzero(mask))] = self.rows[:n]  # in stream order, before the next launch
                if where == "card":
                    counters.card += n
                else:
                    counters.peer += n
                    counters.by_peer[where] = counters.by_peer.get(where, 0) + n
            if n_cpu:  # runs while the cards compute their experts
                cpu_pairs = np.stack([tok[miss], host_ids[miss]], axis=1).astype(np.int32)
                cpu_rows = self.cpu.run(LayerJobs.from_model(self.model, layer, cpu_pairs, qa, da))
                flat[cp.asarray(np.flatnonzero(miss))] = cp.asarray(cpu_rows)
            y = cp.empty((T, self.c.d_model), cp.float32)
            kern.combine(out, weights, y, stream=self.stream)
        counters.cpu += n_cpu
        return y
