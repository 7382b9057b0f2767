"""ggml's K-quants, 256-value super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (layouts: ggml-common.h block_q2_K ...).

Canonical integer views (docs/quant-types.md):
- Q4_K / Q5_K: 32-value sub-blocks; scale = d * sc_j, minimum = dmin * m_j, q = the 4 / 5-bit code.
- Q2_K: scales and minimums per 16 values, both small integers: scale = d, q = sc_k * code (0..45),
  minimum = dmin, mweight = m_k (0..15) on each value (the minimum term is dmin * sum(m_k * a)).
- Q3_K: scale = d, q = (sc_k - 32) * code, int16 in -128..128 (code in -4..3).
- Q6_K: scale = d, q = sc_k * (code - 32), int16 in -4096..4096 (sc_k an int8).
Products d * sc * code are exact in float32 either way, but ggml multiplies (d * sc) * code: for Q3_K / Q6_K a zero
code under a negative scale is -0.0 there and +0.0 from the view, so their float decode follows ggml's order.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import Format, IntBlocks, Unit, bits, f16, fit_scale, nibbles, per16, put_f16, subs


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes hold eight 6-bit scales and eight 6-bit minimums."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k4_view(b: np.ndarray, codes: np.ndarray) -> IntBlocks:
    lead = b.shape[:-2]
    d, dmin = f16(b, 0), f16(b, 2)
    sc, mn = _scale_min_k4(b[..., 4:16])
    return IntBlocks(subs(codes.astype(np.int8), lead), (d[..., None] * sc.astype(np.float32)).reshape(lead + (-1,)),
                     (dmin[..., None] * mn.astype(np.float32)).reshape(lead + (-1,)))


def q4_k(b):
    return _k4_view(b, nibbles(b[..., 16:144], 32))


def q5_k(b):
    return _k4_view(b, nibbles(b[..., 48:176], 32) | (bits(b[..., 16:48], 1, 32) << 4))


def _q2k_parts(b):
    sc = b[..., 0:16]
    return sc & 0x0F, sc >> 4, bits(b[..., 16:80], 2, 32), f16(b, 80), f16(b, 82)


def _each_sub(x: np.ndarray, lead: tuple) -> np.ndarray:
    """A per-block float (..., nblocks) repeated for the block's 8 sub-blocks (lead..., nsub)."""
    return np.repeat(x[..., None], 8, -1).reshape(lead + (-1,))


def q2_k(b):
    lead = b.shape[:-2]
    sc, mn, code, d, dmin = _q2k_parts(b)
    q = per16(sc, lead) * subs(code, lead)  # <= 45: uint8 products, no overflow
    return IntBlocks(q.astype(np.int8), _each_sub(d, lead), _each_sub(dmin, lead), per16(mn, lead).astype(np.int8))


def _q3k_parts(b):
    code = bits(b[..., 32:96], 2, 32).astype(np.int8) - ((bits(b[..., 0:32], 1, 32) ^ 1) << 2).astype(np.int8)
    s = b[..., 96:108]
    lo = nibbles(s[..., 0:8], 8)
    hi = bits(s[..., 8:12], 2, 4)
    return code, (lo | (hi << 4)).astype(np.int8) - np.int8(32), f16(b, 108)


def q3_k(b):
    lead = b.shape[:-2]
    code, sc, d = _q3k_parts(b)
    q = per16(sc.astype(np.int16), lead) * subs(code.astype(np.int16), lead)
    return IntBlocks(q, _each_sub(d, lead))


def _q6k_parts(b):
    ql = nibbles(b[..., 0:128], 64)
    qh = bits(b[..., 128:192], 2, 32)
    return (ql | (qh << 4)).astype(np.int8) - np.int8(32), b[..., 192:208].view(np.int8), f16(b, 208)


def q6_k(b):
    lead = b.shape[:-2]
    code, sc, d = _q6k_parts(b)
    q = per16(sc.astype(np.int16), lead) * subs(code.astype(np.int16), lead)
    return IntBlocks(q, _each_sub(d, lead))


def _per16_float(parts, b):
    """(d * sc_k) * code, ggml's order (see the module doc)."""
    code, sc, d = parts(b)
    dl = d[..., None] * sc.astype(np.float32)
    v = dl[..., :, None] * code.reshape(code.shape[:-1] + (16, 16)).astype(np.float32)
    return v.reshape(b.shape[:-2] + (-1,))


# ---- random valid blocks -----------------------------------------------------------------------------------------


def _random_q4_k(rng, b, rms, jitter):
    rows, nb = b.shape[:2]
    sc = rng.integers(4, 9, size=(rows, nb, 8), dtype=np.uint8)  # 6-bit scales kept small so that
    mn = np.round(sc * 7.5).astype(np.uint8)  # minimum = 7.5 * scale (< 64) centres q in 0..15
    _put_k4_scales(b, sc, mn)
    d = np.float32(rms / (6.0 * 4.61)) * jitter  # q has std 4.61, sc averages 6
    put_f16(b, 0, d)
    put_f16(b, 2, d)


def _put_k4_scales(b, sc, mn):
    s = b[..., 4:16]
    s[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    s[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)


def _put_d_dmin(ratio: float):
    def put(b, c):
        put_f16(b, 0, c)
        put_f16(b, 2, np.float32(ratio) * c)
    return put


def _random_q5_k(rng, b, rms, jitter):
    sc = rng.integers(2, 5, size=b.shape[:2] + (8,), dtype=np.uint8)
    _put_k4_scales(b, sc, np.round(sc * 15.5).astype(np.uint8))  # centres q in 0..31 (minimum < 64)
    fit_scale(UNITS[T.Q5_K], b, rms, jitter, _put_d_dmin(1.0), False, rng)


def _random_q2_k(rng, b, rms, jitter):
    sc = rng.integers(4, 16, size=b.shape[:2] + (16,), dtype=np.uint8)
    b[..., 0:16] = sc | (sc << 4)  # m = sc with dmin = 1.5 d: minimum 1.5 d sc centres q in 0..3

    def put(b, c):
        put_f16(b, 80, c)
        put_f16(b, 82, np.float32(1.5) * c)
    fit_scale(UNITS[T.Q2_K], b, rms, jitter, put, False, rng)


def _random_q3_k(rng, b, rms, jitter):
    mag = rng.integers(8, 17, size=b.shape[:2] + (16,))
    sc = (32 + np.where(rng.integers(0, 2, size=mag.shape) == 1, -mag, mag - 1)).astype(np.uint8)  # 6-bit sc - 32
    _put_q3k_scales(b, sc)
    fit_scale(UNITS[T.Q3_K], b, rms, jitter, lambda b, c: put_f16(b, 108, c), False, rng)


def _put_q3k_scales(b, sc):
    """Q3_K's sixteen 6-bit scales (stored + 32) into its 12 scale bytes."""
    s = b[..., 96:108]
    s[..., 0:8] = (sc[..., 0:8] & 0x0F) | ((sc[..., 8:16] & 0x0F) << 4)
    hi = (sc >> 4).reshape(b.shape[:2] + (4, 4))  # scale k's top 2 bits: bits 2 (k // 4) of byte k % 4
    s[..., 8:12] = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)


def _random_q6_k(rng, b, rms, jitter):
    mag = rng.integers(8, 33, size=b.shape[:2] + (16,))
    b[..., 192:208] = np.where(rng.integers(0, 2, size=mag.shape) == 1, -mag, mag).astype(np.int8).view(np.uint8)
    fit_scale(UNITS[T.Q6_K], b, rms, jitter, lambda b, c: put_f16(b, 208, c), False, rng)


UNITS: dict[T, Unit] = {
    T.Q2_K: Unit(Format(T.Q2_K, 256, 84, True), q2_k, _random_q2_k),
    T.Q3_K: Unit(Format(T.Q3_K, 256, 110, True), q3_k, _random_q3_k, lambda b: _per16_float(_q3k_parts, b)),
    T.Q4_K: Unit(Format(T.Q4_K, 256, 144, True), q4_k, _random_q4_k),
    T.Q5_K: Unit(Format(T.Q5_K, 256, 176, True), q5_k, _random_q5_k),
    T.Q6_K: Unit(Format(T.Q6_K, 256, 210, True), q6_k, _random_q6_k, lambda b: _per16_float(_q6k_parts, b)),
}
