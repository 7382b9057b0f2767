"""One layer's CPU share as one numba parallel call: gate/up + SwiGLU, quantise h, down, each phase over a range of
the flattened (pair group, row) space, the rows shared among threads by atomic tickets."""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from stratad.model.quants import SUB
from lane.cpu_pool.tables import _127, _ONE, _ZERO
from lane.cpu_pool.vector_ir import _I64
from lane.cpu_pool.scalar import _exp
from lane.cpu_pool.rows import _rows, _scratch


# a pair group = the pairs that share one expert; flattened row i = group * rows + r. Weights come as flat uint8
# arrays (a layer tensor's bytes: n_expert * rows * row_bytes).


@njit(nogil=True, cache=True)
def _act_sums(qa, asum):
    """asum[b] = float32(sum(qa[32 b:32 b + 32])) (flat arrays), the Q4_K minimum's integer factor."""
    for b in range(asum.shape[0]):
        s = 0
        for v in range(SUB):
            s += qa[b * SUB + v]
        asum[b] = np.float32(s)


@njit(nogil=True, cache=True)
def _group(pairs, n_expert, n_tokens, gpairs, gstart, gexp):
    """Pairs grouped by expert, in expert order and, within an expert, in pair order (a counting sort):
    gpairs = pair indices, group g = gpairs[gstart[g]:gstart[g + 1]] of expert gexp[g]. Returns (groups,
    largest group), or (-1, 0) if a token or expert index is out of range."""
    start = np.zeros(n_expert + 1, np.int64)
    for i in range(pairs.shape[0]):
        t, e = pairs[i, 0], pairs[i, 1]
        if t < 0 or t >= n_tokens or e < 0 or e >= n_expert:
            return -1, 0
        start[e + 1] += 1
    ngrp = 0
    maxg = 0
    for e in range(n_expert):
        size = start[e + 1]
        if size:
            gstart[ngrp] = start[e]
            gexp[ngrp] = e
            ngrp += 1
            maxg = max(maxg, size)
        start[e + 1] += start[e]
    gstart[ngrp] = pairs.shape[0]
    for i in range(pairs.shape[0]):
        e = pairs[i, 1]
        gpairs[start[e]] = i
        start[e] += 1
    return ngrp, maxg


CHUNK = 64  # rows per _rows call


@njit(nogil=True, cache=True, inline="always")
def _span(i, hi, rows, gstart):
    """The piece of flattened row i's group that a phase computes next: (group, first row, rows, the group's first
    pair, its pairs), at most CHUNK rows and none past hi."""
    grp = i // rows
    r0 = i - grp * rows
    p0 = gstart[grp]
    return grp, r0, min(rows - r0, CHUNK, hi - i), p0, gstart[grp + 1] - p0


@njit(nogil=True, cache=True)
def _gate_up(lo, hi, tg, tu, gate, up, d_ff, rb_g, rb_u, a, da, asum, pair_tok, gstart, gpairs, gexp, maxg, h, f16e,
             pow2, grid, tab):
    """h[p * d_ff + r] = silu(gate_e[r] . x_t) * (up_e[r] . x_t) for the flattened rows [lo, hi)."""
    s, idx = _scratch(maxg)
    gv = np.empty(maxg * CHUNK, np.float32)
    uv = np.empty(maxg * CHUNK, np.float32)
    i = lo
    while i < hi:
        grp, r0, m, p0, n = _span(i, hi, d_ff, gstart)
        for k in range(n):
            idx[k] = pair_tok[gpairs[p0 + k]]
        e = gexp[grp]
        _rows(tg, gate, (e * d_ff + r0) * rb_g, rb_g, m, a, da, asum, idx, n, s, gv, f16e, grid, tab)
        _rows(tu, up, (e * d_ff + r0) * rb_u, rb_u, m, a, da, asum, idx, n, s, uv, f16e, grid, tab)
        for k in range(n):
            ho = gpairs[p0 + k] * d_ff + r0
            for r in range(m):
                g = gv[k * m + r]
                h[ho + r] = (g / (_ONE + _exp(-g, pow2))) * uv[k * m + r]
        i += m


@njit(nogil=True, cache=True)
def _quantize(h, lo, hi, n, qh, dh, hsum):
    """canonical.quantize_act of rows [lo, hi) of h (flat, n values a row) into qh (flat int8), dh and hsum (flat,
    n / 32 a row; hsum = the sub-blocks' integer sums, for a Q4_K down)."""
    for b in range(lo * (n // SUB), hi * (n // SUB)):
        o = b * SUB
        amax = _ZERO
        for v in range(SUB):
            x = abs(h[o + v])
            if x > amax:
                amax = x
        d = amax / _127
        inv = _ONE / d if d > _ZERO else _ZERO
        if np.isinf(inv):  # a subnormal d whose 1 / d overflows: q = 0 by definition, not a cast of inf
            inv = _ZERO
        s = 0
        for v in range(SUB):
            q = np.int64(np.rint(h[o + v] * inv))
            qh[o + v] = q
            s += q
        dh[b] = d
        hsum[b] = np.float32(s)


@njit(nogil=True, cache=True)
def _down(lo, hi, td, down, d_model, rb_d, a, dh, hsum, gstart, gpairs, gexp, maxg, out, f16e, grid, tab):
    """out[p * d_model + r] = down_e[r] . h_p for the flattened rows [lo, hi) (a: the pairs' quantised h)."""
    s, idx = _scratch(maxg)
    res = np.empty(maxg * CHUNK, np.float32)
    i = lo
    while i < hi:
        grp, r0, m, p0, n = _span(i, hi, d_model, gstart)
        for k in range(n):
            idx[k] = gpairs[p0 + k]
        e = gexp[grp]
        _rows(td, down, (e * d_model + r0) * rb_d, rb_d, m, a, dh, hsum, idx, n, s, res, f16e, grid, tab)
        for k in range(n):
            oo = idx[k] * d_model + r0
            for r in range(m):
                out[oo + r] = res[k * m + r]
        i += m


# ---- work sharing: threads take CHUNK-row units from an atomic ticket counter (a busy core just takes fewer) ------


@intrinsic
def _ticket(typingctx, counter):
    """Atomic counter[0] += 1 (int64 array), returning the old value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and counter.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        p = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [ir.Constant(_I64, 0)])
        return builder.atomic_rmw("add", p, ir.Constant(_I64, 1), "monotonic")
    return types.int64(counter), codegen


@njit(nogil=True, cache=True)
def _gate_up_worker(ticket, n, tg, tu, gate, up, d_ff, rb_g, rb_u, a, da, asum, pair_tok, gstart, gpairs, gexp, maxg,
                    h, f16e, pow2, grid, tab):
    while True:
        lo = _ticket(ticket) * CHUNK
        if lo >= n:
            return
        _gate_up(lo, min(n, lo + CHUNK), tg, tu, gate, up, d_ff, rb_g, rb_u, a, da, asum, pair_tok, gstart, gpairs,
                 gexp, maxg, h, f16e, pow2, grid, tab)


@njit(nogil=True, cache=True)
def _down_worker(ticket, n, td, down, d_model, rb_d, a, dh, hsum, gstart, gpairs, gexp, maxg, out, f16e, grid, tab):
    while True:
        lo = _ticket(ticket) * CHUNK
        if lo >= n:
            return
        _down(lo, min(n, lo + CHUNK), td, down, d_model, rb_d, a, dh, hsum, gstart, gpairs, gexp, maxg, out, f16e,
              grid, tab)


@njit(nogil=True, cache=True, inline="always")
def _part(c, n, parts):
    """[lo, hi) of part c of [0, n) cut into `parts` near-equal ranges (a prange worker's share)."""
    return c * n // parts, (c + 1) * n // parts


@njit(nogil=True, cache=True, parallel=True)
def _layer_parallel(nthreads, tickets, tg, tu, td, gate, up, down, d_ff, d_model, rb_g, rb_u, rb_d, a, da, asum,
                    pair_tok, gstart, gpairs, gexp, maxg, h, qh, dh, hsum, out, f16e, pow2, grid, tab):
    """The whole layer in one call on numba's own threads (prange over nthreads workers sharing the tickets)."""
    ngrp = gstart.shape[0] - 1
    t1 = tickets[0:1]
    t2 = tickets[8:9]
    for w in prange(nthreads):
        _gate_up_worker(t1, ngrp * d_ff, tg, tu, gate, up, d_ff, rb_g, rb_u, a, da, asum, pair_tok, gstart, gpairs,
                        gexp, maxg, h, f16e, pow2, grid, tab)
    npair = gpairs.shape[0]
    for c in prange(nthreads):
        lo, hi = _part(c, npair, nthreads)
        _quantize(h, lo, hi, d_ff, qh, dh, hsum)
    for w in prange(nthreads):
        _down_worker(t2, ngrp * d_model, td, down, d_model, rb_d, qh, dh, hsum, gstart, gpairs, gexp, maxg, out, f16e,
                     grid, tab)


