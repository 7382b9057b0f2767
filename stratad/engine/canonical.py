"""The canonical expert function: the one definition of an expert's output bits (docs/design.md, exactness).

An expert's output must not depend on where it ran (GPU kernel, peer card, CPU pool), so every implementation
computes exactly this, in float32 with each multiply and add rounded on its own (no fused multiply-add):

1. The input row is quantised per 32 values: d = amax / 127, q = rint(x * (1 / d)) (half to even); q = 0 where
   d = 0 or 1 / d overflows to inf (a subnormal d, amax < ~3.7e-37).
2. Dot of a weight row with it, on the weight's integer view (quants.IntBlocks, docs/quant-types.md): per
   sub-block b an exact integer sum isum_b = sum(q * qa) (and, for types with a minimum, msum_b = sum(mweight * qa),
   mweight = 1 unless the type says otherwise); the sub-block's term is
   (scale_b * d_b) * isum_b  [ - (minimum_b * d_b) * msum_b ].
3. The terms are summed as a warp would: virtual lane l (0..31) adds terms l, l+32, l+64, ... to 0.0 in order,
   then lanes are folded with offsets 16, 8, 4, 2, 1 (lane l += lane l + offset).
4. SwiGLU: h = silu(gate) * up, silu(g) = g / (1 + exp(-g)) with `exp` below (float32 ops only).
5. h is quantised as in 1 and the down projection is a dot as in 2-3.
6. The k experts' outputs are combined on the lane's card in router order: acc = 0; acc = acc + w_k * y_k.
"""
from __future__ import annotations

import numpy as np

from stratad.model.quants import SUB, IntBlocks

F32 = np.float32
LANES = 32


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 (..., n) -> (q int8 (..., n/32, 32), d float32 (..., n/32))."""
    x = np.asarray(x, F32)
    xb = x.reshape(x.shape[:-1] + (-1, SUB))
    d = np.max(np.abs(xb), axis=-1) / F32(127)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(d > 0, F32(1) / d, F32(0)).astype(F32)
    inv = np.where(np.isinf(inv), F32(0), inv)  # 1/d overflows (d < 2^-128): q = 0, not a cast of inf
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    return q, d.astype(F32)


def lane_sum(terms: np.ndarray) -> np.ndarray:
    """Sum float32 terms (..., nsub) in the canonical warp order."""
    nsub = terms.shape[-1]
    pad = (-nsub) % LANES
    if pad:
        terms = np.concatenate([terms, np.zeros(terms.shape[:-1] + (pad,), F32)], axis=-1)
    chunks = terms.reshape(terms.shape[:-1] + (-1, LANES))
    acc = np.zeros(terms.shape[:-1] + (LANES,), F32)
    for i in range(chunks.shape[-2]):
        acc = acc + chunks[..., i, :]
    off = LANES // 2
    while off:
        acc = acc[..., :off] + acc[..., off:2 * off]
        off //= 2
    return acc[..., 0]


def _isums(w: np.ndarray, qa: np.ndarray) -> np.ndarray:
    """Exact integer sums sum_v w[r, b, v] * qa[t, b, v] as float32 (tokens, rows, nsub)."""
    # Integer-valued float32 products (|w| <= 4096, |qa| <= 127) summed over 32 values stay below 2^24, so a float32
    # matmul gives the exact integer sums in any order: BLAS is safe here and much faster than an integer einsum.
    return np.matmul(qa.astype(F32).transpose(1, 0, 2), w.astype(F32).transpose(1, 2, 0)).transpose(1, 2, 0)


def qdot(w: IntBlocks, qa: np.ndarray, da: np.ndarray) -> np.ndarray:
    """Canonical dot of weight rows w (rows, nsub, 32) with quantised inputs (tokens, nsub, 32) -> (tokens, rows)."""
    t = (w.scale[None, :, :] * da[:, None, :]) * _isums(w.q, qa)
    if w.minimum is not None:
        if w.mweight is None:
            msum = qa.astype(np.int32).sum(axis=-1).astype(F32)[:, None, :]
        else:
            msum = _isums(w.mweight, qa)
        t = t - (w.minimum[None, :, :] * da[:, None, :]) * msum
    return lane_sum(t.astype(F32, copy=False))


# exp in float32 from IEEE-rounded operations only, so a CUDA kernel (with __fmul_rn/__fadd_rn) and numpy agree
LOG2E = F32(1.44269502)
LN2_HI = F32(0.693145751953125)  # few mantissa bits: n * LN2_HI is exact for |n| < 2^9
LN2_LO = F32(1.42860677e-06)
EXP_POLY = tuple(F32(c) for c in (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0))


def exp(x: np.ndarray) -> np.ndarray:
    x = np.clip(np.asarray(x, F32), F32(-87.0), F32(88.0))
    n = np.rint(x * LOG2E)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = np.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    scale = ((n.astype(np.int32) + 127) << 23).view(F32)
    return p * scale


def silu(g: np.ndarray) -> np.ndarray:
    g = np.asarray(g, F32)
    return g / (F32(1) + exp(-g))


def expert(gate: IntBlocks, up: IntBlocks, down: IntBlocks, qa: np.ndarray, da: np.ndarray) -> np.ndarray:
    """One expert on quantised inputs (tokens, nsub, 32) -> float32 (tokens, d_model)."""
    h = silu(qdot(gate, qa, da)) * qdot(up, qa, da)
    qh, dh = quantize_act(h)
    return qdot(down, qh, dh)


def combine(weights: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """Router-order weighted sum: weights (tokens, k), outputs (tokens, k, d) -> (tokens, d)."""
    acc = np.zeros(outputs.shape[:1] + outputs.shape[2:], F32)
    for j in range(outputs.shape[1]):
        acc = acc + weights[:, j:j + 1].astype(F32) * outputs[:, j]
    return acc
