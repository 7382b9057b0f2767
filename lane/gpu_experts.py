"""A GPU card's MoE step: each routed expert computed where it is — the card's slots, another card's slots or the
CPU pool — with no per-expert Python and, when the card and its peers hold every expert, no host involvement.

All run the canonical expert function (GPU kernels of lane/kernels/experts.cu, numba kernels of lane/cpu_pool/),
so the bits do not depend on placement. A layer is two halves around the host:
  front : quantise the input, build_pairs on the device (per source: this card, each peer pool on this GPU; the
          rest is the CPU's miss list in mapped host memory), then, if the CPU may have work, copy the quantised
          input to pinned host memory and ring the doorbell; then the expert kernels of every source. A prompt
          chunk (T > 1, run eagerly) instead copies the layer's experts that no card holds into staging slots on
          the card (one more source: its tokens share each expert's bytes, which cross the bus once) and runs the
          tiled kernels (a weight decoded once for all of an expert's tokens).
  serve : (host, decode steps with some expert on no card) wait for the doorbell, run the misses on the CPU pool
          into pinned host rows — while the card's kernels run.
  back  : combine in router order into the residual, card rows and host rows through the row map.
front and back only launch kernels with fixed grids (counts are read on the device), so the card captures them
in CUDA graphs. Tables (expert -> source, slot) live on the device and are refreshed between steps.
Another card's pool is opened through its CUDA IPC handle (from the coordinator's View): on this GPU its experts
run here; on another GPU they run there (RemotePool), the input going over and the result rows coming back. With
host_experts = "card" the experts no card holds are one more source, the page-locked arena, read over the bus by
this card (lane/arena_source.py: a decode step's fetched into staging slots first, the next layer's guessed
ahead) instead of being computed by the CPU pool; host_cpu_share > 0 leaves part of them to the CPU pool, which
computes it while the card reads the rest (lane/host_split.py). Sources with a stream of their own (RemotePool, ArenaSource) are launched first and joined
before the combine, so they overlap this card's work.
"""
from __future__ import annotations

import logging
import os

import cupy as cp
import numpy as np

from lane import host_lock
from lane.arena_source import ArenaSource
from lane.cpu_pool import CpuPool, LayerJobs
from lane.expert_counts import entries_by_source, routed_counts
from lane.host_split import check_share, cpu_side
from lane.kernels.experts import MAX_SOURCES, ExpertKernels, Tuning, max_tiles
from lane.slot_pool import SlotPool
from stratad.config import GpuOptions
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import expert_bytes

log = logging.getLogger("stratad.lane")
H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyHostToDevice, DeviceToHost, DeviceToDevice


def pinned(shape, dtype) -> np.ndarray:
    """A numpy array in page-locked host memory (with unified addressing its address is valid on the device)."""
    n = int(np.prod(shape))
    mem = cp.cuda.alloc_pinned_memory(max(16, n * np.dtype(dtype).itemsize))
    return np.frombuffer(mem, dtype, n).reshape(shape)


class PeerPool:
    """Another card's slot pool on this GPU, opened through its CUDA IPC handle: its experts run here."""

    remote = False
    side = False  # computed by compute() on a stream of its own, joined by join() before the combine

    def __init__(self, card: int, generation: int, handle: str):
        self.card, self.generation, self.handle = card, generation, handle
        self.ptr = cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(handle))

    def close(self) -> None:
        cp.cuda.runtime.ipcCloseMemHandle(self.ptr)


class RemotePool(PeerPool):
    """A peer card's slot pool on another GPU, computed there: the pool is opened on its device, the layer's
    quantised input and pair list are copied over, that device's expert kernels run on its own stream and the
    result rows come back (cudaMemcpyPeer: over NVLink / PCIe P2P where the cards have it; through page-locked host
    memory with [gpu] peer_copy = "host"), while this card computes its own experts. Decode steps capture it with the
    rest (events join its stream to this card's)."""

    remote = True
    side = True

    def __init__(self, card: int, generation: int, handle: str, device: int, experts: "GpuExperts"):
        self.device = device
        self.here = experts.stream.device_id
        # its input in and its rows back: peer to peer (cudaMemcpyPeer: NVLink / PCIe P2P where the topology
        # allows, else the driver stages them), or through page-locked host memory of our own ([gpu] peer_copy)
        self.via_host = experts.options.peer_copy == "host"
        with cp.cuda.Device(device):
            super().__init__(card, generation, handle)
            for a, b in ((self.here, device), (device, self.here)):
                if a != b and not self.via_host and cp.cuda.runtime.deviceCanAccessPeer(a, b):
                    with cp.cuda.Device(a):
                        try:
                            cp.cuda.runtime.deviceEnablePeerAccess(b)
                        except cp.cuda.runtime.CUDARuntimeError:  # already enabled
                            pass
            c, P = experts.c, experts.max_pairs
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.kernels = experts.new_kernels()
            self.qa, self.da = cp.empty_like(experts.qa), cp.empty_like(experts.da)
            self.pairs, self.n_pairs = cp.empty((P, 2), cp.int32), cp.empty((1,), cp.int32)
            self.tiles, self.n_tiles = cp.empty(experts.tiles.shape[1:], cp.int32), cp.empty((1,), cp.int32)
            self.rows = cp.empty((P, c.d_model), cp.float32)
            self.done = cp.cuda.Event(disable_timing=True)
        if self.via_host:  # the staging: one page-locked twin of each buffer that crosses
            self.h_in = {id(b): pinned((b.nbytes,), np.uint8) for b in
                         (self.qa, self.da, self.pairs, self.n_pairs, self.tiles, self.n_tiles)}
            self.h_rows = pinned((self.rows.nbytes,), np.uint8)
        self.rows_back = None  # (rows of this card, bytes): what the last compute() returns at join()
        with cp.cuda.Device(self.here):
            self.start = cp.cuda.Event(disable_timing=True)

    def compute(self, layer: int, key, s: int, T: int, tiled: bool, ex: "GpuExperts") -> None:
        """Source s's pairs of this layer (built on this card) computed on the peer's GPU, rows back into
        ex.rows[s] (join() before the combine)."""
        rt, here, there = cp.cuda.runtime, self.here, self.device
        copies = [(self.qa, ex.qa, T * ex.qa.shape[1]), (self.da, ex.da, T * ex.da.shape[1] * 4),
                  (self.pairs, ex.pairs[s], T * ex.k * 8), (self.n_pairs, ex.n_pairs[s:s + 1], 4)]
        if tiled:
            copies += [(self.tiles, ex.tiles[s], self.tiles.nbytes), (self.n_tiles, ex.n_tiles[s:s + 1], 4)]
        if self.via_host:  # this card's copy engine writes the staging, the peer's reads it
            for dst, src, n in copies:
                rt.memcpyAsync(self.h_in[id(dst)].ctypes.data, src.data.ptr, n, D2H, ex.stream.ptr)
        self.start.record(ex.stream)
        self.stream.wait_event(self.start)
        n_rows = T * ex.k * self.rows.shape[1] * 4
        self.rows_back = (ex.rows[s], n_rows)
        with cp.cuda.Device(there):
            for dst, src, n in copies:
                if self.via_host:
                    rt.memcpyAsync(dst.data.ptr, self.h_in[id(dst)].ctypes.data, n, H2D, self.stream.ptr)
                else:
                    rt.memcpyPeerAsync(dst.data.ptr, there, src.data.ptr, here, n, self.stream.ptr)
            k = self.kernels[key]
            if tiled:
                k.run_tiled(self.ptr, self.pairs, self.tiles, self.n_tiles, self.qa, self.da, self.rows,
                            stream=self.stream)
            else:
                k.run(self.ptr, self.pairs, self.n_pairs, self.qa, self.da, self.rows, stream=self.stream)
            if self.via_host:
                rt.memcpyAsync(self.h_rows.ctypes.data, self.rows.data.ptr, n_rows, D2H, self.stream.ptr)
            else:
                rt.memcpyPeerAsync(ex.rows[s].data.ptr, here, self.rows.data.ptr, there, n_rows, self.stream.ptr)
            self.done.record(self.stream)

    def join(self, ex: "GpuExperts") -> None:
        """This card's stream waits for the last compute() (issued after this card's own experts: they overlap);
        through host memory, the rows then come in on this card's copy engine."""
        ex.stream.wait_event(self.done)
        if self.via_host:
            rows, n = self.rows_back
            cp.cuda.runtime.memcpyAsync(rows.data.ptr, self.h_rows.ctypes.data, n, H2D, ex.stream.ptr)

    def close(self) -> None:
        with cp.cuda.Device(self.device):
            self.stream.synchronize()
            super().close()


def device_index(bus_id: str) -> int | None:
    """The CUDA device with this PCI bus id (as lanes report it, after "cuda:"), or None."""
    for i in range(cp.cuda.runtime.getDeviceCount()):
        if cp.cuda.runtime.deviceGetPCIBusId(i).lower() == bus_id.lower():
            return i
    return None


class GpuExperts:
    def __init__(self, model: ModelFile, pool: SlotPool, max_tokens: int, cpu_threads: int, stream: cp.cuda.Stream,
                 own_device: str, host_experts: str = "card", options: GpuOptions = GpuOptions(),
                 tuning: Tuning | None = None, host_cpu_share: float = 0.0, counts: np.ndarray | None = None):
        """counts (n_layer, n_expert): the card's live routing counts (updated in place), which host_cpu_share's
        split of the experts no card holds follows."""
        c = model.config
        self.options, self.tuning = options, tuning or Tuning()
        self.model, self.c, self.pool, self.stream, self.own_device = model, c, pool, stream, own_device
        self.k, self.max_tokens = c.n_expert_used, max_tokens
        P = self.max_pairs = max_tokens * self.k
        self.kernels = self.new_kernels()
        self.cpu = CpuPool(cpu_threads or os.cpu_count() or 1)
        self.qa = cp.empty((max_tokens, c.d_model), cp.int8)
        self.da = cp.empty((max_tokens, c.d_model // 32), cp.float32)
        # expert -> (source, slot), on the device for build_pairs and on the host for the counters
        self.src = cp.full((c.n_layer, c.n_expert), -1, cp.int32)
        self.slot = cp.full((c.n_layer, c.n_expert), -1, cp.int32)
        self.h_src = np.full((c.n_layer, c.n_expert), -1, np.int32)
        self.pairs = cp.zeros((MAX_SOURCES, P, 2), cp.int32)
        self.n_pairs = cp.zeros((MAX_SOURCES,), cp.int32)
        # prompt chunks: each source's pairs cut into tiles of one expert (the tiled kernels decode a weight once
        # for all of a tile's tokens)
        tile = min(k.tile_p for k in self.kernels.values())  # the most tiles: the shortest (a layer's types set it)
        self.tiles = cp.zeros((MAX_SOURCES, max_tiles(P, c.n_expert, tile), 2), cp.int32)
        self.n_tiles = cp.zeros((MAX_SOURCES,), cp.int32)
        self.rowmap = cp.zeros((P,), cp.int32)
        self.rows = None  # (sources + staging, P, d_model): each source's results, sized when the sources are known
        # prompt chunks: the layer's experts that no card holds are copied into staging slots and computed here
        # (one more source), instead of by the CPU pool: a chunk's tokens share each expert's bytes. A large chunk
        # routes to nearly every expert, so all of them are staged a layer ahead, on a copy stream, into the other
        # of two buffers (the copies overlap the previous layer's work and need no wait for the router); a small
        # chunk copies the routed ones after reading its router's choice
        self._stage_mem = [cp.cuda.Memory(c.n_expert * pool.slot_bytes) for _ in range(2)]
        self._stage_stream = cp.cuda.Stream(non_blocking=True)
        self._landed = [cp.cuda.Event(disable_timing=True) for _ in range(2)]  # a buffer's copies are done
        self._freed = [cp.cuda.Event(disable_timing=True) for _ in range(2)]  # the kernels reading it are done
        self._ahead = None  # the layer last staged ahead
        self.src_staged = cp.empty((c.n_expert,), cp.int32)
        self.slot_staged = cp.empty((c.n_expert,), cp.int32)
        self.src_ahead = cp.empty((c.n_layer, c.n_expert), cp.int32)  # tables with every off-card expert staged
        self.slot_ahead = cp.empty((c.n_layer, c.n_expert), cp.int32)
        self.staged: dict[int, np.ndarray] = {}  # layer -> experts staged in this step (they count as the card's)
        self.h_slot = np.full((c.n_layer, c.n_expert), -1, np.int32)
        # at start: pinning a large file takes seconds, not to be spent inside a request
        self._arena_lock = host_lock.lock(self, model.mapping)
        # decode steps: the experts no card holds run on the CPU pool, or on this card from the arena
        if host_experts not in ("cpu", "card"):
            raise ValueError(f"host_experts must be 'cpu' or 'card', not {host_experts!r}")
        self.host_cpu_share = check_share(host_cpu_share)
        self.counts = counts if counts is not None else np.zeros((c.n_layer, c.n_expert))
        self.arena = None
        self._x_read = None  # the event back() waits for after a guess (predict)
        if host_experts == "card":
            try:
                if self._arena_lock is None or not self._arena_lock.mapped or \
                        not ArenaSource.readable(stream.device_id):
                    raise ValueError("the arena is not page-locked and mapped for this GPU")
                self.arena = ArenaSource(self, options.fetch_ahead)
            except ValueError as e:
                log.warning("host_experts = card: %s; the CPU pool computes the experts no card holds", e)
        # the host's side of a decode step: miss list, quantised input and result rows in pinned memory, and the
        # doorbell (prompt chunks stage their misses on the card)
        self.miss, self.n_miss = pinned((self.k, 2), np.int32), pinned((1,), np.int32)
        self.qa_h, self.da_h = pinned((1, c.d_model), np.int8), pinned((1, c.d_model // 32), np.float32)
        self.host_rows = pinned((self.k, c.d_model), np.float32)
        self.bell = pinned((1,), np.uint32)
        self.bell[0] = 0
        self.counter = cp.zeros((1,), cp.uint32)
        self.rings = 0
        # peers: card -> its opened pool; their tables from the last View
        self.peers: dict[int, PeerPool] = {}
        self.peer_card = np.full((c.n_layer, c.n_expert), -1, np.int32)
        self.peer_slot = np.full((c.n_layer, c.n_expert), -1, np.int32)
        self.sources: list[tuple] = []  # (card, pool pointer, PeerPool or None); source 0 is this card
        self._version = None
        self._view_version = 0
        self.full = False
        self.on_card = np.zeros((c.n_layer, c.n_expert), bool)

    def key(self, layer: int):
        """The layer's expert types (gate/up, down): which ExpertKernels instance computes it."""
        return self.model.expert_type(layer, "gate"), self.model.expert_type(layer, "down")

    def new_kernels(self) -> dict:
        """One ExpertKernels per layer shape (on the current device), each with its own intermediates."""
        c, out = self.c, {}
        for layer in range(c.n_layer):
            key = self.key(layer)
            if key not in out:
                out[key] = ExpertKernels(c.d_model, c.d_ff_expert, key[0], key[1], self.max_pairs,
                                         slot_stride=self.pool.slot_bytes, tuning=self.tuning)
        return out

    # ---- placement ------------------------------------------------------------------------------------------
    def set_view(self, view) -> None:
        """Use these other cards' slots from the next step on (nothing in flight uses the old ones). Peers on this
        GPU are computed here; peers on another GPU there (RemotePool; [gpu] peers_as_remote treats same-GPU peers
        that way too, to test that path on one GPU)."""
        self.stream.synchronize()
        cards = {cv.card: cv for cv in view.cards if cv.pool and cv.device.startswith("cuda:")}
        for card, p in list(self.peers.items()):
            cv = cards.get(card)
            if cv is None or cv.generation != p.generation or cv.pool != p.handle:
                p.close()
                del self.peers[card]
        self.peer_card[:] = -1
        self.peer_slot[:] = -1
        for cv in list(cards.values())[: MAX_SOURCES - 2]:  # sources: this card, peers, the staging slots
            if cv.card not in self.peers:
                try:
                    self.peers[cv.card] = self._open(cv)
                except cp.cuda.runtime.CUDARuntimeError as e:  # the peer is gone: its experts run on the CPU
                    log.info("card %d's pool could not be opened (%s)", cv.card, e)
                    continue
                if self.peers[cv.card] is None:
                    del self.peers[cv.card]
                    continue
            for layer, e, slot in cv.experts:
                self.peer_card[layer, e], self.peer_slot[layer, e] = cv.card, slot
        self._view_version += 1

    def _open(self, cv) -> PeerPool | None:
        if cv.device == self.own_device and not self.options.peers_as_remote:
            return PeerPool(cv.card, cv.generation, cv.pool)
        dev = device_index(cv.device[len("cuda:"):])
        if dev is None:  # not a GPU this process can see
            return None
        return RemotePool(cv.card, cv.generation, cv.pool, dev, self)

    @property
    def remote(self) -> bool:
        """A peer on another GPU is in use (its work is on that GPU's stream)."""
        return any(p.remote for p in self.peers.values())

    def forget_tables(self) -> None:
        """The pool was replaced (CupyCard.fit_pool): the next refresh rebuilds the tables and sources."""
        self._version = None

    def refresh(self) -> None:
        """Bring the device tables up to the pool's slots and the view (between steps, on the card's stream)."""
        version = (self.pool.version, self._view_version)
        if version == self._version:
            return
        self.sources = [(None, self.pool.data.data.ptr, None)] + [(card, p.ptr, p) for card, p in self.peers.items()]
        src = np.where(self.pool.table >= 0, 0, -1).astype(np.int32)
        slot = self.pool.table.copy()
        for s, (card, _, _) in enumerate(self.sources[1:], start=1):
            m = (src < 0) & (self.peer_card == card)
            src[m], slot[m] = s, self.peer_slot[m]
        self.on_card = src >= 0  # in some card's slots (what prompt chunks do not stage)
        # the rest: expert e of the layer's arena tensors, less the CPU pool's share (no arena source when the
        # cards hold every expert: no side stream and no empty launches in each layer of a step)
        if self.arena is not None:
            m = (src < 0) & ~cpu_side(src < 0, self.counts, self.host_cpu_share)
            if m.any():
                self.sources.append((None, None, self.arena))
                src[m] = len(self.sources) - 1
                slot[m] = np.broadcast_to(np.arange(self.c.n_expert, dtype=np.int32), src.shape)[m]
        self.src.set(src, stream=self.stream)
        self.slot.set(slot, stream=self.stream)
        self.h_src, self.h_slot = src, slot
        self.full = bool((src >= 0).all())
        src_a, slot_a = src.copy(), slot.copy()  # staging is the source after the others
        src_a[~self.on_card] = len(self.sources)
        slot_a[~self.on_card] = (np.cumsum(~self.on_card, axis=1) - 1)[~self.on_card]
        self.src_ahead.set(src_a, stream=self.stream)
        self.slot_ahead.set(slot_a, stream=self.stream)
        S, d = len(self.sources), self.c.d_model
        if self.rows is None or self.rows.shape[0] != S + 1:
            self.rows = cp.empty((S + 1, self.max_pairs, d), cp.float32)
        self._version = version

    def inputs(self, T: int) -> tuple[cp.ndarray, cp.ndarray]:
        """Where front() reads a layer's T rows of quantised input (int8 (T, d_model), scales (T, d_model / 32))."""
        return self.qa[:T], self.da[:T]

    def sources_key(self) -> tuple:
        """What a captured step depends on besides the tables: the pool pointers and the row buffer."""
        return tuple(ptr for _, ptr, _ in self.sources) + (self.rows.data.ptr,)

    # ---- one layer ------------------------------------------------------------------------------------------
    def front(self, layer: int, T: int, ids: cp.ndarray, export: bool, router=None, x=None) -> None:
        """ids (T, k) router choice for the T rows of input in self.qa / self.da (quantised by the RMSNorm that
        made them, `inputs`): route and launch the cards' experts. router = (logits (1, n_expert), weights (1, k))
        for a decode step: ids and weights are made here, in the launch that builds the pair lists. A prompt
        chunk (T > 1, run eagerly) first stages the experts no card holds; a decode step leaves them to the arena
        source (host_experts = "card") or to the CPU pool (export: the doorbell for serve). x: the residual, which
        a decode step with every expert on this card updates in its down kernel (back() then has nothing to do)."""
        s = self.stream
        kern = self.kernels[self.key(layer)]
        sources = list(self.sources)
        src, slot = self.src[layer], self.slot[layer]
        buf = None
        if T > 1 and not self.on_card.all():
            if T * self.k >= 4 * self.c.n_expert:  # ~every expert routed: all of them staged, a layer ahead
                buf = self._stage_ahead(layer)
                src, slot = self.src_ahead[layer], self.slot_ahead[layer]
            else:
                buf = 0
                src, slot = self._stage(layer, ids)
            sources.append((None, self._stage_mem[buf].ptr, None))
        S = len(sources)
        tiled = T > 1
        # the CPU misses' list in mapped host memory, only where the host serves them (export): else no entry
        # can miss, and the kernel skips the count and its system-wide fence
        miss = (self.miss.ctypes.data, self.n_miss.ctypes.data, self.miss.shape[0]) if export else (0, 0, 0)
        if router is not None and T == 1:
            kern.route_pairs(router[0], self.k, ids, router[1], src, slot, self.pairs[:S], self.n_pairs[:S],
                             self.rowmap, *miss, stream=s)
        else:
            kern.build_pairs(ids, src, slot, self.pairs[:S], self.n_pairs[:S], self.rowmap, *miss,
                             self.tiles[:S] if tiled else None,
                             self.n_tiles[:S] if tiled else None, stream=s)
        if export:
            rt = cp.cuda.runtime
            rt.memcpyAsync(self.qa_h.ctypes.data, self.qa.data.ptr, T * self.qa.shape[1], D2H, s.ptr)
            rt.memcpyAsync(self.da_h.ctypes.data, self.da.data.ptr, T * self.da.shape[1] * 4, D2H, s.ptr)
            kern.ring(self.counter, self.bell.ctypes.data, stream=s)
        side = [(i, p) for i, (_, _, p) in enumerate(sources) if p is not None and p.side]
        for i, p in side:  # peers on other GPUs and the arena first, on streams of their own, so that they overlap
            p.compute(layer, self.key(layer), i, T, tiled, self)  # the experts this card computes below
        for i, (_, ptr, p) in enumerate(sources):
            if p is not None and p.side:
                continue
            if tiled:
                kern.run_tiled(ptr, self.pairs[i], self.tiles[i], self.n_tiles[i:i + 1], self.qa, self.da,
                               self.rows[i], stream=s)
            else:
                fold = router is not None and x is not None and self.combined_in_down(T, layer)
                kern.run(ptr, self.pairs[i], self.n_pairs[i:i + 1], self.qa, self.da, self.rows[i],
                         combine=(self.rowmap, router[1], x) if fold else None, stream=s)
        for _, p in side:
            p.join(self)
        if buf is not None:
            self._freed[buf].record(s)

    def _stage_ahead(self, layer: int) -> int:
        """This card's stream waits for the layer's staged experts (copied now if they were not staged ahead);
        the next layer's start copying into the other buffer. Returns the layer's buffer."""
        if self._ahead != layer:  # the chunk's first layer
            self._issue(layer)
        self.stream.wait_event(self._landed[layer % 2])
        if layer + 1 < self.c.n_layer:
            self._issue(layer + 1)
        return layer % 2

    def _issue(self, layer: int) -> None:
        """Copy every expert of the layer that no card holds into its buffer, on the staging stream, once the
        kernels that last read that buffer are done."""
        b, st = layer % 2, self._stage_stream
        st.wait_event(self._freed[b])
        missing = np.flatnonzero(~self.on_card[layer])
        self._copy_experts(layer, missing, self._stage_mem[b].ptr, st)
        self._landed[b].record(st)
        self.staged[layer] = missing
        self._ahead = layer

    def _copy_experts(self, layer: int, experts: np.ndarray, base: int, stream: cp.cuda.Stream) -> None:
        """Experts' bytes from the arena into consecutive staging slots at base (DMA where it is page-locked)."""
        rt, stride = cp.cuda.runtime, self.pool.slot_bytes
        for j, e in enumerate(experts.tolist()):
            off = 0
            for part in expert_bytes(self.model, layer, e):
                rt.memcpyAsync(base + j * stride + off, part.ctypes.data, part.nbytes, H2D, stream.ptr)
                off += part.nbytes

    def _stage(self, layer: int, ids: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
        """Copy the layer's routed experts that no card holds into the staging slots (straight from the arena,
        page-locked where the driver allows); returns the layer's (source, slot) rows pointing at them."""
        routed = np.unique(cp.asnumpy(ids, stream=self.stream))  # the chunk's one wait for the card per layer
        missing = routed[~self.on_card[layer][routed]]
        self.staged[layer] = missing
        if not missing.size:
            return self.src[layer], self.slot[layer]
        self._copy_experts(layer, missing, self._stage_mem[0].ptr, self.stream)
        src, slot = self.h_src[layer].copy(), self.h_slot[layer].copy()
        src[missing], slot[missing] = len(self.sources), np.arange(missing.size, dtype=np.int32)
        self.src_staged.set(src, stream=self.stream)
        self.slot_staged.set(slot, stream=self.stream)
        return self.src_staged, self.slot_staged

    def serve(self, layer: int, T: int) -> None:
        """Host: after the layer's doorbell, compute its CPU misses into the pinned rows (the card keeps going)."""
        self.rings += 1
        self._wait(self.rings & 0xFFFFFFFF)
        n = int(self.n_miss[0])
        if n > self.miss.shape[0]:  # a decode step has at most k misses; more means bad router ids
            raise RuntimeError(f"layer {layer}: {n} experts to compute on the CPU for one token")
        if n:
            jobs = LayerJobs.from_model(self.model, layer, self.miss[:n], self.qa_h[:T].reshape(T, -1, 32),
                                        self.da_h[:T])
            self.cpu.run(jobs, out=self.host_rows[:n])

    def combined_in_down(self, T: int, layer: int) -> bool:
        """Whether a step of T tokens has its combine done by the layer's down kernel: one token, every expert on
        this card (the only source), so its k rows all come from that launch, where the kernel's shape folds k."""
        return T == 1 and len(self.sources) == 1 and self.full and \
            self.kernels[self.key(layer)].fold_smem(self.k) is not None

    def predict(self, layer: int, router) -> None:
        """A decode step, during layer - 1: guess the layer's arena experts from layer - 1's residual (router(out,
        stream) launches the layer's RMSNorm + router) and fetch them ahead (ArenaSource; [gpu] fetch_ahead). Only
        where every expert has a source on the card's side (full: the step is one graph, no host break)."""
        a = self.arena
        if a is None or not a.ahead or not self.full or not self.sources or self.sources[-1][2] is not a:
            return
        self._x_read = a.predict(layer, len(self.sources) - 1, router, self)

    def back(self, layer: int, weights: cp.ndarray, x: cp.ndarray) -> None:
        """x (T, d_model) += the routed experts' outputs, weighted in router order (unless the down kernel did)."""
        if self._x_read is not None:  # a guess reads x before this changes it
            self.stream.wait_event(self._x_read)
            self._x_read = None
        if self.combined_in_down(x.shape[0], layer):
            return
        self.kernels[self.key(layer)].combine_rows(self.rows, self.host_rows.ctypes.data, self.rowmap, weights, x,
                                                    stream=self.stream)

    def _wait(self, want: int) -> None:
        bell, spins = self.bell, 0
        while bell[0] != want:
            spins += 1
            if spins % 1024 == 0 and self.stream.done and bell[0] != want:
                self.stream.synchronize()  # surfaces a device error, if that is why the bell is silent
                raise RuntimeError(f"the card finished without ringing the doorbell (want {want}, "
                                   f"bell {int(bell[0])})")

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def tally(self, ids: np.ndarray, counters, counts: np.ndarray) -> None:
        """ids (n_layer, T, k) of a finished step: where each expert ran (counters), live routing counts."""
        c = routed_counts(ids, self.c.n_expert)
        counts += c
        by_source = entries_by_source(ids, c, self.h_src, self.staged)  # staged experts: computed on this card
        counters.staged += sum(int(e.size) for e in self.staged.values())
        self.staged.clear()
        self._ahead = None  # the next chunk stages its first layer afresh (the placement may have changed)
        counters.card += by_source.get(0, 0)
        counters.cpu += sum(n for s, n in by_source.items() if s < 0)
        for s, (card, _, p) in enumerate(self.sources[1:], start=1):
            n = by_source.get(s, 0)
            if p is self.arena:  # weights from host memory, as for the CPU pool
                counters.cpu += n
                counters.host_read += n
                continue
            if n:
                counters.peer += n
                counters.by_peer[card] = counters.by_peer.get(card, 0) + n

    def close(self) -> None:
        self.stream.synchronize()
        for p in self.peers.values():
            p.close()
        self.peers.clear()
        self.cpu.close()
        if self._arena_lock is not None:
            self._arena_lock.release()
