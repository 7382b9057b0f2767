"""Decoded-block kernels' decoders: every other quantised type's block into its canonical integer view in small
buffers."""

import numpy as np
from numba import njit

from stratad.model.quants import SUB
from lane.cpu_pool.tables import (
    BF16_T, F16_T, F32, F32_T, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_XXS, IQ4_NL, IQ4_XS, MXFP4, POW2, Q2_K, Q3_K,
    Q4_1, Q5_0, Q5_1, Q5_K, Q6_K, _BB, _EIGHTH, _HALF, _QUARTER, _T_EIGHTS, _T_IQ1M, _T_IQ1S, _T_IQ2S, _T_IQ2XS,
    _T_IQ2XXS, _T_IQ3XXS, _T_IQ4, _T_KSIGNS, _T_MXFP4, _T_ONES, _T_SIGN8
)
from lane.cpu_pool.blocks_float import _dec_bf16, _dec_f16, _dec_f32
from lane.cpu_pool.byte_ops import _vbit4, _vfield, _vgrid, _vlut16, _vmul16
from lane.cpu_pool.scalar import _f16


# One mechanism: a type's decoder turns one 256-value block (or up to 8 consecutive 32-value blocks) into its
# canonical integer view (docs/quant-types.md) in small buffers: q (int8, uint8 or int16: _DECODED says which), the
# sub-blocks' scale and minimum, Q2_K's mweights; _rows_dec then forms the 8 sub-blocks' exact integer sums and
# canonical terms for every token sharing the expert (_blk_dec), so a block is decoded once however many tokens
# read it. Every factor is formed exactly as the view forms it (same float32 operations, same order). The decoders
# are plain njit functions, not inlined into the row loop: inlined, the a3b layer ran 15-35 % faster for Q4_0 / Q5_K
# / Q6_K, but numba's first compile of the pool took 64 s instead of 20 s on the 2-core box (every CPU card's lane
# and every fresh install pays it once).


@njit(nogil=True, cache=True, inline="always")
def _u16(w, o):
    return np.int64(w[o]) | (np.int64(w[o + 1]) << 8)


@njit(nogil=True, cache=True, inline="always")
def _u32(w, o):
    return _u16(w, o) | (_u16(w, o + 2) << 16)


@njit(nogil=True, cache=True, inline="always")
def _k4_scales(w, o, sbuf, mbuf, f16e):
    """Q4_K / Q5_K block at w[o]: scale_j = d * sc_j, minimum_j = dmin * m_j (6-bit sc / m packed in 12 bytes)."""
    d = _f16(w[o], w[o + 1], f16e)
    dmin = _f16(w[o + 2], w[o + 3], f16e)
    for j in range(4):
        sbuf[j] = d * np.float32(np.int64(w[o + 4 + j]) & 0x3F)
        mbuf[j] = dmin * np.float32(np.int64(w[o + 8 + j]) & 0x3F)
        md = np.int64(w[o + 12 + j])
        sbuf[j + 4] = d * np.float32((md & 0x0F) | ((np.int64(w[o + 4 + j]) >> 2) & 0x30))
        mbuf[j + 4] = dmin * np.float32((md >> 4) | ((np.int64(w[o + 8 + j]) >> 2) & 0x30))


@njit(nogil=True, cache=True, inline="always")
def _nib_sub(w, p, wb, wo, bias):
    """A 32-value sub-block of 4-bit codes - bias: 16 bytes at w[p], low nibbles then high."""
    _vfield(wb, wo, w, p, 0, 15, 0, 0, bias)
    _vfield(wb, wo + 16, w, p, 4, 15, 0, 0, bias)


@njit(nogil=True, cache=True, inline="always")
def _q5_sub(w, p, wb, wo):
    """Q5_0 / Q5_1 codes: 32 high bits (bit v for value v) at w[p], then the 16 nibble bytes."""
    _nib_sub(w, p + 4, wb, wo, 0)
    _vbit4(wb, wo, w, p)
    _vbit4(wb, wo + 16, w, p + 2)


@njit(nogil=True, cache=True, inline="always")
def _lut_sub(w, p, wb8, wo, tab, t):
    """IQ4 / MXFP4 sub-block: 16 bytes at w[p], low nibbles then high, each the index of its value in tab[t:]."""
    _vlut16(wb8, wo, w, p, 0, tab, t)
    _vlut16(wb8, wo + 16, w, p, 4, tab, t)


@njit(nogil=True, cache=True, inline="always")
def _scale16(wb8, f, k, wb16):
    """Values 16 k .. 16 k + 15 of the codes in wb8 times their 16-value integer scale f, into wb16."""
    _vmul16(wb16, 16 * k, wb8, 16 * k, f)


@njit(nogil=True, cache=True, inline="always")
def _ksign(tab, i):
    """ggml's ksigns[i]: 7 sign bits and their parity."""
    return np.int64(tab[_T_KSIGNS + i]) & 0xFF


@njit(nogil=True, cache=True)
def _dec_legacy(qtype, w, o, g, wb8, wbu, sbuf, mbuf, f16e, tab):
    """g consecutive 32-value blocks from w[o]: Q4_0 / Q5_0 (int8 q = code - 8 / - 16), Q4_1 / Q5_1 (uint8 q = code,
    minimum = -m), IQ4_NL (q = kvalues[code]). Layout: f16 d [, f16 m] [, 32 high bits (Q5)], 16 nibble bytes. And
    MXFP4: an exponent byte e (scale 2^(e - 128)), then 16 nibble bytes (q = the doubled E2M1 value)."""
    bb = _BB[qtype]
    has_m = qtype == Q4_1 or qtype == Q5_1
    five = qtype == Q5_0 or qtype == Q5_1
    for j in range(g):
        b = o + j * bb
        if qtype == MXFP4:
            e = np.int64(w[b])
            sbuf[j] = POW2[e - 2] if e >= 2 else POW2[0] * (F32(0.5) if e == 1 else F32(0.25))
            _lut_sub(w, b + 1, wb8, SUB * j, tab, _T_MXFP4)
            continue
        sbuf[j] = _f16(w[b], w[b + 1], f16e)
        if qtype == IQ4_NL:
            _lut_sub(w, b + 2, wb8, SUB * j, tab, _T_IQ4)
            continue
        p = b + 2
        if has_m:
            mbuf[j] = -_f16(w[b + 2], w[b + 3], f16e)
            p += 2
        if five:
            _q5_sub(w, p, wbu, SUB * j)
            if not has_m:  # Q5_0's q: code - 16, as int8
                _vfield(wb8, SUB * j, wbu, SUB * j, 0, 255, 0, 0, 16)
                _vfield(wb8, SUB * j + 16, wbu, SUB * j + 16, 0, 255, 0, 0, 16)
        elif has_m:
            _nib_sub(w, p, wbu, SUB * j, 0)
        else:  # Q4_0's q: code - 8, as int8
            _nib_sub(w, p, wb8, SUB * j, 8)


@njit(nogil=True, cache=True)
def _dec_q5k(w, o, wbu, sbuf, mbuf, f16e):
    """Q5_K: q = 4-bit code (bytes 48 + 32 (j // 2), low nibbles for even j) | bit j of qh[v] << 4."""
    _k4_scales(w, o, sbuf, mbuf, f16e)
    for j in range(8):
        for hh in range(2):
            _vfield(wbu, SUB * j + 16 * hh, w, o + 48 + 32 * (j >> 1) + 16 * hh, 4 * (j & 1), 15, 0, 0, 0)
            _vfield(wbu, SUB * j + 16 * hh, w, o + 16 + 16 * hh, j, 1, 4, 255, 0)


@njit(nogil=True, cache=True)
def _dec_q2k(w, o, wbu, mwu, sbuf, mbuf, f16e, tab):
    """Q2_K: scale d, q = sc_k * code, minimum dmin, mweight m_k (sc_k / m_k: the low / high nibble of byte k, per
    16 values; the 2-bit codes: bits 2 (j % 4) of qs[32 (j // 4) + v])."""
    d = _f16(w[o + 80], w[o + 81], f16e)
    dmin = _f16(w[o + 82], w[o + 83], f16e)
    for j in range(8):
        sbuf[j] = d
        mbuf[j] = dmin
        for hh in range(2):
            _vfield(wbu, SUB * j + 16 * hh, w, o + 16 + 32 * (j >> 2) + 16 * hh, 2 * (j & 3), 3, 0, 0, 0)
    for k in range(16):
        sc = np.int64(w[o + k])
        _vmul16(wbu, 16 * k, wbu, 16 * k, sc & 15)
        _vmul16(mwu, 16 * k, tab, _T_ONES, sc >> 4)


@njit(nogil=True, cache=True)
def _dec_q3k(w, o, wb8, wb16, sbuf, f16e):
    """Q3_K: scale d, q = (sc_k - 32) * code, code = 2 low bits (bits 2 (j % 4) of qs[32 (j // 4) + v]) - 4 where
    bit j of hmask[v] is clear."""
    d = _f16(w[o + 108], w[o + 109], f16e)
    for j in range(8):
        sbuf[j] = d
        for hh in range(2):
            _vfield(wb8, SUB * j + 16 * hh, w, o + 32 + 32 * (j >> 2) + 16 * hh, 2 * (j & 3), 3, 0, 0, 0)
            _vfield(wb8, SUB * j + 16 * hh, w, o + 16 * hh, j, 1, 2, 255, 4)
    for k in range(16):
        sc = (((np.int64(w[o + 96 + (k & 7)]) >> (4 * (k >> 3))) & 15)
              | (((np.int64(w[o + 104 + (k & 3)]) >> (2 * (k >> 2))) & 3) << 4)) - 32
        _scale16(wb8, sc, k, wb16)


@njit(nogil=True, cache=True)
def _dec_q6k(w, o, wb8, wb16, sbuf, f16e):
    """Q6_K: scale d, q = sc_k * (code - 32); sub-block j = 4 h + p: code = nibble p // 2 of ql[64 h + 32 (p % 2)
    + v] | bits 2 p of qh[32 h + v] << 4; sc_k an int8."""
    d = _f16(w[o + 208], w[o + 209], f16e)
    for j in range(8):
        sbuf[j] = d
        h, p = j >> 2, j & 3
        for hh in range(2):
            _vfield(wb8, SUB * j + 16 * hh, w, o + 64 * h + 32 * (p & 1) + 16 * hh, 4 * (p >> 1), 15, 0, 0, 0)
            _vfield(wb8, SUB * j + 16 * hh, w, o + 128 + 32 * h + 16 * hh, 2 * p, 3, 4, 255, 32)
    for k in range(16):
        _scale16(wb8, np.int64(np.int8(w[o + 192 + k])), k, wb16)


@njit(nogil=True, cache=True)
def _dec_iq4xs(w, o, wb8, sbuf, f16e, tab):
    """IQ4_XS: scale d * (ls_j - 32), ls_j = nibble of scales_l | 2 bits of scales_h << 4; q = kvalues[code]."""
    d = _f16(w[o], w[o + 1], f16e)
    sh = _u16(w, o + 2)
    for j in range(8):
        ls = ((np.int64(w[o + 4 + (j >> 1)]) >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4)
        sbuf[j] = d * np.float32(ls - 32)
        _lut_sub(w, o + 8 + 16 * j, wb8, SUB * j, tab, _T_IQ4)


@njit(nogil=True, cache=True)
def _dec_iq3xxs(w, o, wb8, sbuf, f16e, tab):
    """IQ3_XXS: sub-block j has 8 grid indices (4 values each) and a word of 4 x 7 ksign bits and a 4-bit ls;
    scale (d * (0.5 + ls)) * 0.5."""
    d = _f16(w[o], w[o + 1], f16e)
    for j in range(8):
        wd = _u32(w, o + 66 + 4 * j)
        sbuf[j] = (d * (_HALF + np.float32(wd >> 28))) * _HALF
        for g in range(4):
            mask = _ksign(tab, (wd >> (7 * g)) & 127)
            for e in range(2):
                gi = _T_IQ3XXS + 4 * np.int64(w[o + 2 + 8 * j + 2 * g + e])
                _vgrid(4, wb8, SUB * j + 8 * g + 4 * e, tab, gi, _T_SIGN8 + 8 * mask + 4 * e, 0, 1)


@njit(nogil=True, cache=True)
def _dec_iq2xxs(w, o, wb8, sbuf, f16e, tab):
    """IQ2_XXS: sub-block j = 4 grid index bytes, then a word of 4 x 7 ksign bits and a 4-bit ls; scale
    (d * (0.5 + ls)) * 0.25."""
    d = _f16(w[o], w[o + 1], f16e)
    for j in range(8):
        p = o + 2 + 8 * j
        w1 = _u32(w, p + 4)
        sbuf[j] = (d * (_HALF + np.float32(w1 >> 28))) * _QUARTER
        for g in range(4):
            _vgrid(8, wb8, SUB * j + 8 * g, tab, _T_IQ2XXS + 8 * np.int64(w[p + g]),
                    _T_SIGN8 + 8 * _ksign(tab, (w1 >> (7 * g)) & 127), 0, 1)


@njit(nogil=True, cache=True)
def _dec_iq2(qtype, w, o, wb16, sbuf, f16e, tab):
    """IQ2_XS (9-bit index and 7 ksign bits per u16) / IQ2_S (8 + 2 high bits of index, a sign byte per 8 values):
    scale d / 8, q = (2 ls_k + 1) * signed grid value, ls_k the nibble k of the scale bytes."""
    d8 = _f16(w[o], w[o + 1], f16e) * _EIGHTH
    so = o + 66 if qtype == IQ2_XS else o + 74
    for j in range(8):
        sbuf[j] = d8
    for k in range(16):
        f = 2 * ((np.int64(w[so + (k >> 1)]) >> (4 * (k & 1))) & 15) + 1
        for e in range(2):
            n = 2 * k + e
            if qtype == IQ2_XS:
                qs = _u16(w, o + 2 + 2 * n)
                gi = _T_IQ2XS + 8 * (qs & 511)
                mask = _ksign(tab, qs >> 9)
            else:
                gi = _T_IQ2S + 8 * (np.int64(w[o + 2 + n]) | (((np.int64(w[o + 66 + (n >> 2)]) >> (2 * (n & 3))) & 3)
                                                              << 8))
                mask = np.int64(w[o + 34 + n])
            _vgrid(8, wb16, 8 * n, tab, gi, _T_SIGN8 + 8 * mask, 0, f)


@njit(nogil=True, cache=True)
def _dec_iq1s(w, o, wb8, sbuf, f16e, tab):
    """IQ1_S: sub-block j = 4 index bytes and a u16 of 4 x 3 high index bits, ls and the delta's sign; scale
    (d * (2 ls + 1)) / 8, q = 8 g +- 1."""
    d = _f16(w[o], w[o + 1], f16e)
    for j in range(8):
        qh = _u16(w, o + 34 + 2 * j)
        sbuf[j] = (d * np.float32(2 * ((qh >> 12) & 7) + 1)) * _EIGHTH
        delta = -1 if qh & 0x8000 else 1
        for g in range(4):
            gi = _T_IQ1S + 8 * (np.int64(w[o + 2 + 4 * j + g]) | (((qh >> (3 * g)) & 7) << 8))
            _vgrid(8, wb8, SUB * j + 8 * g, tab, gi, _T_EIGHTS, delta, 1)


@njit(nogil=True, cache=True)
def _dec_iq1m(w, o, wb16, sbuf, f16e, tab):
    """IQ1_M: scale d / 8 (d's f16 in the top nibbles of the 4 scale words), q = (2 s_k + 1) * (8 g +- 1); per 8
    values a nibble of 3 high index bits and the delta's sign."""
    s0, s1, s2, s3 = _u16(w, o + 48), _u16(w, o + 50), _u16(w, o + 52), _u16(w, o + 54)
    dh = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000)
    d8 = _f16(dh & 0xFF, dh >> 8, f16e) * _EIGHTH
    for j in range(8):
        sbuf[j] = d8
    for k in range(16):
        f = 2 * ((_u16(w, o + 48 + 2 * (k >> 2)) >> (3 * (k & 3))) & 7) + 1
        for e in range(2):
            n = 2 * k + e
            nib = (np.int64(w[o + 32 + (n >> 1)]) >> (4 * (n & 1))) & 15
            gi = _T_IQ1M + 8 * (np.int64(w[o + n]) | ((nib & 7) << 8))
            _vgrid(8, wb16, 8 * n, tab, gi, _T_EIGHTS, -1 if nib & 8 else 1, f)


@njit(nogil=True, cache=True, inline="always")
def _decode(qtype, w, o, g, s, f16e, tab):
    """The decoded view of the block at w[o] (32-value types: g blocks from w[o]) into the scratch buffers s."""
    _, wb8, wbu, mwu, wb16, sbuf, mbuf = s
    if qtype == Q5_K:
        _dec_q5k(w, o, wbu, sbuf, mbuf, f16e)
    elif qtype == Q6_K:
        _dec_q6k(w, o, wb8, wb16, sbuf, f16e)
    elif qtype == Q3_K:
        _dec_q3k(w, o, wb8, wb16, sbuf, f16e)
    elif qtype == Q2_K:
        _dec_q2k(w, o, wbu, mwu, sbuf, mbuf, f16e, tab)
    elif qtype == IQ4_XS:
        _dec_iq4xs(w, o, wb8, sbuf, f16e, tab)
    elif qtype == IQ3_XXS:
        _dec_iq3xxs(w, o, wb8, sbuf, f16e, tab)
    elif qtype == IQ2_XXS:
        _dec_iq2xxs(w, o, wb8, sbuf, f16e, tab)
    elif qtype == IQ2_XS or qtype == IQ2_S:
        _dec_iq2(qtype, w, o, wb16, sbuf, f16e, tab)
    elif qtype == IQ1_S:
        _dec_iq1s(w, o, wb8, sbuf, f16e, tab)
    elif qtype == IQ1_M:
        _dec_iq1m(w, o, wb16, sbuf, f16e, tab)
    elif qtype == F32_T:
        _dec_f32(w, o, g, wb16, sbuf)
    elif qtype == F16_T:
        _dec_f16(w, o, g, wb16, sbuf)
    elif qtype == BF16_T:
        _dec_bf16(w, o, g, wb16, sbuf)
    else:
        _dec_legacy(qtype, w, o, g, wb8, wbu, sbuf, mbuf, f16e, tab)


