"""Scalar helpers of the njit code: f16 bits to float32, the canonical exp, the fold of 32 virtual lanes."""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from lane.cpu_pool.tables import _EXP_HI, _EXP_LO, _LN2_HI, _LN2_LO, _LOG2E, _P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7
from lane.cpu_pool.vector_ir import _I32, _const, _vptr


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


