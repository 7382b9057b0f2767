"""A GPU card's MoE step: each routed expert computed where it is — the card's slots or the CPU pool.

Both run the canonical expert function (GPU kernels of lane/kernels/experts.cu, numba kernels of lane/cpu_pool.py),
so the bits do not depend on placement. Per layer: the routed ids come to the host (one small copy), the card's
hits are launched at once, the CPU pool computes the misses while they run, its rows go back up, and the outputs
are combined in router order on the card.
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
        self.rows = cp.empty((max_pairs, c.d_model), cp.float32)  # card results, in pair order
        self.outputs = cp.empty((max_tokens, self.k, c.d_model), cp.float32)  # router order

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
        on_card, miss = slots >= 0, slots < 0
        n_card, n_cpu = int(on_card.sum()), int(miss.sum())
        tok = np.repeat(np.arange(T, dtype=np.int32), k).reshape(T, k)
        with self.stream:
            if n_cpu:  # the quantised input comes down before the card's own experts are queued
                qa = cp.asnumpy(self.qa[:T], stream=self.stream).reshape(T, -1, 32)
                da = cp.asnumpy(self.da[:T], stream=self.stream)
            if n_card:
                card_pairs = np.stack([tok[on_card], slots[on_card]], axis=1).astype(np.int32)
                self.pairs[:n_card].set(card_pairs, stream=self.stream)
                self.n_pairs.set(np.array([n_card], np.int32), stream=self.stream)
                kern.run(self.pool.data.data.ptr, self.pairs, self.n_pairs, self.qa, self.da, self.rows,
                         stream=self.stream)
            if n_cpu:  # runs while the card computes its own experts
                cpu_pairs = np.stack([tok[miss], host_ids[miss]], axis=1).astype(np.int32)
                cpu_rows = self.cpu.run(LayerJobs.from_model(self.model, layer, cpu_pairs, qa, da))
            out = self.outputs[:T]
            flat = out.reshape(T * k, -1)  # rows in (token, router position) order, as the masks enumerate them
            if n_card:
                flat[cp.asarray(np.flatnonzero(on_card))] = self.rows[:n_card]
            if n_cpu:
                flat[cp.asarray(np.flatnonzero(miss))] = cp.asarray(cpu_rows)
            y = cp.empty((T, self.c.d_model), cp.float32)
            kern.combine(out, weights, y, stream=self.stream)
        counters.card += n_card
        counters.cpu += n_cpu
        return y
