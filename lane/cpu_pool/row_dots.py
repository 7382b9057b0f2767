"""Scalar helpers (f16, the canonical exp, the 32-lane fold) and the row dots of the types decoded in registers
for any number of tokens: IQ3_S, Q4_K, Q8_0."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from stratad.model.quants import SUB

from lane.cpu_pool.block_kernels import _blk_i8, _blk_iq3s, _blk_q4k
from lane.cpu_pool.byte_ops import _dec_iq3s
from lane.cpu_pool.simd import _I32, _const, _idot_i8, _vptr
from lane.cpu_pool.tables import (
    LANES, _EXP_HI, _EXP_LO, _LN2_HI, _LN2_LO, _LOG2E, _P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7, _ZERO)

# ---- scalar helpers -------------------------------------------------------------------------------------------


@njit(nogil=True, cache=True, inline="always")
def _f16(lo, hi, f16e):
    h = np.int64(lo) | (np.int64(hi) << 8)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = np.float32(m) * f16e[0]
    elif e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m | 0x400) * f16e[e]
    if h & 0x8000:
        v = -v
    return v


@njit(nogil=True, cache=True, inline="always")
def _exp(x, pow2):
    """canonical.exp: clamp, n = rint(x log2 e), Cody-Waite reduction, degree-7 Horner, times 2^n."""
    if x < _EXP_LO:
        x = _EXP_LO
    if x > _EXP_HI:
        x = _EXP_HI
    n = np.rint(x * _LOG2E)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _P0
    p = p * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * r + _P6
    p = p * r + _P7
    k = np.int64(n) + 126  # in 0..253 for every finite or infinite x; a NaN x gives NaN either way,
    k = min(max(k, 0), 253)  # but must not index outside the table
    return p * pow2[k]


@intrinsic
def _fold32(typingctx, acc, o):
    """Canonical fold of the 32 lane sums acc[o:o + 32] (float32, 1-D): lane l += lane l + off for
    off = 16, 8, 4, 2, 1 (plain IEEE adds, no fast-math flags: the exact tree of canonical.lane_sum) -> lane 0."""
    if not (isinstance(acc, types.Array) and acc.ndim == 1 and acc.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        v = builder.load(_vptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(f32, 32)), align=4)
        n = 32
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(v, v, _const(_I32, range(n)))
            hi = builder.shuffle_vector(v, v, _const(_I32, range(n, 2 * n)))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(acc, o), codegen


# ---- row dots -------------------------------------------------------------------------------------------------
# Weight rows i = 0..nrows-1 (bytes w[ro + i * rb:]) against n activation rows: res[k * nrows + i] = canonical dot
# of row i with activation row idx[k] (a: int8, flat, nsub * 32 per row; da, asum: float32, flat, nsub per row).
# Every array is 1-D, no view is made in the loops and the loop over rows is inside these functions, so numba's
# reference counting (atomic increments on the shared arrays, which would bounce cache lines between the pool's
# threads) happens once per call, not per row. acc holds n x 32 virtual lanes.


@njit(nogil=True, cache=True, inline="always")
def _rows_iq3s(w, ro, rb, nrows, nsub, a, da, asum, idx, n, acc, wbuf, sbuf, res, f16e, grid):
    for i in range(nrows):
        for l in range(n * LANES):
            acc[l] = _ZERO
        for bi in range(nsub // 8):
            o = ro + i * rb + bi * 110
            d = _f16(w[o], w[o + 1], f16e)
            for j in range(8):
                nib = (np.int64(w[o + 106 + (j >> 1)]) >> (4 * (j & 1))) & 0xF
                sbuf[j] = d * np.float32(1 + 2 * nib)
            lane0 = (bi * 8) & 31
            if n == 1:
                t = idx[0] * nsub + bi * 8
                _blk_iq3s(w, o, grid, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
            else:
                _dec_iq3s(w, o, grid, wbuf)
                for k in range(n):
                    t = idx[k] * nsub + bi * 8
                    _blk_i8(wbuf, 0, SUB, sbuf, None, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
        for k in range(n):
            res[k * nrows + i] = _fold32(acc, k * LANES)


@njit(nogil=True, cache=True, inline="always")
def _rows_q4k(w, ro, rb, nrows, nsub, a, da, asum, idx, n, acc, sbuf, mbuf, res):
    for i in range(nrows):
        for l in range(n * LANES):
            acc[l] = _ZERO
        for bi in range(nsub // 8):
            o = ro + i * rb + bi * 144
            lane0 = (bi * 8) & 31
            for k in range(n):
                t = idx[k] * nsub + bi * 8
                _blk_q4k(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
        for k in range(n):
            res[k * nrows + i] = _fold32(acc, k * LANES)


@njit(nogil=True, cache=True, inline="always")
def _rows_q80(w, ro, rb, nrows, nsub, a, da, asum, idx, n, acc, sbuf, res, f16e):
    for i in range(nrows):
        for l in range(n * LANES):
            acc[l] = _ZERO
        for bg in range(nsub // 8):  # 8 blocks of 32 at a time
            o = ro + i * rb + bg * 8 * 34
            for j in range(8):
                sbuf[j] = _f16(w[o + 34 * j], w[o + 34 * j + 1], f16e)
            lane0 = (bg * 8) & 31
            for k in range(n):
                t = idx[k] * nsub + bg * 8
                _blk_i8(w, o + 2, 34, sbuf, None, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
        for b in range(nsub // 8 * 8, nsub):  # rows of a length that is not a multiple of 256
            o = ro + i * rb + b * 34
            d = _f16(w[o], w[o + 1], f16e)
            for k in range(n):
                t = idx[k] * nsub + b
                s = _idot_i8(w, o + 2, a, t * SUB)
                acc[k * LANES + (b & 31)] += (d * da[t]) * np.float32(s)
        for k in range(n):
            res[k * nrows + i] = _fold32(acc, k * LANES)
