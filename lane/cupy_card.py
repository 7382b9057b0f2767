"""A GPU card: runs qwen3moe (lane/gpu_model.py, the model's weights and a step's launches) on one CUDA device
for one sequence. The card owns what is not the model: the sequence's KV caches and device position, the
captured decode steps and their replay, steps launched ahead, and the slot pool's memory with its CUDA IPC export
(the experts the card holds; lane/gpu_experts.py computes them, those on peers' cards and the misses). It is a
Card (stratad/engine/card.py) like the numpy card.

A step is the model's list of launch-only operations with host breaks where the CPU pool serves a layer's misses; a
prompt chunk runs the list directly, a decode step replays it as CUDA graphs captured once per placement shape: one
graph when the card and its peers hold every expert, one per layer otherwise (the host serves the misses between).

Steps ahead: when no host work sits between a step's layers (every expert on this card, on its peers' cards or
read from the arena by the card) and the token is sampled on the device, forward_token(..., ahead=u) also launches
the next decode step before the host has seen this one's token (its input is the token the device sampled; its
draw is u), so the card is not idle while the host streams the token and makes the next call. A next call with
that token, kv and draw takes the launched step; anything else drops it (the device position goes back; its KV
entry lies past kv.length and is written again).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import cupy as cp
import cupyx as cpx
import numpy as np

from stratad.engine.card import KvExport
from stratad.engine.chunks import chunks
from lane import host_lock, kv_staging
from lane.fit import packing_costs_no_slot, room_slots
from lane.counters import Counters
from lane.export_buffers import ExportBuffers
from lane.gpu_experts import D2D, D2H, H2D, GpuExperts
from lane.gpu_model import Break, DeviceSample, Qwen3MoeGpu, Work
from lane.slot_pool import SlotPool
from lane.kernels import attention, launch, rope_kv, sampling
from lane.kernels import compile as kernel_compile
from lane.kernels.experts import Tuning, card_smem, check_model
from protos import messages as M
from stratad.config import GPU_PROMPT_CHUNK, GpuOptions
from stratad.engine.sampling import Sampler
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import slot_bytes

HALF_LIFE_TOKENS = 256
log = logging.getLogger("stratad.lane")
MAX_CAPTURED = 8  # placement shapes x context side x how the step's token comes back
# expert_cache = auto: GPU memory left free beside the slots (cuBLAS and CUDA graph workspaces, the memory pool's
# rounding), a fraction of the card's and at least FIT_MARGIN_MIN
FIT_MARGIN, FIT_MARGIN_MIN = 0.03, 768 << 20


class GpuKV:
    """The card's KV cache (one sequence at a time) and its position, on the device and mirrored on the host."""

    def __init__(self, card: "CupyCard"):
        self.card = card
        self.length = 0
        card._drop_ahead()
        with card.device, card.stream:
            card.pos.fill(0)

    def truncate(self, n: int) -> None:
        """Keep the first n positions (decode steps read the position from the device)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} of {self.length} positions")
        self.length = n
        self.card._drop_ahead()
        with self.card.device, self.card.stream:
            self.card.pos.fill(n)


@dataclass
class Ahead:
    """A decode step launched before the host knew its input token (the device's last sample)."""
    kv: GpuKV
    length: int  # kv.length once it is taken
    token: int  # the host's name for its input: the token the step before it returned
    params: object
    u: float
    slot: int  # its host copies (token, routed ids, sampling parameters) and completion event


class CupyCard:
    kind = "gpu"

    def __init__(self, model: ModelFile, device: int, n_slots: int, context_length: int,
                 counts: np.ndarray | None = None, cpu_threads: int = 0, graphs: bool = True,
                 host_experts: str = "card", prompt_chunk: int = GPU_PROMPT_CHUNK, options: GpuOptions = GpuOptions(),
                 tuning: Tuning | None = None, fit: bool = False, cards: int = 1, before: int = 0, after: int = 0,
                 host_cpu_share: float = 0.0):
        """prompt_chunk: tokens a prompt chunk (the expert kernels' pair lists and workspaces are sized for it);
        options: the config's [gpu] code paths (process-wide: PDL, the kernel cache); tuning: the expert kernels'
        launch shape (default: the measured one). fit: hold at most n_slots experts, as many as the card has room
        for once everything else is in place (expert_cache = auto; `fit_pool`), beside `before` lanes of this GPU
        that built before this one and leaving an equal share to `after` that build after it; cards: the daemon's
        card count (the sources whose results a prompt chunk may hold); host_cpu_share: the part of the experts no
        card holds that the CPU pool computes in decode steps beside the card's bus reads (lane/host_split.py)."""
        # before anything is allocated: a model the kernels cannot take fails whole (planned from this card's shared
        # memory, as ExpertKernels plans: an RTX card's 99 KB refuses what an H200 takes)
        check_model(model, tuning, card_smem(cp.cuda.Device(device)))
        c = self.c = model.config
        if prompt_chunk < 1:
            raise ValueError("prompt_chunk must be at least 1")
        self.prompt_chunk = int(prompt_chunk)
        kernel_compile.CACHE_DIR = options.kernel_cache
        self.model = model
        self.device = cp.cuda.Device(device)
        self.device.use()
        free_at_start = cp.cuda.runtime.memGetInfo()[0]  # before this card's allocations (fit_pool)
        # programmatic dependent launch exists from compute capability 9.0 (the kernels' PDL_WAIT is a no-op below)
        launch.PDL = options.pdl and int(self.device.compute_capability) >= 90
        # a blocking stream: slot loads issued on the default stream between tokens are ordered before compute
        self.stream = cp.cuda.Stream()
        self.max_ctx = -(-min(context_length, c.context_length) // 64) * 64
        self.counters = Counters()
        self.counts = counts if counts is not None else np.zeros((c.n_layer, c.n_expert))
        self.epoch = 0
        self.graphs = graphs
        self.pos = cp.zeros((1,), cp.int32)
        self._new_pool(0 if fit else n_slots)
        self.copy_stream = cp.cuda.Stream(non_blocking=True)  # slot copies run beside the compute stream
        self.kv_stream = cp.cuda.Stream(non_blocking=True)  # KV blocks to the host cache, beside both
        self.device_ident = "cuda:" + cp.cuda.runtime.deviceGetPCIBusId(device)
        self.experts = GpuExperts(model, self.pool, self.prompt_chunk, cpu_threads, self.stream, self.device_ident,
                                  host_experts, options, tuning, host_cpu_share, self.counts)
        # the sequence's KV caches, one (K, V) a layer, and its position (the device's: decode steps read it)
        self.kv_caches = [rope_kv.alloc_kv_cache(c.n_head_kv, self.max_ctx, c.head_dim) for _ in range(c.n_layer)]
        self.net = Qwen3MoeGpu(model, self.stream, self.experts, self.kv_caches, self.pos, self.max_ctx)
        self.decode_work = Work(c, 1, 1, slots=2)
        self._done_ev = [cp.cuda.Event(disable_timing=True) for _ in range(2)]  # a step's end, by slot
        self._last_ev = cp.cuda.Event(disable_timing=True)  # the last launched step's end (slot copies wait for it)
        self._ahead: Ahead | None = None
        # captured decode steps by placement shape: [(graph, layer served after it or None)]; coverage flips
        # between complete and not as slots swap, so both shapes stay captured
        self._graphs: dict[tuple, list] = {}
        self._remote_direct = False  # a step with a peer on another GPU failed to capture: such steps run directly
        self._staging: kv_staging.KvStaging | None = None  # restores from the host conversation cache, once used
        self._kv_dev = None  # their device staging: the two halves' blocks on the card
        self._store_lock = None  # the host conversation cache page-locked for this process (pin_store)
        self._exports = ExportBuffers(lambda n: cp.cuda.PinnedMemoryPointer(  # export_kv's page-locked rows
            cp.cuda.PinnedMemory(n, cp.cuda.runtime.hostAllocPortable), 0))
        if fit:
            self.fit_pool(n_slots, cards, before, after, free_at_start)
        elif options.pack_layers:
            self._pack_layers_if_room(cards, self.net.pack_layers(dry=True))

    def _new_pool(self, n_slots: int) -> None:
        """The slot pool: its own cudaMalloc (not a memory-pool sub-allocation), so that its CUDA IPC handle opens
        at the pool's first byte in other lanes."""
        nbytes = max(1, n_slots) * slot_bytes(self.model)
        self.pool = self._pool_mem = None  # the old one's memory goes first (fit_pool counts on it)
        self._pool_mem = cp.cuda.Memory(nbytes)
        buf = cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(self._pool_mem, 0))
        buf.fill(0)
        self.pool = SlotPool(self.model, buf, n_slots, self._write_slot)
        self.pool_ident = bytes(cp.cuda.runtime.ipcGetMemHandle(self._pool_mem.ptr)).hex()

    def fit_pool(self, most: int, cards: int, before: int = 0, after: int = 0, free_at_start: int | None = None) -> int:
        """Size the slot pool from what the card has left (expert_cache = auto), at most `most` slots: a prompt
        chunk of prompt_chunk tokens runs first (with no expert on the card: each layer's are staged), so that
        every workspace a request allocates exists; then what is free, less what grows later (the result rows of
        peers' sources, the KV restore's staging) and a margin (the CUDA libraries' workspaces, the memory pool's
        rounding), becomes slots. Lanes of the same GPU: the `before` ones that built earlier kept their own reserve
        and margin free, which this one leaves to them; each of the `after` ones that build later is left what this
        card took besides its pool (free_at_start: the free memory before its first allocation), a reserve and
        margin, and an equal share of the rest. The layers' file rows are packed first where that costs no slot
        ([gpu] pack_layers: faster decode steps, the same bits). Returns the slot count."""
        free, keep = self._free_after_a_chunk(cards)
        free += self._pool_mem.size  # the placeholder pool goes
        with self.device:
            needs = max(0, (free_at_start or free) - free)  # what this card took besides its pool
            n = room_slots(free, needs, keep, before, after, slot_bytes(self.model), most)
            extra = self.net.pack_layers(dry=True) if self.experts.options.pack_layers else 0
            if packing_costs_no_slot(extra, free, needs, keep, before, after, slot_bytes(self.model), most):
                self._pack_layers()
                free -= extra
                needs += extra
            self.fit_room = (free, keep)  # bytes free before the pool, bytes kept free beside it
            self.experts.pool = None
            self._new_pool(n)
            self.experts.pool = self.pool
            self.experts.forget_tables()
            self._graphs.clear()  # they read the old pool
        log.info("card %d: room for %d expert slots of %d (%.1f GiB free, %.1f GiB kept for later and margin)",
                 self.device.id, n, most, free / 2**30, keep / 2**30)
        return n

    def _free_after_a_chunk(self, cards: int) -> tuple[int, int]:
        """(bytes free, bytes to keep free) once a prompt chunk of prompt_chunk tokens has run (with no expert on
        the card: each layer's are staged), so that every workspace a request allocates exists: what grows later
        (the result rows of peers' sources, the KV restore's staging) and a margin (the CUDA libraries' workspaces,
        the memory pool's rounding) are kept."""
        n_tok = min(self.prompt_chunk, self.max_ctx)
        self.forward(np.zeros(n_tok, np.int32), self.new_kv(), logits="last")
        self.counters, self.counts[:] = Counters(), 0.0  # no request's work
        with self.device:
            self.stream.synchronize()
            free, total = cp.cuda.runtime.memGetInfo()
        rows = self.experts.max_pairs * self.c.d_model * 4  # one source's results (gpu_experts.rows)
        later = (cards - 1) * rows + (2 * kv_staging.CHUNK_BYTES if self.experts.options.host_kv_cache else 0)
        return free, later + max(FIT_MARGIN_MIN, int(FIT_MARGIN * total))

    def _pack_layers_if_room(self, cards: int, extra: int) -> None:
        """A card of a fixed slot count packs its layers' file rows (Qwen3MoeGpu.pack_layers: `extra` bytes) where
        they fit beside what it keeps free."""
        if not extra:
            return
        free, keep = self._free_after_a_chunk(cards)
        if free - extra >= keep:
            self._pack_layers()

    def _pack_layers(self) -> None:
        with self.device:
            added = self.net.pack_layers()
            self.stream.synchronize()
        self._graphs.clear()  # captured on the file rows' kernels
        log.info("card %d: layers packed (%.2f GiB)", self.device.id, added / 2**30)

    def _write_slot(self, dst: cp.ndarray, parts: list[np.ndarray]) -> None:
        """An expert's matrices into a slot, straight from the (page-locked) arena on the copy stream (the slot
        loader's thread, or the fill at start): decode steps keep running meanwhile."""
        with self.device:
            # a step launched before the slot left the table (one ahead) may still read it
            self.copy_stream.wait_event(self._last_ev)
            off = 0
            for part in parts:
                cp.cuda.runtime.memcpyAsync(dst.data.ptr + off, part.ctypes.data, part.nbytes, H2D,
                                            self.copy_stream.ptr)
                off += part.nbytes
            self.copy_stream.synchronize()

    # ---- the Card interface ---------------------------------------------------------------------------------
    def new_kv(self) -> GpuKV:
        return GpuKV(self)

    # ---- KV blocks for the host conversation cache (stratad/engine/card.py KvBlockCard) -----------------------
    # A block: every layer's K then V, each head's block_tokens positions as the caches hold them (K: tokens x hd;
    # V: the cache's own blocks of V_BLOCK positions, hd x V_BLOCK each), float16, as bytes. A head's positions are
    # contiguous in both caches, so a run of blocks moves as one strided 2-D copy a (layer, K/V, head), straight
    # between the caches and page-locked host memory.
    kv_layout = "cuda-f16-vblock16/v1"

    def kv_block_bytes(self, block_tokens: int) -> int:
        c = self.c
        return c.n_layer * 2 * c.n_head_kv * block_tokens * c.head_dim * 2

    def kv_host_buffer(self, n_blocks: int, block_tokens: int) -> np.ndarray:
        return cpx.empty_pinned((n_blocks, self.kv_block_bytes(block_tokens)), np.uint8)

    def _kv_copies(self, ptr: int, start: int, n_blocks: int, block_tokens: int, kind: int, stream) -> None:
        """Blocks start .. start + n_blocks between the caches and n_blocks rows of block bytes at ptr (host
        memory: kind D2H or H2D; device memory: D2D)."""
        if block_tokens % rope_kv.V_BLOCK:
            raise ValueError(f"KV blocks of {block_tokens} tokens are not whole V cache blocks of {rope_kv.V_BLOCK}")
        c = self.c
        run = block_tokens * c.head_dim * 2  # a head's bytes in one block
        pitch = self.kv_block_bytes(block_tokens)
        rt = cp.cuda.runtime
        for layer, caches in enumerate(self.kv_caches):
            for j, cache in enumerate(caches):
                for h in range(c.n_head_kv):
                    dev = cache.data.ptr + (h * self.max_ctx + start * block_tokens) * c.head_dim * 2
                    rows = ptr + ((layer * 2 + j) * c.n_head_kv + h) * run
                    if kind == D2H:
                        rt.memcpy2DAsync(rows, pitch, dev, run, run, n_blocks, D2H, stream.ptr)
                    else:
                        rt.memcpy2DAsync(dev, run, rows, pitch, run, n_blocks, kind, stream.ptr)

    def export_kv(self, kv: GpuKV, start: int, n_blocks: int, block_tokens: int) -> KvExport:
        """The copy runs on its own stream after the steps that wrote these positions; the compute stream waits for
        it before anything later (the next request) can write the caches, so the lane goes on at once."""
        if (start + n_blocks) * block_tokens > kv.length:
            raise ValueError(f"blocks up to position {(start + n_blocks) * block_tokens} asked of a KV of "
                             f"{kv.length} positions")
        host, give_back = self._exports.take((n_blocks, self.kv_block_bytes(block_tokens)))
        with self.device:
            written = cp.cuda.Event(disable_timing=True)
            written.record(self.stream)
            self.kv_stream.wait_event(written)
            self._kv_copies(host.ctypes.data, start, n_blocks, block_tokens, D2H, self.kv_stream)
            done = cp.cuda.Event(disable_timing=True)
            done.record(self.kv_stream)
            self.stream.wait_event(done)
        return KvExport(host, done.synchronize, give_back)

    def import_kv(self, kv: GpuKV, start: int, blocks: np.ndarray, block_tokens: int) -> None:
        n = len(blocks)
        a, b = start * block_tokens, (start + n) * block_tokens
        if b > self.max_ctx:
            raise ValueError(f"{b} positions exceed the card's KV capacity of {self.max_ctx}")
        if blocks.shape != (n, self.kv_block_bytes(block_tokens)) or not blocks.flags.c_contiguous:
            raise ValueError(f"blocks must be C-contiguous ({n}, {self.kv_block_bytes(block_tokens)}) bytes")
        kv.truncate(a)
        with self.device:
            self._kv_copies(blocks.ctypes.data, start, n, block_tokens, H2D, self.stream)
            kv.length = b
            with self.stream:
                self.pos.fill(b)
            self.stream.synchronize()  # the host buffer may be reused once this returns

    def import_kv_from(self, kv: GpuKV, start: int, store, slots: list[int], block_tokens: int,
                       hashes: list[bytes] | None = None) -> int:
        """The store's blocks onto the card: each block copied as a whole into device staging (a strided copy from
        host memory moves a head's 4 KB at a time, well below the link's rate), then into the caches on the card.
        From the store itself where pin_store page-locked it (no copy on the host: the copies' reads are checked
        whole after they end, as a reader's are), else through page-locked staging (lane/kv_staging.py: read by
        threads a chunk at a time, each chunk uploaded while the next is read).

        Returns the blocks restored (up to the first taken for another block meanwhile, or one the store failed to
        give: the caller reads the prompt from there); kv then holds (start + that) * block_tokens positions,
        untouched when none. Returns only once every copy is done (the staging and the caches are free). A failure
        of the card's copies is raised, also once nothing it issued runs; kv then holds start * block_tokens
        positions (its blocks past start may have been written over), or is untouched if nothing was issued."""
        B = block_tokens
        if (start + len(slots)) * B > self.max_ctx:
            raise ValueError(f"{(start + len(slots)) * B} positions exceed the card's KV capacity of {self.max_ctx}")
        bb = self.kv_block_bytes(B)
        shape = (2, max(1, kv_staging.CHUNK_BYTES // bb), bb)
        with self.device:
            if self._kv_dev is None or self._kv_dev.shape != shape:
                self._kv_dev = cp.empty(shape, cp.uint8)  # no copy uses the old one: every restore ends synchronised
            try:
                if self._store_lock is not None and self._store_lock.covers(store.data):
                    got = self._restore_pinned(kv, start, store, slots, B, hashes)
                else:
                    got = self._restore_staged(kv, start, store, slots, B, hashes)
            except BaseException:
                try:  # a copy that raised may have issued some of its copies: none may outlive this call
                    self.stream.synchronize()
                except Exception:  # noqa: BLE001 - the card's own failure is the one raised
                    log.exception("synchronising the card after a failed KV restore failed too")
                raise
            if got:
                kv.length = (start + got) * B
                with self.stream:
                    self.pos.fill(kv.length)
            self.stream.synchronize()
        return got

    def _restore_staged(self, kv: GpuKV, start: int, store, slots: list[int], B: int,
                        hashes: list[bytes] | None) -> int:
        """import_kv_from through page-locked staging (lane/kv_staging.py); the blocks confirmed whole."""
        if self._staging is None:
            self._staging = kv_staging.KvStaging()
        cut = []

        def upload(rows: np.ndarray, first: int, half: int):
            if not cut:  # the kept positions past start are written over from here
                kv.truncate(start * B)
                cut.append(True)
            dev = self._kv_dev[half]
            cp.cuda.runtime.memcpyAsync(dev.data.ptr, rows.ctypes.data, rows.nbytes, H2D, self.stream.ptr)
            self._kv_copies(dev.data.ptr, start + first, len(rows), B, D2D, self.stream)
            return kv_staging.record(self.stream)

        return self._staging.restore(store, slots, self._kv_dev.shape[2], upload, hashes)

    def pin_store(self, store) -> bool:
        """Page-lock the host conversation cache's slots for this process, so that restores copy straight from
        them (at start: pinning touches every page of the cache, and keeps them resident; the lane logs its time).
        False where the driver refused (restores then go through the staging)."""
        with self.device:
            self._store_lock = host_lock.lock(self, store.data)
        return self._store_lock is not None

    def _restore_pinned(self, kv: GpuKV, start: int, store, slots: list[int], B: int,
                        hashes: list[bytes] | None) -> int:
        """import_kv_from from the page-locked store: a chunk's blocks copied into one of the staging halves (a copy
        a block), confirmed whole once that copy has ended (as a reader confirms), and only then into the caches,
        while the next chunk's copy runs into the other half; all on the card's stream (a half is written again
        only after the copies out of it, in stream order). kv is cut to start only once a block is confirmed.
        Returns the blocks confirmed, with their copies into the caches possibly still running."""
        try:
            snap = store.snapshot(slots, hashes)
        except Exception:  # noqa: BLE001 - the cache is an optimisation: the prompt is read
            log.exception("reading the host conversation cache failed: the prompt is read instead")
            return 0
        n, rt, dev = len(snap), cp.cuda.runtime, self._kv_dev
        chunk, bb = dev.shape[1], dev.shape[2]
        parts = [(c0, slots[c0:min(c0 + chunk, n)]) for c0 in range(0, n, chunk)]

        def upload(k: int):  # chunk k's blocks into half k % 2; the event its copies end at
            half = dev[k % 2]
            for i, slot in enumerate(parts[k][1]):
                # at most a block: a slot taken meanwhile for a larger one is cut and found not whole
                nbytes = min(int(store.nbytes[slot]), bb)
                rt.memcpyAsync(half[i].data.ptr, store.data[slot].ctypes.data, nbytes, H2D, self.stream.ptr)
            return kv_staging.record(self.stream)

        got = 0
        landed = upload(0) if parts else None
        for k, (c0, part) in enumerate(parts):
            following = upload(k + 1) if k + 1 < len(parts) else None
            landed.synchronize()
            whole = store.confirm(part, snap.part(c0, c0 + len(part)), first=c0)
            if whole:
                if not got:  # the kept positions past start are written over from here
                    kv.truncate(start * B)
                self._kv_copies(dev[k % 2].data.ptr, start + c0, whole, B, D2D, self.stream)
                got = c0 + whole
            if whole < len(part):
                break
            landed = following
        return got

    def set_view(self, view: M.View) -> None:
        """Compute from these other cards' slots from the next token on (peers on this same GPU; see gpu_experts).
        Returns once no step of the old view runs: the lane then acknowledges the view, after which the slots it
        left out may be overwritten (coordinator/epochs.py), and a step launched ahead may have read them."""
        self._drop_ahead()
        with self.device:
            self.stream.synchronize()
            self.experts.set_view(view)
        self.epoch = view.epoch

    def close(self) -> None:
        self._drop_ahead()
        with self.device:
            self.stream.synchronize()
            self.experts.close()
            self._graphs.clear()
        if self._staging is not None:
            self._staging.close()
        self._kv_dev = None
        if self._store_lock is not None:  # before the store's mapping can go
            self._store_lock.release()

    def forward(self, tokens, kv: GpuKV, logits: str = "last"):
        return self._forward(tokens, kv, logits, None)

    def samples_on_device(self, params) -> bool:
        """Where the card's samplers give the host Sampler's token: greedy, top-k of at most SAMPLE_KMAX (with or
        without top-p), or no top-k (temperature alone, or with top-p: the nucleus on the card where it fits the
        SAMPLE_KMAX candidates, else on the host); not a top-k wider than the candidates."""
        whole = params.top_k == 0 or params.top_k >= self.c.vocab_size
        return params.temperature == 0 or 0 < params.top_k <= sampling.SAMPLE_KMAX or whole

    def _sample_kind(self, params) -> str:
        if params.temperature == 0:
            return "argmax"
        return "cdf" if params.top_p >= 1 and not 0 < params.top_k <= sampling.SAMPLE_KMAX else "top-k"

    steps_ahead = True  # forward_token takes `ahead` (module docstring)

    def forward_token(self, tokens, kv: GpuKV, params, u: float, logits: bool, ahead: float | None = None):
        """forward(tokens, kv, "last") with the last row sampled here (Sampler.pick's token for draw u): only the
        token crosses the bus (4 bytes, not the vocabulary's logits), unless `logits` asks for them too.
        ahead: the next step's draw; that step is launched now from this one's token where the card can (module
        docstring), and the next call, with the returned token and this draw, takes it."""
        if not self.samples_on_device(params):
            raise ValueError("these sampling parameters are sampled on the host (samples_on_device)")
        kind = self._sample_kind(params)
        top_p_only = kind == "top-k" and not 0 < params.top_k <= sampling.SAMPLE_KMAX  # may be left to the host
        sample = DeviceSample(kind, bool(logits) or top_p_only)
        tokens = np.asarray(tokens, np.int32)
        pend = self._ahead
        if pend is None or not (pend.kv is kv and pend.length == kv.length + 1 and tokens.tolist() == [pend.token]
                                and pend.params == params and pend.u == u and not sample.logits):
            self._upload_sparams(sample, params, u, 0)
            out = self._forward(tokens, kv, "last", sample)  # drops a step launched ahead
            token = int(self.net.token_h[0])
            if token < 0:  # a nucleus wider than the card's candidates: the host samples the same logits, same draw
                token = Sampler(params).pick(out[-1], u)
            if ahead is not None:
                self._launch_ahead(kv, token, params, ahead, sample, 1)
            return token, (out if logits else None)
        self._ahead = None
        if ahead is not None:  # launched before this step's token is read: the card keeps going meanwhile
            self._launch_ahead(kv, -1, params, ahead, sample, 1 - pend.slot, length=pend.length)
        with self.device:
            self._done(self.decode_work, kv, 1, sample, pend.slot)
        token = int(self.net.token_h[pend.slot])
        if self._ahead is not None:
            self._ahead.token = token
        return token, None

    def _upload_sparams(self, sample: DeviceSample, params, u: float, slot: int) -> None:
        """The sampler's parameters for the step launched next (on the stream: after the step before it)."""
        if sample.kind != "argmax":
            self.net.sparams_h[slot] = sampling.sampling_params(params.temperature, params.top_k, params.top_p, u)
            with self.device:
                cp.cuda.runtime.memcpyAsync(self.net.sparams.data.ptr, self.net.sparams_h[slot].ctypes.data,
                                            self.net.sparams.nbytes, H2D, self.stream.ptr)

    def _launch_ahead(self, kv: GpuKV, token: int, params, u: float, sample: DeviceSample, slot: int,
                      length: int | None = None) -> None:
        """Launch the step after the one that leaves kv at `length` (kv.length), its input the device's last
        sample (token: the host's name for it, -1 until that step is read), where it needs no host between its
        layers, returns only its token and is captured already (a capture here would delay the token the host
        waits for by the capture's time)."""
        length = kv.length if length is None else length
        ex = self.experts
        w = self.decode_work
        with self.device, self.stream:
            ex.refresh()
            if not (self.graphs and ex.full and not sample.logits and length < self.max_ctx
                    and self._graph_key(w, length, sample) in self._graphs):
                return
            self._upload_sparams(sample, params, u, slot)
            cp.cuda.runtime.memcpyAsync(w.tokens.data.ptr, self.net.token.data.ptr, 4, D2D, self.stream.ptr)
            self._replay(w, length, sample)
            self._copy_back(w, sample, slot)
        self._ahead = Ahead(kv, length + 1, token, params, u, slot)

    def _drop_ahead(self) -> None:
        """Forget a step launched ahead: the device position goes back to its kv's length (after the step, on the
        stream); its KV entry lies past that length."""
        pend, self._ahead = self._ahead, None
        if pend is not None:
            with self.device, self.stream:
                self.pos.fill(pend.length - 1)

    def _forward(self, tokens, kv: GpuKV, logits: str, sample: DeviceSample | None):
        self._drop_ahead()
        tokens = np.asarray(tokens, np.int32)
        if kv.length + len(tokens) > self.max_ctx:
            raise ValueError(f"sequence of {kv.length + len(tokens)} tokens exceeds the card's KV capacity "
                             f"{self.max_ctx}")
        outs = []
        with self.device, self.stream:
            self.experts.refresh()
            for chunk, rows, last in chunks(tokens, logits, self.prompt_chunk):
                smp = sample if last else None
                if len(chunk) == 1 and rows <= 1 and self.graphs:
                    outs.append(self._decode(int(chunk[0]), kv, rows, smp))
                else:
                    outs.append(self._chunk(chunk, kv, rows, sample=smp))
        outs = [o for o in outs if o is not None]
        return None if logits == "none" or not outs else np.concatenate(outs)

    # ---- a step as operations -----------------------------------------------------------------------------------
    def _copy_back(self, w: Work, sample: DeviceSample | None, slot: int) -> None:
        """After a step's launches (outside its graphs: a step launched ahead writes the other slot): the sampled
        token and the routed ids to the host, and the step's end marked."""
        s, rt = self.stream, cp.cuda.runtime
        if sample is not None:
            rt.memcpyAsync(self.net.token_h[slot:].ctypes.data, self.net.token.data.ptr, 4, D2H, s.ptr)
        rt.memcpyAsync(w.ids_h[slot].ctypes.data, w.ids.data.ptr, w.ids.nbytes, D2H, s.ptr)
        self._done_ev[slot].record(s)
        self._last_ev.record(s)

    def _done(self, w: Work, kv: GpuKV, logit_rows: int, sample: DeviceSample | None = None, slot: int = 0):
        """After a step's launches: wait for its end, count where the experts ran, hand out the logits (those
        that came back)."""
        self._done_ev[slot].synchronize()
        self.counts *= 0.5 ** (w.T / HALF_LIFE_TOKENS)
        self.experts.tally(w.ids_h[slot], self.counters, self.counts)
        kv.length += w.T
        back = logit_rows and (sample is None or sample.logits)
        return w.logits_h[:logit_rows].copy() if back else None

    # ---- running a step -----------------------------------------------------------------------------------------
    def _chunk(self, tokens: np.ndarray, kv: GpuKV, logit_rows: int, w: Work | None = None,
               sample: DeviceSample | None = None):
        """A prompt chunk (or a decode step that cannot be replayed): the operations run directly."""
        w = w or Work(self.c, len(tokens), logit_rows)
        w.pos0 = kv.length
        w.long_ctx = self._long_ctx(w, kv.length)
        w.tokens.set(tokens, stream=self.stream)
        for op in self.net.ops(w, logit_rows, sample):
            if isinstance(op, Break):
                self.experts.serve(op.layer, w.T)
            else:
                op()
        self._copy_back(w, sample, 0)
        return self._done(w, kv, logit_rows, sample)

    def _decode(self, token: int, kv: GpuKV, logit_rows: int, sample: DeviceSample | None = None):
        """One token: replay the captured step (captured again when the placement's shape changed). A peer on
        another GPU is captured too (its copies and kernels joined to this card's stream by events: a graph of two
        devices); where the driver refuses that, such steps run directly."""
        w = self.decode_work
        if self.experts.remote and self._remote_direct:
            return self._chunk(np.array([token], np.int32), kv, logit_rows, w, sample)
        w.tokens.set(np.array([token], np.int32), stream=self.stream)
        if not self._replay(w, kv.length, sample):
            return self._chunk(np.array([token], np.int32), kv, logit_rows, w, sample)
        self._copy_back(w, sample, 0)
        return self._done(w, kv, logit_rows, sample)

    @staticmethod
    def _long_ctx(w: Work, length: int) -> bool:
        """A decode step's attention kind at position `length` (the same whether it is replayed or run directly:
        the bits follow it)."""
        return w.T == 1 and length >= attention.ATTN_PDL_MAX_CTX

    def _graph_key(self, w: Work, length: int, sample: DeviceSample | None) -> tuple:
        """The captured step a decode step at position `length` replays (w.long_ctx set for its capture)."""
        w.long_ctx = self._long_ctx(w, length)
        return self.experts.full, self.experts.sources_key(), w.long_ctx, sample

    def _replay(self, w: Work, length: int, sample: DeviceSample | None) -> bool:
        """Launch the captured step for the token in w.tokens at position `length` (False: it cannot be captured
        and runs directly instead)."""
        remote = self.experts.remote
        key = self._graph_key(w, length, sample)
        if key not in self._graphs:
            if len(self._graphs) >= MAX_CAPTURED:
                self.stream.synchronize()  # none of them still running (a step launched ahead and dropped)
                self._graphs.clear()  # peers came and went: the old pointers are gone
            try:
                self._graphs[key] = self._capture(self.net.ops(w, 1, sample))
            except (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError) as e:
                if not remote:
                    raise
                log.warning("a step with a peer on another GPU cannot be captured (%s): such steps run directly", e)
                self._remote_direct = True
                self.stream.synchronize()
                return False
        for graph, served in self._graphs[key]:
            graph.launch(self.stream)
            if served is not None:
                self.experts.serve(served, 1)
        return True

    def _capture(self, ops: list) -> list:
        """Capture the operations between Breaks as graphs: [(graph, layer to serve after it, or None)]."""
        segments, current = [], []
        for op in ops + [None]:
            if op is None or isinstance(op, Break):
                s = self.stream
                s.begin_capture()
                try:
                    for f in current:
                        f()
                finally:
                    graph = s.end_capture()
                segments.append((graph, op.layer if op is not None else None))
                current = []
            else:
                current.append(op)
        return segments
