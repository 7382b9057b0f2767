"""A GPU card: the qwen3moe forward on one CUDA device with the kernels of lane/kernels, for one sequence.

Dense weights stay in their GGUF encoding on the card (mat-vecs read Q8_0 / F16 / BF16 / F32 rows directly); the
experts the card holds sit in its VRAM slot pool, exported to the other lanes through a CUDA IPC handle; experts
another card holds run there, the rest on the CPU pool (lane/gpu_experts.py). Prompts
are read in chunks (cuBLAS on dequantised tiles for the projections), decode is one token a step. Same
interface as the numpy card: new_kv(), forward(tokens, kv, logits) -> host logits, pool, counters, counts.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from lane.counters import Counters
from lane.gpu_experts import GpuExperts
from lane.slot_pool import SlotPool
from lane.kernels import dense as D
from protos import messages as M
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import slot_bytes

PREFILL_CHUNK = 256
HALF_LIFE_TOKENS = 256


class GpuKV:
    """The card's KV cache (one sequence at a time) and its position, on the device and mirrored on the host."""

    def __init__(self, card: "CupyCard"):
        self.card = card
        self.length = 0
        with card.device, card.stream:
            card.pos.fill(0)


class CupyCard:
    kind = "gpu"

    def __init__(self, model: ModelFile, device: int, n_slots: int, context_length: int,
                 counts: np.ndarray | None = None, cpu_threads: int = 0):
        c = self.c = model.config
        self.model = model
        self.device = cp.cuda.Device(device)
        self.device.use()
        # a blocking stream: slot loads issued on the default stream between tokens are ordered before compute
        self.stream = cp.cuda.Stream()
        self.max_ctx = -(-min(context_length, c.context_length) // 64) * 64
        self.counters = Counters()
        self.counts = counts if counts is not None else np.zeros((c.n_layer, c.n_expert))
        self.epoch = 0
        up = D.DenseWeight.upload

        def w(name):
            ti = model.info(name)
            return up(model.raw(name).reshape(-1, ti.row_bytes), ti.qtype, ti.shape[-1])

        def f32(name):
            return cp.asarray(model.dense(name).astype(np.float32))

        self.embed_w, self.out_w, self.out_norm = w("token_embd.weight"), w("output.weight"), f32("output_norm.weight")
        self.layers = []
        for i in range(c.n_layer):
            b = f"blk.{i}."
            self.layers.append(dict(
                qkv=D.DenseWeight.concat([w(b + "attn_q.weight"), w(b + "attn_k.weight"), w(b + "attn_v.weight")]),
                o=w(b + "attn_output.weight"), router=w(b + "ffn_gate_inp.weight"),
                attn_norm=f32(b + "attn_norm.weight"), ffn_norm=f32(b + "ffn_norm.weight"),
                q_norm=f32(b + "attn_q_norm.weight"), k_norm=f32(b + "attn_k_norm.weight"),
                kv=D.alloc_kv_cache(c.n_head_kv, self.max_ctx, c.head_dim)))
        self.rope = D.RopeTable(self.max_ctx, c.head_dim, c.rope_base)
        self.attn = D.DecodeAttention(c.n_head, c.n_head_kv, c.head_dim, self.max_ctx, max_T=PREFILL_CHUNK)
        self.pos = cp.zeros((1,), cp.int32)
        # the slot pool is its own cudaMalloc (not a memory-pool sub-allocation), so that its CUDA IPC handle
        # opens at the pool's first byte in other lanes
        nbytes = max(1, n_slots) * slot_bytes(model)
        self._pool_mem = cp.cuda.Memory(nbytes)
        buf = cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(self._pool_mem, 0))
        buf.fill(0)
        self.pool = SlotPool(model, buf, n_slots, cp.asarray)
        self.pool_ident = bytes(cp.cuda.runtime.ipcGetMemHandle(self._pool_mem.ptr)).hex()
        self.device_ident = "cuda:" + cp.cuda.runtime.deviceGetPCIBusId(device)
        self.experts = GpuExperts(model, self.pool, PREFILL_CHUNK, cpu_threads, self.stream)

    # ---- the Card interface ---------------------------------------------------------------------------------
    def new_kv(self) -> GpuKV:
        return GpuKV(self)

    def set_view(self, view: M.View) -> None:
        """Compute from these other cards' slots from the next token on (peers on this same GPU; see gpu_experts)."""
        with self.device:
            self.experts.set_view(view, self.device_ident)
        self.epoch = view.epoch

    def close(self) -> None:
        with self.device:
            self.experts.close()

    def forward(self, tokens, kv: GpuKV, logits: str = "last"):
        tokens = np.asarray(tokens, np.int32)
        if kv.length + len(tokens) > self.max_ctx:
            raise ValueError(f"sequence of {kv.length + len(tokens)} tokens exceeds the card's KV capacity "
                             f"{self.max_ctx}")
        outs = []
        with self.device, self.stream:
            for s in range(0, len(tokens), PREFILL_CHUNK):
                x = self._step(tokens[s:s + PREFILL_CHUNK], kv)
                if logits == "all" or (logits == "last" and s + PREFILL_CHUNK >= len(tokens)):
                    outs.append(self._lm_head(x if logits == "all" else x[-1:]))
            if logits == "none":
                return None
            return cp.asnumpy(cp.concatenate(outs), stream=self.stream)

    # ---- one chunk through every layer -------------------------------------------------------------------------
    def _proj(self, W: D.DenseWeight, X: cp.ndarray, residual: cp.ndarray | None = None) -> cp.ndarray:
        """X W^T (+ residual, in place): the mat-vec kernel for one token, cuBLAS on dequantised tiles for more."""
        if X.shape[0] == 1:
            r = None if residual is None else residual[0]
            return D.matvec(W, X[0], r, residual=r, stream=self.stream).reshape(1, -1)
        return D.dense_batched(W, X, residual, residual=residual, stream=self.stream)

    def _step(self, tokens: np.ndarray, kv: GpuKV) -> cp.ndarray:
        c, T = self.c, len(tokens)
        x = D.embed(self.embed_w, cp.asarray(tokens), stream=self.stream)
        q = cp.empty((T, c.n_head, c.head_dim), cp.float32)
        att = cp.empty((T, c.q_dim), cp.float32)
        self.counts *= 0.5 ** (T / HALF_LIFE_TOKENS)
        for i, L in enumerate(self.layers):
            h = D.rms_norm(x, L["attn_norm"], c.rms_eps, stream=self.stream)
            qkv = self._proj(L["qkv"], h)
            D.qk_norm_rope_kv(qkv, L["q_norm"], L["k_norm"], c.rms_eps, self.rope, self.pos, q, *L["kv"],
                              n_head=c.n_head, n_kv=c.n_head_kv, stream=self.stream)
            self.attn(q, *L["kv"], self.pos, att, T, stream=self.stream)
            x = self._proj(L["o"], att, residual=x)
            h = D.rms_norm(x, L["ffn_norm"], c.rms_eps, stream=self.stream)
            ids, wts = D.route(self._proj(L["router"], h), c.n_expert_used, stream=self.stream)
            x += self.experts(i, h, ids, wts, self.counters, self.counts)
        D.advance_pos(self.pos, T, stream=self.stream)
        kv.length += T
        return x

    def _lm_head(self, x: cp.ndarray) -> cp.ndarray:
        h = D.rms_norm(x, self.out_norm, self.c.rms_eps, stream=self.stream)
        return self._proj(self.out_w, h)
