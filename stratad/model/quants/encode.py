"""Float rows to blocks, for the model generator's rows with columns set by value (the embedding under a router
skew, the LM head with two topics) in types gguf.quants cannot quantise: Q2_K ... Q6_K, IQ4_NL, IQ4_XS, IQ3_S.

Plain round-to-nearest with scales from each (sub-)block's range, not llama.cpp's search: valid blocks whose values
approximate the input (tests/test_quants.py states the error per type). Other types go through gguf.quants.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from . import iquants, kquants
from .common import f16, put_f16

GGUF_ENCODED = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4)


def pack_nibbles(v: np.ndarray, span: int) -> np.ndarray:
    """Inverse of common.nibbles: 4-bit values (..., 2 k) -> bytes (..., k)."""
    g = v.astype(np.uint8).reshape(v.shape[:-1] + (-1, 2, span))
    return (g[..., 0, :] | (g[..., 1, :] << 4)).reshape(v.shape[:-1] + (-1,))


def pack_bits(v: np.ndarray, width: int, span: int) -> np.ndarray:
    """Inverse of common.bits: width-bit values (..., k * 8 / width) -> bytes (..., k)."""
    g = v.astype(np.uint8).reshape(v.shape[:-1] + (-1, 8 // width, span))
    out = np.zeros(g.shape[:-2] + (span,), np.uint8)
    for f in range(8 // width):
        out |= g[..., f, :] << (f * width)
    return out.reshape(v.shape[:-1] + (-1,))


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _put_d(b: np.ndarray, off: int, v: np.ndarray) -> np.ndarray:
    """Write f16 scales and return them as stored (float32)."""
    put_f16(b, off, v.astype(np.float32))
    return f16(b, off)


def _k_minmax(b, xb, nmax: int, smax: int, d_off: int, dmin_off: int):
    """Scale-and-minimum sub-blocks (Q2_K, Q4_K, Q5_K): codes in 0..nmax, integer scales / minimums in 0..smax."""
    lo, hi = np.minimum(xb.min(-1), 0), np.maximum(xb.max(-1), 0)
    s, m = (hi - lo) / nmax, -lo
    d = _put_d(b, d_off, s.max(-1) / smax)[..., None]
    dmin = _put_d(b, dmin_off, m.max(-1) / smax)[..., None]
    sc = np.clip(np.rint(_div(s, d)), 0, smax).astype(np.uint8)
    mn = np.clip(np.rint(_div(m, dmin)), 0, smax).astype(np.uint8)
    step = (d * sc)[..., None]
    codes = np.clip(np.rint(_div(xb + (dmin * mn)[..., None], step)), 0, nmax).astype(np.uint8)
    return sc, mn, codes


def _q4_k(x, b):
    sc, mn, codes = _k_minmax(b, x.reshape(b.shape[:2] + (8, 32)), 15, 63, 0, 2)
    kquants._put_k4_scales(b, sc, mn)
    b[..., 16:144] = pack_nibbles(codes.reshape(b.shape[:2] + (256,)), 32)


def _q5_k(x, b):
    sc, mn, codes = _k_minmax(b, x.reshape(b.shape[:2] + (8, 32)), 31, 63, 0, 2)
    kquants._put_k4_scales(b, sc, mn)
    codes = codes.reshape(b.shape[:2] + (256,))
    b[..., 16:48] = pack_bits(codes >> 4, 1, 32)
    b[..., 48:176] = pack_nibbles(codes & 15, 32)


def _q2_k(x, b):
    sc, mn, codes = _k_minmax(b, x.reshape(b.shape[:2] + (16, 16)), 3, 15, 80, 82)
    b[..., 0:16] = sc | (mn << 4)
    b[..., 16:80] = pack_bits(codes.reshape(b.shape[:2] + (256,)), 2, 32)


def _symmetric(b, xb, cmin: float, cmax: float, smax: int, d_off: int):
    """Signed codes in cmin..cmax (Q3_K, Q6_K): positive integer scales in 0..smax, codes x / (d sc)."""
    s = np.maximum(np.maximum(xb.max(-1), 0) / cmax, np.maximum(-xb.min(-1), 0) / -cmin)
    d = _put_d(b, d_off, s.max(-1) / smax)[..., None]
    sc = np.clip(np.rint(_div(s, d)), 0, smax).astype(np.int32)
    return sc, _div(xb, (d * sc)[..., None])


def _q3_k(x, b):
    sc, y = _symmetric(b, x.reshape(b.shape[:2] + (16, 16)), -4, 3, 31, 108)
    code = np.clip(np.rint(y), -4, 3).astype(np.int8).reshape(b.shape[:2] + (256,))
    h = (code >= 0).astype(np.uint8)  # ggml: q = ql - 4 (1 - h)
    b[..., 0:32] = pack_bits(h, 1, 32)
    b[..., 32:96] = pack_bits((code + 4 * (1 - h.astype(np.int8))).astype(np.uint8), 2, 32)
    kquants._put_q3k_scales(b, (sc + 32).astype(np.uint8))


def _q6_k(x, b):
    sc, y = _symmetric(b, x.reshape(b.shape[:2] + (16, 16)), -32, 31, 127, 208)
    q = (np.clip(np.rint(y), -32, 31) + 32).astype(np.uint8).reshape(b.shape[:2] + (256,))
    b[..., 0:128] = pack_nibbles(q & 15, 64)
    b[..., 128:192] = pack_bits(q >> 4, 2, 32)
    b[..., 192:208] = sc.astype(np.int8).view(np.uint8)


def _nearest_iq4(y: np.ndarray) -> np.ndarray:
    kv = iquants.IQ4_VALUES.astype(np.float32)
    return np.abs(y[..., None] - kv).argmin(-1).astype(np.uint8)


def _iq4_nl(x, b):
    xb = x.reshape(b.shape[:2] + (32,))
    d = _put_d(b, 0, np.abs(xb).max(-1) / 127)
    b[..., 2:18] = pack_nibbles(_nearest_iq4(_div(xb, d[..., None])), 16)


def _iq4_xs(x, b):
    xb = x.reshape(b.shape[:2] + (8, 32))
    s = np.abs(xb).max(-1) / 127
    d = _put_d(b, 0, s.max(-1) / 31)[..., None]
    ls = np.clip(np.rint(_div(s, d)), 0, 31).astype(np.uint16) + 32
    b[..., 4:8] = pack_nibbles(ls & 15, 1)
    hi = ((ls >> 4) << np.arange(0, 16, 2, dtype=np.uint16)).sum(-1).astype(np.uint16)
    b[..., 2:4] = hi.view(np.uint8).reshape(b.shape[:2] + (2,))
    codes = _nearest_iq4(_div(xb, (d * (ls.astype(np.float32) - 32))[..., None]))
    b[..., 8:136] = pack_nibbles(codes.reshape(b.shape[:2] + (256,)), 16)


@lru_cache(maxsize=1)
def _iq3s_nearest() -> np.ndarray:
    """Grid entry nearest to each of the 8^4 level patterns (levels 1, 3, ..., 15 per value)."""
    g = iquants.grid(T.IQ3_S).astype(np.float32)
    lv = (1 + 2 * np.indices((8,) * 4).reshape(4, -1).T).astype(np.float32)  # key = sum level_j 8^(3 - j)
    return ((lv[:, None, :] - g[None]) ** 2).sum(-1).argmin(-1).astype(np.uint16)


def _iq3_s(x, b):
    xb = x.reshape(b.shape[:2] + (8, 32))
    s = np.abs(xb).max(-1) / 15
    d = _put_d(b, 0, s.max(-1) / 31)[..., None]
    nib = np.clip(np.rint((_div(s, d) - 1) / 2), 0, 15).astype(np.uint8)
    b[..., 106:110] = pack_nibbles(nib.reshape(b.shape[:2] + (8,)), 1)
    m = _div(np.abs(xb), (d * (1 + 2 * nib.astype(np.float32)))[..., None])
    level = np.clip(np.rint((m - 1) / 2), 0, 7).astype(np.int64).reshape(b.shape[:2] + (64, 4))
    idx = _iq3s_nearest()[(level * (8 ** np.arange(3, -1, -1))).sum(-1)]
    b[..., 2:66] = (idx & 255).astype(np.uint8)
    b[..., 66:74] = pack_bits((idx >> 8).astype(np.uint8), 1, 1)
    b[..., 74:106] = pack_bits((xb < 0).reshape(b.shape[:2] + (256,)), 1, 1)


ENCODERS = {T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.IQ4_NL: _iq4_nl,
            T.IQ4_XS: _iq4_xs, T.IQ3_S: _iq3_s}
ENCODED = GGUF_ENCODED + tuple(ENCODERS)


def encode(qtype: T, x: np.ndarray) -> np.ndarray:
    """float32 rows (rows, n) as `qtype` data: uint8 (rows, row_bytes), or the float array for float types."""
    from . import fmt

    x = np.ascontiguousarray(x, np.float32)
    if qtype not in ENCODED:
        raise ValueError(f"no float encoder for {T(qtype).name}; encodable: {', '.join(t.name for t in ENCODED)}")
    if qtype in GGUF_ENCODED:
        return x if qtype == T.F32 else gq.quantize(x, qtype)
    f = fmt(qtype)
    b = np.zeros((x.shape[0], f.row_bytes(x.shape[1]) // f.block_bytes, f.block_bytes), np.uint8)
    ENCODERS[qtype](x, b)
    return b.reshape(x.shape[0], -1)
