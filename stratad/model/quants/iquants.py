"""ggml's i-quants: IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M (ggml-common.h layouts;
the grids and the IQ4 value table are the format's, taken from the gguf package's copies).

Canonical integer views (docs/quant-types.md): q = the signed grid / table value, scale = the sub-block's float
scale exactly as ggml forms it, except:
- IQ2_XS / IQ2_S: 4-bit scales per 16 values: db = d (0.5 + ls) / 4, so scale = d / 8 and q = (2 ls + 1) * g
  (int16, |q| <= 31 * 43);
- IQ1_S: dl (g + delta), delta = +-1/8: scale = dl / 8, q = 8 g +- 1 (in -9..9);
- IQ1_M: scales per 16 values, delta per 8: scale = d / 8, q = (2 s + 1) (8 g +- 1) (int16, |q| <= 135).
Every product is exact in float32 and no factor is ever zero, so the view's values equal ggml's bit for bit.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from .common import SUB, Format, IntBlocks, Unit, bits, f16, fit_scale, nibbles, per16, put_f16, subs, u16, u32

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


@lru_cache(maxsize=None)
def grid(qtype: T) -> np.ndarray:
    """A type's grid (entries x values) as int8, from the gguf package's copy of the format's table."""
    cls = gq._type_traits[qtype]
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape).astype(np.int8))


@lru_cache(maxsize=1)
def ksigns() -> np.ndarray:
    """ggml's ksigns_iq2xs: 7 sign bits plus an eighth that makes the count of negatives even."""
    i = np.arange(128, dtype=np.uint8)
    parity = np.unpackbits(i[:, None], axis=1).sum(axis=1) & 1
    return (i | (parity.astype(np.uint8) << 7)).astype(np.uint8)


def _signs8(idx: np.ndarray) -> np.ndarray:
    """+-1 (int8) for each value of 8-value groups from 7-bit sign indices (..., k) -> (..., k * 8)."""
    s = (ksigns()[idx][..., None] >> np.arange(8, dtype=np.uint8)) & 1
    return (1 - 2 * s.astype(np.int8)).reshape(idx.shape[:-1] + (-1,))


def _bitsigns(b: np.ndarray) -> np.ndarray:
    """+-1 (int8) from sign bits, bit v % 8 of byte v // 8."""
    s = (b[..., None] >> np.arange(8, dtype=np.uint8)) & 1
    return (1 - 2 * s.astype(np.int8)).reshape(b.shape[:-1] + (-1,))


def _flat(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-group rows (..., nblocks, groups, k) flattened to (..., nblocks, groups * k)."""
    return x.reshape(b.shape[:-1] + (-1,))


def _per_sub(x: np.ndarray, lead: tuple) -> np.ndarray:
    return x.astype(np.float32).reshape(lead + (-1,))


def iq4_nl(b):
    lead = b.shape[:-2]
    return IntBlocks(subs(IQ4_VALUES[nibbles(b[..., 2:18], 16)], lead), _per_sub(f16(b, 0), lead))


def iq4_xs(b):
    lead = b.shape[:-2]
    lo = nibbles(b[..., 4:8], 1)
    hi = (u16(b[..., 2:4])[..., :1] >> np.arange(0, 16, 2, dtype=np.uint16)).astype(np.uint8) & 3
    ls = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    scale = f16(b, 0)[..., None] * ls.astype(np.float32)
    return IntBlocks(subs(IQ4_VALUES[nibbles(b[..., 8:136], 16)], lead), _per_sub(scale, lead))


def iq3_xxs(b):
    lead = b.shape[:-2]
    w = u32(b[..., 66:98])  # per sub-block: 4 x 7 sign bits, then the 4-bit scale
    db = f16(b, 0)[..., None] * (np.float32(0.5) + (w >> 28).astype(np.float32)) * np.float32(0.5)
    sidx = ((w[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F).astype(np.uint8)
    mag = _flat(grid(T.IQ3_XXS)[b[..., 2:66]], b)
    return IntBlocks(subs(mag * _signs8(_flat(sidx, b)), lead), _per_sub(db, lead))


def iq3_s(b):
    lead = b.shape[:-2]
    qh = bits(b[..., 66:74], 1, 1)  # index bit 8 of entry k: bit k % 8 of byte k // 8
    idx = b[..., 2:66].astype(np.uint16) | (qh.astype(np.uint16) << 8)
    q = _flat(grid(T.IQ3_S)[idx], b) * _bitsigns(b[..., 74:106])
    scale = f16(b, 0)[..., None] * (1 + 2 * nibbles(b[..., 106:110], 1)).astype(np.float32)
    return IntBlocks(subs(q, lead), _per_sub(scale, lead))


def iq2_xxs(b):
    lead = b.shape[:-2]
    w = u32(b[..., 2:66]).reshape(b.shape[:-1] + (8, 2))  # per sub-block: 4 grid indices, then signs + scale
    db = f16(b, 0)[..., None] * (np.float32(0.5) + (w[..., 1] >> 28).astype(np.float32)) * np.float32(0.25)
    sidx = ((w[..., 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F).astype(np.uint8)
    idx = np.ascontiguousarray(w[..., 0]).view(np.uint8)
    mag = _flat(grid(T.IQ2_XXS)[idx], b)
    return IntBlocks(subs(mag * _signs8(_flat(sidx, b)), lead), _per_sub(db, lead))


def _iq2_per16(b, g: np.ndarray, signs: np.ndarray, scales: np.ndarray) -> IntBlocks:
    """IQ2_XS / IQ2_S: q = (2 ls + 1) * signed grid value, scale = d / 8."""
    lead = b.shape[:-2]
    ls = nibbles(scales, 1).astype(np.int16)
    q = per16(2 * ls + 1, lead) * subs((_flat(g, b) * signs).astype(np.int16), lead)
    d8 = f16(b, 0) * np.float32(0.125)
    return IntBlocks(q, _per_sub(np.repeat(d8[..., None], 8, -1), lead))


def iq2_xs(b):
    qs = u16(b[..., 2:66])
    g = grid(T.IQ2_XS)[qs & 511]
    return _iq2_per16(b, g, _signs8((qs >> 9).astype(np.uint8)), b[..., 66:74])


def iq2_s(b):
    qh = bits(b[..., 66:74], 2, 1)  # index bits 8-9 of entry k: bits 2 (k % 4) of byte k // 4
    idx = b[..., 2:34].astype(np.uint16) | (qh.astype(np.uint16) << 8)
    return _iq2_per16(b, grid(T.IQ2_S)[idx], _bitsigns(b[..., 34:66]), b[..., 74:82])


def _delta(neg: np.ndarray) -> np.ndarray:
    return np.where(neg, np.int8(-1), np.int8(1))


def iq1_s(b):
    lead = b.shape[:-2]
    qh = u16(b[..., 34:50])  # per sub-block: 4 x 3 index bits, 3-bit scale, delta sign
    idx = b[..., 2:34].astype(np.uint16) | ((((qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7) << 8)
                                             .reshape(qh.shape[:-1] + (-1,)))
    g8 = _flat(grid(T.IQ1_S)[idx], b).reshape(qh.shape + (SUB,)) * np.int8(8)
    q = g8 + _delta((qh & 0x8000) != 0)[..., None]
    dl = f16(b, 0)[..., None] * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
    return IntBlocks(subs(q, lead), _per_sub(dl * np.float32(0.125), lead))



def _iq1m_d(b: np.ndarray) -> np.ndarray:
    """IQ1_M's f16 d, stored in the top 4 bits of its four 16-bit scale words."""
    s = u16(b[..., 48:56])
    h = (s[..., 0] >> 12) | ((s[..., 1] >> 8) & 0x00F0) | ((s[..., 2] >> 4) & 0x0F00) | (s[..., 3] & 0xF000)
    return np.ascontiguousarray(h.astype(np.uint16)).view(np.float16).astype(np.float32)


def iq1_m(b):
    lead = b.shape[:-2]
    qh = nibbles(b[..., 32:48], 1)  # one nibble per 8-value group: 3 index bits, delta sign
    idx = b[..., 0:32].astype(np.uint16) | ((qh & 7).astype(np.uint16) << 8)
    g8 = grid(T.IQ1_M)[idx].astype(np.int16) * 8 + _delta((qh & 8) != 0)[..., None]
    sc = (u16(b[..., 48:56])[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7
    sc = (2 * sc.reshape(sc.shape[:-2] + (-1,)) + 1).astype(np.int16)
    q = per16(sc, lead) * subs(_flat(g8, b), lead)
    d8 = _iq1m_d(b) * np.float32(0.125)
    return IntBlocks(q, _per_sub(np.repeat(d8[..., None], 8, -1), lead))


# ---- random valid blocks: random indices, signs and sub-block scales; the float scale fitted -----------------------


def _fit_d(qtype: T, off: int):
    def randomize(rng, b, rms, jitter):
        fit_scale(UNITS[qtype], b, rms, jitter, lambda b, c: put_f16(b, off, c), True, rng)
    return randomize


def _random_iq3_s(rng, b, rms, jitter):
    rows, nb = b.shape[:2]
    nib = rng.integers(5, 10, size=(rows, nb, 8), dtype=np.uint8)  # sub-block scale 1 + 2 * nib
    b[..., 106:110] = nib[..., 0::2] | (nib[..., 1::2] << 4)
    put_f16(b, 0, np.float32(rms / (15.0 * np.sqrt(57.67))) * jitter)  # grid mean square is 57.67


def _put_iq1m_d(b, c):
    h = np.asarray(c, np.float32).astype(np.float16).view(np.uint16).astype(np.uint16)
    s = u16(b[..., 48:56]).copy()
    for k in range(4):
        s[..., k] = (s[..., k] & 0x0FFF) | (((h >> (4 * k)) & 0xF) << 12)
    b[..., 48:56] = s.view(np.uint8).reshape(b.shape[:-1] + (8,))


def _random_iq1_m(rng, b, rms, jitter):
    fit_scale(UNITS[T.IQ1_M], b, rms, jitter, _put_iq1m_d, True, rng)


UNITS: dict[T, Unit] = {
    T.IQ4_NL: Unit(Format(T.IQ4_NL, 32, 18, True), iq4_nl, _fit_d(T.IQ4_NL, 0)),
    T.IQ4_XS: Unit(Format(T.IQ4_XS, 256, 136, True), iq4_xs, _fit_d(T.IQ4_XS, 0)),
    T.IQ3_XXS: Unit(Format(T.IQ3_XXS, 256, 98, True), iq3_xxs, _fit_d(T.IQ3_XXS, 0)),
    T.IQ3_S: Unit(Format(T.IQ3_S, 256, 110, True), iq3_s, _random_iq3_s),
    T.IQ2_XXS: Unit(Format(T.IQ2_XXS, 256, 66, True), iq2_xxs, _fit_d(T.IQ2_XXS, 0)),
    T.IQ2_XS: Unit(Format(T.IQ2_XS, 256, 74, True), iq2_xs, _fit_d(T.IQ2_XS, 0)),
    T.IQ2_S: Unit(Format(T.IQ2_S, 256, 82, True), iq2_s, _fit_d(T.IQ2_S, 0)),
    T.IQ1_S: Unit(Format(T.IQ1_S, 256, 50, True), iq1_s, _fit_d(T.IQ1_S, 0)),
    T.IQ1_M: Unit(Format(T.IQ1_M, 256, 56, True), iq1_m, _random_iq1_m),
}
