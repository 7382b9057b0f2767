"""GQA attention over one layer's fp16 KV cache: a decode step's split-K kernel and its combine
(attention_decode.cu), and a prompt chunk's flash kernel (attention_prefill.cu); the numpy reference beside them.

  DecodeAttention(...)(q, K, V, pos, out)       attention_ref(q, K, V, pos0)
  DecodeAttention(...).step(qkv, ..., pos, ...) rope_kv.qk_norm_rope_kv, then the above
  PrefillAttention(...)(q, K, V, pos0, out)     attention_ref(q, K, V, pos0)
"""
from __future__ import annotations

import math

import numpy as np

from .device import module, need, on_stream
from .launch import launch
from .matvec import q8_row_bytes
from .rope_kv import RopeTable, v_cache_shape

DECODE, PREFILL = "attention_decode.cu", "attention_prefill.cu"
ATTN_COMBINE_COLS = 8  # the combine's float4 columns a block (hd / 32 blocks a head at hd 128: 4)
# Decode steps at this context or longer launch the split kernel without a PDL edge (its cost grows with the
# context; docs/perf-notes.md), and with the plain load path (fewer registers, more blocks an SM); shorter ones
# prefetch the next tile where the PDL edge lets its loads start early. The split count follows the kernel, so the
# bits depend on the position only, never on the mode.
ATTN_PDL_MAX_CTX = 4096


class DecodeAttention:
    """Split-K GQA attention over one layer's fp16 KV cache for T <= max_T tokens at positions pos + t.

    __call__(q (T, n_head, hd) f32, K cache, V cache, pos, out (T, n_head*hd) f32). Two launches (split, combine).
    pipelined: the split kernel's warps prefetch the next K / V tile into registers (else they load each where it
    is used); the same bits on the same splits. head_dim 64 or 128; group = n_head / n_kv <= 16.
    """

    def __init__(self, n_head: int, n_kv: int, head_dim: int, max_ctx: int, max_T: int = 1, *, chunk_min: int = 64,
                 nsplit: int | None = None, pipelined: bool = False, combine_cols: int | None = None, device=None):
        m = self.m = module(DECODE, device)
        cp = m.cp
        if head_dim not in (64, 128):
            raise ValueError("head_dim must be 64 or 128")
        if n_head % n_kv or n_head // n_kv > 16:
            raise ValueError("n_head must be a multiple of n_kv, group <= 16")
        self.n_head, self.n_kv, self.hd, self.max_ctx = n_head, n_kv, head_dim, int(max_ctx)
        self.group = n_head // n_kv
        self.max_T, self.chunk_min = int(max_T), int(chunk_min)
        v_cache_shape(n_kv, head_dim, max_ctx)  # max_ctx in whole V blocks
        base = f"attn_split_hd{head_dim}_g{16 if self.group > 8 else 8}"
        self.name = base + ("_pipe" if pipelined else "")
        # decode steps: the split kernel with qk_norm_rope_kv's work, the same load path
        self.qkv_name = base + ("_qkv" if pipelined else "_qkv_plain")
        self.cols = min(head_dim // 4, combine_cols or ATTN_COMBINE_COLS)
        if 128 % self.cols or (head_dim // 4) % self.cols:
            raise ValueError(f"combine_cols must divide 128 and head_dim / 4 (got {self.cols})")
        with m.device:
            # one split geometry for both kernels (the same registers today), so that step() has attention's bits
            self.capacity = m.n_sm * min(m.blocks_per_sm(self.name, 128), m.blocks_per_sm(self.qkv_name, 128))
            self._nsplit_fixed = nsplit
            cap = max(self.nsplit(t) * t for t in range(1, self.max_T + 1))
            self.part_o = cp.empty(cap * n_kv * self.group * head_dim, cp.float32)
            self.part_ml = cp.empty(cap * n_kv * self.group * 2, cp.float32)
        self.scale_log2 = np.float32(math.log2(math.e) / math.sqrt(head_dim))

    def nsplit(self, T_: int = 1) -> int:
        if self._nsplit_fixed:
            return int(self._nsplit_fixed)
        return max(1, self.capacity // (self.n_kv * T_))

    def step(self, qkv, q_norm_w, k_norm_w, eps: float, rope: RopeTable, pos, k_cache, v_cache, out, *,
             out_q=None, pdl: bool = True, stream=None) -> None:
        """A decode step's qk_norm_rope_kv (T = 1; q_out not written) and attention in one split launch and the
        combine: qkv float32 (1, (n_head + 2 n_kv) hd); the same bits as the two calls. out_q: as __call__'s."""
        m, hd = self.m, self.hd
        need(qkv, np.float32, (1, (self.n_head + 2 * self.n_kv) * hd), "qkv")
        need(q_norm_w, np.float32, (hd,), "q_norm_w")
        need(k_norm_w, np.float32, (hd,), "k_norm_w")
        if rope.head_dim != hd or rope.max_ctx < self.max_ctx:
            raise ValueError("the rope table must have this head_dim and cover max_ctx")
        self._launch(m.fn(self.qkv_name), (qkv, q_norm_w, k_norm_w, np.float32(eps), rope.cos, rope.sin, k_cache,
                                           v_cache), k_cache, v_cache, pos, out, 1, pdl, stream, out_q)

    def __call__(self, q, k_cache, v_cache, pos, out, T_: int = 1, *, out_q=None, pdl: bool = True,
                 stream=None) -> None:
        """pdl: the split kernel may start under its predecessor's tail (in a graph; see ATTN_PDL_MAX_CTX).
        out_q (T = 1; int8 (q8_row_bytes(n_head hd),)): the output row quantised to 8 bits as well, by the combine
        (quantize_row's layout), for matvec qx."""
        need(q, np.float32, (T_, self.n_head, self.hd), "q")
        self._launch(self.m.fn(self.name), (q, k_cache, v_cache), k_cache, v_cache, pos, out, T_, pdl, stream,
                     out_q)

    def quantizes(self) -> bool:
        """Whether the combine can write out_q (groups of 32 values within a block)."""
        return self.cols % 8 == 0

    def _launch(self, split, first: tuple, k_cache, v_cache, pos, out, T_: int, pdl: bool, stream,
                out_q=None) -> None:
        """The split kernel (its own leading arguments `first`) and the combine."""
        m = self.m
        if not 1 <= T_ <= self.max_T:
            raise ValueError(f"T must be in [1, {self.max_T}]")
        need(k_cache, np.float16, (self.n_kv, self.max_ctx, self.hd), "k_cache", align=16)
        need(v_cache, np.float16, v_cache_shape(self.n_kv, self.hd, self.max_ctx), "v_cache", align=16)
        need(pos, np.int32, (1,), "pos")
        need(out, np.float32, (T_, self.n_head * self.hd), "out")
        n = self.n_head * self.hd
        qd = (np.uint64(0), np.uint64(0))
        if out_q is not None:
            if T_ != 1 or not self.quantizes():
                raise ValueError("out_q takes one token and a multiple of 8 combine columns")
            need(out_q, np.int8, (q8_row_bytes(n),), "out_q", align=16)
            qd = (out_q, out_q[n:])
        ns = self.nsplit(T_)
        common = (np.int32(self.n_head), np.int32(self.n_kv), np.int32(self.max_ctx), np.int32(ns),
                  np.int32(self.chunk_min))
        with on_stream(stream):
            launch(split, (ns, self.n_kv, T_), (128,), first + (pos,) + common +
                   (self.scale_log2, self.part_o, self.part_ml), pdl=pdl)
            cargs = (self.part_o, self.part_ml, pos, np.int32(self.n_head), np.int32(self.n_kv), np.int32(self.hd),
                      np.int32(self.max_ctx), np.int32(ns), np.int32(self.chunk_min))
            launch(m.fn("attn_combine"), (self.n_head, T_, self.hd // 4 // self.cols), (128,),
                   cargs + (np.int32(self.cols), out) + qd)


class PrefillAttention:
    """GQA attention for a prompt chunk of T tokens at positions pos0 + t over the whole cached prefix, flash style
    on tensor cores (attention_prefill.cu): fp16 Q and P, float32 accumulation, the scores never leave the chip, so
    memory stays O(T) at any context. Same arguments as DecodeAttention but pos0 is a host int: prompts are read
    eagerly, not in graphs. Measured error against attention_ref: tests/test_gpu_dense.py."""

    KEY_TILE = 64  # FA_BN in attention_prefill.cu

    def __init__(self, n_head: int, n_kv: int, head_dim: int, max_ctx: int, *, device=None,
                 block_rows: int | None = None):
        """block_rows: query rows a block (the kernel's BM, 16 a warp), 128 or 64; default 128 where the card's
        shared memory takes it, else 64 (head_dim 128 on a card of 99 KB a block): the same bits either way."""
        self.m = module(PREFILL, device)
        if n_head % n_kv:
            raise ValueError("n_head must be a multiple of n_kv")
        if head_dim not in (64, 128):
            raise ValueError("head_dim must be 64 or 128")
        if max_ctx % self.KEY_TILE:
            raise ValueError(f"max_ctx must be a multiple of {self.KEY_TILE} (key tiles are read whole)")
        self.n_head, self.n_kv, self.hd, self.max_ctx = n_head, n_kv, head_dim, int(max_ctx)
        self.group = n_head // n_kv
        self.scale = np.float32(1.0 / math.sqrt(head_dim))
        # FaShape: the Q tile's rows (hd + 8 halfs), then two stages of a key tile, each K rows (hd + 8 halfs) and
        # V^T rows (64 + 8 halfs)
        stage = self.KEY_TILE * (head_dim + 8) + head_dim * (self.KEY_TILE + 8)

        def smem(rows: int) -> int:
            return 2 * (rows * (head_dim + 8) + 2 * stage)

        if block_rows is None:
            block_rows = 128 if smem(128) <= self.m.smem_optin else 64
        if block_rows not in (64, 128) or smem(block_rows) > self.m.smem_optin:
            raise ValueError(f"block_rows {block_rows}: 128 or 64, within the card's {self.m.smem_optin} bytes of "
                             f"shared memory a block")
        self.block_rows, self.smem = block_rows, smem(block_rows)
        self.fn = self.m.fn(f"attn_flash_prefill_{head_dim}" + ("" if block_rows == 128 else "_m64"), self.smem)

    def __call__(self, q, k_cache, v_cache, pos0: int, out, *, stream=None) -> None:
        Tn, hd = int(q.shape[0]), self.hd
        if not (Tn >= 1 and int(pos0) >= 0 and int(pos0) + Tn <= self.max_ctx):
            raise ValueError(f"positions {pos0}..{int(pos0) + Tn - 1} outside the cache of {self.max_ctx}")
        need(q, np.float32, (Tn, self.n_head, hd), "q")
        need(k_cache, np.float16, (self.n_kv, self.max_ctx, hd), "k_cache")
        need(v_cache, np.float16, v_cache_shape(self.n_kv, hd, self.max_ctx), "v_cache")
        need(out, np.float32, (Tn, self.n_head * hd), "out")
        m = self.m
        cp = m.cp
        R, nkv = Tn * self.group, self.n_kv  # query rows per kv head
        n = Tn * self.n_head * hd
        with on_stream(stream):
            qp = cp.empty((nkv, R, hd), cp.float16)
            o = cp.empty((nkv, R, hd), cp.float32)
            launch(m.fn("attn_q_pack"), ((n + 255) // 256,), (256,), (q, np.int32(Tn), np.int32(self.n_head),
                                                               np.int32(nkv), np.int32(hd), self.scale, qp))
            launch(self.fn, ((R + self.block_rows - 1) // self.block_rows, nkv), (self.block_rows * 2,),
                   (qp, k_cache, v_cache, np.int32(R), np.int32(self.group), np.int32(pos0),
                    np.int32(self.max_ctx), o), shared_mem=self.smem)
            launch(m.fn("attn_o_unpack"), ((n + 255) // 256,), (256,), (o, np.int32(Tn), np.int32(self.n_head),
                                                                 np.int32(nkv), np.int32(hd), out))


def attention_ref(q: np.ndarray, K: np.ndarray, V: np.ndarray, pos0: int) -> np.ndarray:
    """ReferenceEngine.attention's core: q (T, n_head, hd) at positions pos0 + t, K/V (S, n_kv, hd) (S >= pos0+T)
    -> (T, n_head*hd). Computes in the inputs' float type (pass float64 for a high-precision oracle)."""
    Tn, n_head, hd = q.shape
    n_kv = K.shape[1]
    S = pos0 + Tn
    K, V = K[:S], V[:S]
    dt = np.result_type(q.dtype, K.dtype)
    g = n_head // n_kv
    pos = np.arange(pos0, pos0 + Tn)
    qg = q.reshape(Tn, n_kv, g, hd)
    s = np.einsum("tkgd,skd->kgts", qg, K) * dt.type(1 / np.sqrt(hd))
    s = np.where(pos[:, None] >= np.arange(S)[None, :], s, dt.type(-np.inf))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return np.einsum("kgts,skd->tkgd", p, V).reshape(Tn, n_head * hd).astype(dt)
