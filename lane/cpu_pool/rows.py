"""Row dots: a range of weight rows against the tokens' activation rows, for IQ3_S, Q4_K and Q8_0 in registers and
for every other type through its decoder (`_rows_dec`); `_rows` dispatches on the type."""

import numpy as np
from numba import njit

from stratad.model.quants import SUB
from lane.cpu_pool.tables import (
    BF16_T, F16_T, F32_T, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS, LANES, MXFP4, Q3_K,
    Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, _BB, _BV, _KIND, _K_I16, _K_I8, _K_U8_MIN, _K_U8_MW, _ZERO
)
from lane.cpu_pool.vector_ir import _idot_i8
from lane.cpu_pool.blocks import _blk_dec, _blk_i8, _blk_iq3s, _blk_q2k, _blk_q3k, _blk_q4k, _blk_q5k, _blk_q6k
from lane.cpu_pool.blocks_legacy_iq import (
    _blk_iq1m, _blk_iq1s, _blk_iq2s, _blk_iq2xs, _blk_iq2xxs, _blk_iq3xxs, _blk_iq4nl, _blk_iq4xs, _blk_mxfp4, _blk_q40,
    _blk_q41, _blk_q50, _blk_q51
)
from lane.cpu_pool.blocks_float import _blk_bf16, _blk_f16, _blk_f32
from lane.cpu_pool.byte_ops import _dec_iq3s
from lane.cpu_pool.scalar import _f16, _fold32
from lane.cpu_pool.decoders import _decode


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


@njit(nogil=True, cache=True, inline="always")
def _sub_terms(r, wb, sbuf, mbuf, has_min, a, da, asum, t0, acc, acco, lane0):
    """The canonical terms of the first r decoded sub-blocks (a row's last 32-value blocks short of 8), one by one."""
    for j in range(r):
        t = t0 + j
        isum = 0
        for v in range(SUB):
            isum += np.int32(wb[SUB * j + v]) * np.int32(a[t * SUB + v])
        term = (sbuf[j] * da[t]) * np.float32(isum)
        if has_min:
            term = term - (mbuf[j] * da[t]) * asum[t]
        acc[acco + ((lane0 + j) & 31)] += term


@njit(nogil=True, cache=True, inline="always")
def _rows_dec(qtype, w, ro, rb, nrows, a, da, asum, idx, n, s, res, f16e, tab):
    """Any type of _DECODED: per row, each block (32-value types: 8 blocks) decoded once, then its 8 sub-blocks'
    terms for each of the n tokens; a block that one token reads is decoded in registers instead (the _blk_*
    kernels: no buffer written and read back)."""
    acc, wb8, wbu, mwu, wb16, sbuf, mbuf = s
    kind = _KIND[qtype]
    bb = _BB[qtype]
    step = bb * 256 // _BV[qtype]  # bytes of 8 sub-blocks
    nsub = rb // bb * _BV[qtype] // SUB
    ng = nsub // 8
    r = nsub - ng * 8
    for i in range(nrows):
        for l in range(n * LANES):
            acc[l] = _ZERO
        for bg in range(ng):
            o = ro + i * rb + bg * step
            lane0 = (bg * 8) & 31
            # one token: the block (8 blocks of 32) decoded in registers instead. The chain stays in this loop: as a
            # helper function it ran 2.5x slower (measured in session 33, not looked into)
            if n == 1:
                t = idx[0] * nsub + bg * 8
                if qtype == Q4_0:
                    _blk_q40(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q4_1:
                    _blk_q41(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q5_0:
                    _blk_q50(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q5_1:
                    _blk_q51(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ4_NL:
                    _blk_iq4nl(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ4_XS:
                    _blk_iq4xs(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == MXFP4:
                    _blk_mxfp4(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ3_XXS:
                    _blk_iq3xxs(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ2_XXS:
                    _blk_iq2xxs(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ2_XS:
                    _blk_iq2xs(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ2_S:
                    _blk_iq2s(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ1_S:
                    _blk_iq1s(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ1_M:
                    _blk_iq1m(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == F16_T:
                    _blk_f16(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == BF16_T:
                    _blk_bf16(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == F32_T:
                    _blk_f32(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q5_K:
                    _blk_q5k(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q6_K:
                    _blk_q6k(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q3_K:
                    _blk_q3k(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                else:
                    _blk_q2k(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, lane0)
                continue
            _decode(qtype, w, o, 8, s, f16e, tab)
            for k in range(n):
                t = idx[k] * nsub + bg * 8
                if kind == _K_I8:
                    _blk_dec(wb8, None, sbuf, None, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
                elif kind == _K_U8_MIN:
                    _blk_dec(wbu, None, sbuf, mbuf, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
                elif kind == _K_U8_MW:
                    _blk_dec(wbu, mwu, sbuf, mbuf, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
                else:
                    _blk_dec(wb16, None, sbuf, None, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
        if r:  # only 32-value types (kinds _K_I8, _K_U8_MIN) and the float types (_K_I16) have rows whose length is
            # not a multiple of 256
            _decode(qtype, w, ro + i * rb + ng * step, r, s, f16e, tab)
            for k in range(n):
                t = idx[k] * nsub + ng * 8
                if kind == _K_I8:
                    _sub_terms(r, wb8, sbuf, mbuf, False, a, da, asum, t, acc, k * LANES, (ng * 8) & 31)
                elif kind == _K_I16:
                    _sub_terms(r, wb16, sbuf, mbuf, False, a, da, asum, t, acc, k * LANES, (ng * 8) & 31)
                else:
                    _sub_terms(r, wbu, sbuf, mbuf, True, a, da, asum, t, acc, k * LANES, (ng * 8) & 31)
        for k in range(n):
            res[k * nrows + i] = _fold32(acc, k * LANES)


@njit(nogil=True, cache=True, inline="always")
def _scratch(maxg):
    """A phase's work buffers for _rows: (lane sums for maxg tokens, decoded q as int8 / uint8, uint8 mweights,
    int16 q, per sub-block scales, minimums), and the group's token indices."""
    return ((np.empty(maxg * LANES, np.float32), np.empty(256, np.int8), np.empty(256, np.uint8),
             np.empty(256, np.uint8), np.empty(256, np.int16), np.empty(8, np.float32), np.empty(8, np.float32)),
            np.empty(maxg, np.int64))


@njit(nogil=True, cache=True)
def _rows(qtype, w, ro, rb, nrows, a, da, asum, idx, n, s, res, f16e, grid, tab):
    """res[k * nrows + i] = canonical dot of raw weight row i (w[ro + i * rb:], rb bytes) with activation idx[k]
    (s: the _scratch buffers)."""
    acc, wbuf, _, _, _, sbuf, mbuf = s
    if qtype == IQ3_S:
        _rows_iq3s(w, ro, rb, nrows, rb // 110 * 8, a, da, asum, idx, n, acc, wbuf, sbuf, res, f16e, grid)
    elif qtype == Q4_K:
        _rows_q4k(w, ro, rb, nrows, rb // 144 * 8, a, da, asum, idx, n, acc, sbuf, mbuf, res)
    elif qtype == Q8_0:
        _rows_q80(w, ro, rb, nrows, rb // 34, a, da, asum, idx, n, acc, sbuf, res, f16e)
    else:
        _rows_dec(qtype, w, ro, rb, nrows, a, da, asum, idx, n, s, res, f16e, tab)


