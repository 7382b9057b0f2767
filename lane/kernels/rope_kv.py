"""q/k RMSNorm + RoPE + KV append (rope_kv.cu), the RoPE table, and the KV cache's layout.

Layouts: K cache float16 (n_kv, max_ctx, hd) per layer; V cache float16 (n_kv, max_ctx / 16, hd, 16): V^T in
blocks of 16 positions, so that a tile's V^T is one contiguous piece (v_cache_shape, v_blocked, v_unblocked). pos
is int32 (1,) on the device: the position of a step's first token (advance_pos adds T at the end of a step).

  qk_norm_rope_kv(qkv, ..., pos, q_out, K, V)   qk_norm_rope_kv_ref(qkv, pos0, ...)
"""
from __future__ import annotations

import numpy as np

from stratad.engine import reference
from stratad.model import rope as rope_math
from stratad.model.rope import RopeScaling

from .device import module, need, on_stream
from .launch import launch

SOURCE = "rope_kv.cu"
F32 = np.float32


def rope_tables(max_ctx: int, head_dim: int, base: float,
                scaling: RopeScaling = rope_math.NONE) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 (max_ctx, head_dim/2) of positions 0..max_ctx-1: the reference's own table function (one
    definition; YaRN's mscale is in the table, so the kernels apply any scaling unchanged)."""
    return rope_math.tables(np.arange(max_ctx, dtype=np.int64), head_dim, base, scaling)


class RopeTable:
    """rope_tables uploaded once (a3b, 131072 x 64: 2 x 32 MB)."""

    def __init__(self, max_ctx: int, head_dim: int, base: float, scaling: RopeScaling = rope_math.NONE):
        import cupy

        c, s = rope_tables(max_ctx, head_dim, base, scaling)
        self.max_ctx, self.head_dim, self.base, self.scaling = int(max_ctx), int(head_dim), float(base), scaling
        self.cos, self.sin = cupy.asarray(c), cupy.asarray(s)


V_BLOCK = 16  # positions of a V cache block (rope.cuh v_at)


def v_cache_shape(n_kv: int, head_dim: int, max_ctx: int) -> tuple:
    """The V cache's shape: (n_kv, max_ctx / 16, hd, 16), V^T in blocks of 16 positions."""
    if max_ctx % V_BLOCK:
        raise ValueError(f"max_ctx must be a multiple of {V_BLOCK} (the V cache's blocks)")
    return (n_kv, max_ctx // V_BLOCK, head_dim, V_BLOCK)


def v_blocked(vt):
    """V^T (n_kv, hd, max_ctx) -> the V cache's layout, numpy or cupy (a copy)."""
    n_kv, hd, max_ctx = vt.shape
    _, nb, _, blk = v_cache_shape(n_kv, hd, max_ctx)
    return vt.reshape(n_kv, hd, nb, blk).transpose(0, 2, 1, 3).copy()


def v_unblocked(vc):
    """The V cache's layout -> V^T (n_kv, hd, max_ctx), numpy or cupy (a copy)."""
    n_kv, nb, hd, _ = vc.shape
    return vc.transpose(0, 2, 1, 3).reshape(n_kv, hd, nb * V_BLOCK)


def alloc_kv_cache(n_kv: int, max_ctx: int, head_dim: int):
    """One layer's (K, V) caches, zero-filled: K float16 (n_kv, max_ctx, hd), V float16 v_cache_shape."""
    import cupy

    if max_ctx % 64:
        raise ValueError("max_ctx must be a multiple of 64")
    return (cupy.zeros((n_kv, max_ctx, head_dim), cupy.float16),
            cupy.zeros(v_cache_shape(n_kv, head_dim, max_ctx), cupy.float16))


def qk_norm_rope_kv(qkv, q_norm_w, k_norm_w, eps: float, rope: RopeTable, pos, q_out, k_cache, v_cache, *,
                    n_head: int, n_kv: int, stream=None) -> None:
    """qkv float32 (T, (n_head + 2 n_kv) hd) -> q_out (T, n_head, hd) = rope(rms_norm(q)); K cache[:, pos+t] =
    f16(rope(rms_norm(k))); V^T[:, :, pos+t] = f16(v) (v_unblocked's view). pos: device int32 (1,)."""
    m = module(SOURCE)
    hd = rope.head_dim
    if qkv.ndim != 2 or qkv.shape[1] != (n_head + 2 * n_kv) * hd:
        raise ValueError("qkv must be (T, (n_head + 2 n_kv) * head_dim)")
    Tn = int(qkv.shape[0])
    need(qkv, np.float32, None, "qkv")
    need(q_norm_w, np.float32, (hd,), "q_norm_w")
    need(k_norm_w, np.float32, (hd,), "k_norm_w")
    need(pos, np.int32, (1,), "pos")
    need(q_out, np.float32, (Tn, n_head, hd), "q_out")
    max_ctx = int(k_cache.shape[1])
    need(k_cache, np.float16, (n_kv, max_ctx, hd), "k_cache")
    need(v_cache, np.float16, v_cache_shape(n_kv, hd, max_ctx), "v_cache")
    if hd % 2 or hd > 256 or max_ctx > rope.max_ctx:
        raise ValueError("head_dim must be even and <= 256, and the rope table must cover max_ctx")
    heads = n_head + 2 * n_kv
    with on_stream(stream):
        launch(m.fn("qk_norm_rope_kv"), (-(-heads // 4), Tn), (128,),
                                (qkv, np.int64(qkv.shape[1]), np.int32(Tn), q_norm_w, k_norm_w, np.float32(eps),
                                 rope.cos, rope.sin, pos, q_out, k_cache, v_cache, np.int32(n_head), np.int32(n_kv),
                                 np.int32(hd), np.int32(max_ctx)))


def qk_norm_rope_kv_ref(qkv: np.ndarray, pos0: int, q_norm_w, k_norm_w, eps: float, base: float, n_head: int,
                        n_kv: int, head_dim: int):
    """(q, k, v) float32 as ReferenceEngine.attention makes them: q (T, n_head, hd), k, v (T, n_kv, hd)."""
    Tn = qkv.shape[0]
    qd, kd = n_head * head_dim, n_kv * head_dim
    q = qkv[:, :qd].reshape(Tn, n_head, head_dim)
    k = qkv[:, qd:qd + kd].reshape(Tn, n_kv, head_dim)
    v = qkv[:, qd + kd:].reshape(Tn, n_kv, head_dim)
    q = reference.rms_norm(q, q_norm_w, eps)
    k = reference.rms_norm(k, k_norm_w, eps)
    pos = np.arange(pos0, pos0 + Tn)
    return reference.rope(q, pos, base), reference.rope(k, pos, base), v.astype(F32)


def advance_pos(pos, T_: int = 1, *, stream=None) -> None:
    """pos[0] += T on the device (capture it at the end of a decode step)."""
    m = module(SOURCE)
    with on_stream(stream):
        launch(m.fn("advance_pos"), (1,), (1,), (pos, np.int32(T_)))
