"""The experts no card holds, computed by a GPU card's kernels from the page-locked arena (config host_experts =
"card"): ~2 MB an expert crossing the bus instead of the CPU pool computing it.

A decode step first fetches its (at most k) experts into staging slots on the card (lane/kernels/fetch.cu: the bus
read at the SMs' best rate; gate and up, then down while gate/up computes), then computes them there: the same
kernels as for a slot, so the same bits. (A prompt chunk stages its misses itself, GpuExperts._stage, and leaves
this source nothing.)

Fetched ahead ([gpu] fetch_ahead = n > 0): a layer's misses are known only after its router, and the bus then
carries them while the card waits; between the end of one layer's fetch and the next layer's router it carries
nothing. So layer l + 1's router is run on layer l's FFN input (its residual after attention, normed by layer
l + 1's weights: the same direction the next layer's input mostly keeps) on a stream of its own, and up to n of the
arena experts it names (the likeliest first) are fetched, after layer l's own fetch, into the first n staging
slots of layer l + 1's parity. Layer l + 1's fetch then copies only the experts the prediction missed, into the
slots after those. A wrong guess costs only bus time that would have been idle, unless the guesses outlast the
window. Where the bytes come from changes nothing computed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import cupy as cp

from lane.kernels.experts import MAX_SOURCES
from lane.kernels.fetch import fetch_experts, whole_words

if TYPE_CHECKING:
    from lane.gpu_experts import GpuExperts

CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


def _event() -> cp.cuda.Event:
    return cp.cuda.Event(disable_timing=True)


class ArenaSource:
    """One more source of a card's GpuExperts: the arena's experts, read over the bus (module docstring)."""

    side = True  # on a stream of its own: the bus reads overlap this card's own experts

    def __init__(self, experts: "GpuExperts", ahead: int = 0):
        model, c = experts.model, experts.c
        self.kernels = experts.new_kernels()  # intermediates of their own: they run beside the card's kernels
        # decode: staging slots for a step's arena pairs (one token's distinct experts), where every matrix is whole
        # 16-byte words (else the kernels read the arena in place); with a fetch ahead, `ahead` slots more first,
        # and two sets (a layer's parity): layer l + 1's guesses land while layer l computes from its own
        self.k = experts.k
        self.fetch = all(whole_words(k.gate_bytes, k.down_bytes) for k in self.kernels.values())
        self.ahead = min(ahead, self.k) if self.fetch else 0
        slots = self.ahead + self.k if self.fetch else 0
        self.stage = [cp.empty((slots, experts.pool.slot_bytes), cp.uint8) for _ in range(2 if self.ahead else 1)]
        self.stage_pairs = cp.zeros((experts.max_pairs, 2), cp.int32)
        self.layouts = []
        for layer in range(c.n_layer):
            g, u, d = (model.raw(f"blk.{layer}.ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
            if g.strides[0] != u.strides[0]:
                raise ValueError(f"layer {layer}: gate and up experts of different sizes")
            self.layouts.append(self.kernels[experts.key(layer)].layout(g.ctypes.data, g.strides[0], u.ctypes.data,
                                                                       d.ctypes.data, d.strides[0]))
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.start, self.done = _event(), _event()
        self.down_stream = cp.cuda.Stream(non_blocking=True)  # a decode step's down rows, fetched beside gate/up
        self.gate_up_in, self.down_in = _event(), _event()
        if self.ahead:  # the guess: router logits and pair lists (a parity each), its streams and events
            self.logits = cp.empty((1, c.n_expert), cp.float32)
            self.ids, self.wts = cp.empty((1, self.k), cp.int32), cp.empty((1, self.k), cp.float32)
            self.pairs = cp.zeros((2, MAX_SOURCES, experts.max_pairs, 2), cp.int32)
            self.n_pairs = cp.zeros((2, MAX_SOURCES), cp.int32)
            self.rowmap = cp.zeros((experts.max_pairs,), cp.int32)
            self.ahead_out = cp.zeros((self.ahead, 2), cp.int32)
            # the guess and its fetch on streams apart: a fetch outlasting its window must not hold up the next
            # layer's guess, which the card's combine waits for (x_read)
            self.guess_stream, self.ahead_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
            self.x_in, self.x_read = _event(), _event()
            self.guessed, self.landed = [_event(), _event()], [_event(), _event()]
        self.predicted: dict[int, int] = {}  # layer -> the arena's source number, for this step's guesses

    def predict(self, layer: int, s: int, router, ex: "GpuExperts") -> cp.cuda.Event:
        """During layer - 1 of a decode step: layer's router on the card's residual x (router(out, stream) launches
        layer's RMSNorm + router into out (1, n_expert)) and its pair lists (s: the arena's source number); the
        fetch follows layer - 1's own (compute). Returns the event after which x may change."""
        if layer == 1:  # a step's first guess (any left by a step that did not finish are dropped)
            self.predicted.clear()
        par, st = layer % 2, self.guess_stream
        self.x_in.record(ex.stream)
        st.wait_event(self.x_in)
        router(self.logits, st)
        self.x_read.record(st)
        S = len(ex.sources)
        self.kernels[ex.key(layer)].route_pairs(self.logits, self.k, self.ids, self.wts, ex.src[layer],
                                                ex.slot[layer], self.pairs[par, :S], self.n_pairs[par, :S],
                                                self.rowmap, 0, 0, 0, by_weight=True, stream=st)
        self.guessed[par].record(st)
        self.predicted[layer] = s
        return self.x_read

    def compute(self, layer: int, key, s: int, T: int, tiled: bool, ex: "GpuExperts") -> None:
        """Source s's pairs of this layer, from the arena, into ex.rows[s] (join() before the combine)."""
        self.start.record(ex.stream)
        self.stream.wait_event(self.start)
        k, where = self.kernels[key], self.layouts[layer]
        if tiled:
            k.run_tiled(where, ex.pairs[s], ex.tiles[s], ex.n_tiles[s:s + 1], ex.qa, ex.da, ex.rows[s],
                        stream=self.stream)
        elif not self.fetch:
            k.run(where, ex.pairs[s], ex.n_pairs[s:s + 1], ex.qa, ex.da, ex.rows[s], stream=self.stream)
        else:  # gate and up fetched, then down on a stream of its own while gate/up computes
            par = layer % 2 if self.ahead else 0
            staged, n = k.slots(self.stage[par].data.ptr), ex.n_pairs[s:s + 1]
            guess = None
            if self.predicted.pop(layer, None) is not None:  # what was fetched ahead is not fetched again
                self.stream.wait_event(self.landed[par])
                guess = (self.pairs[par, s], self.n_pairs[par, s:s + 1], self.ahead)
            fetch = (ex.pairs[s], n, where, staged, k.gate_bytes, k.down_bytes, self.stage_pairs, self.k)
            fetch_experts(*fetch, "gate_up", guess, self.ahead, stream=self.stream)
            self.gate_up_in.record(self.stream)
            self.down_stream.wait_event(self.gate_up_in)
            fetch_experts(*fetch, "down", guess, self.ahead, stream=self.down_stream)
            self.down_in.record(self.down_stream)
            if layer + 1 in self.predicted:
                self._fetch_ahead(layer + 1, ex)
            k.run_gate_up(staged, self.stage_pairs, n, ex.qa, ex.da, stream=self.stream)
            self.stream.wait_event(self.down_in)
            # not a PDL launch: its early weight reads must follow the down fetch, which a captured programmatic
            # edge would not order (every placement's digest differed with it)
            k.run_down(staged, self.stage_pairs, n, ex.rows[s], stream=self.stream, pdl=False)
        self.done.record(self.stream)

    def _fetch_ahead(self, layer: int, ex: "GpuExperts") -> None:
        """The first `ahead` of layer's guessed arena experts into its parity's first slots, once the bus has
        carried the layer before's own (down_in) and the guess is made."""
        par, st, s = layer % 2, self.ahead_stream, self.predicted[layer]
        st.wait_event(self.guessed[par])
        st.wait_event(self.down_in)  # after layer - 2's kernels too (they ran before layer - 1's fetch): its slots
        k = self.kernels[ex.key(layer)]
        fetch_experts(self.pairs[par, s], self.n_pairs[par, s:s + 1], self.layouts[layer],
                      k.slots(self.stage[par].data.ptr), k.gate_bytes, k.down_bytes, self.ahead_out, self.ahead,
                      stream=st)
        self.landed[par].record(st)

    def join(self, ex: "GpuExperts") -> None:
        ex.stream.wait_event(self.done)

    @staticmethod
    def readable(device: int) -> bool:
        """Kernels on this device can use host pointers of registered memory as they are (x86 and UVA: yes)."""
        return bool(cp.cuda.runtime.deviceGetAttribute(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, device))
