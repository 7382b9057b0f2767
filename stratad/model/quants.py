"""Tensor encodings of GGUF files: our own block decoders, the canonical integer view, random valid blocks.

Every supported type splits a row into sub-blocks of 32 values, each an integer vector times one float scale
(minus one float minimum for Q4_K). `decode_int` exposes exactly that view; it is what the canonical expert
dot product (stratad.engine.canonical) and the GPU kernels consume. `dequantize` gives float32 values and
matches `gguf.quants.dequantize` bit for bit (tested).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType as T

SUB = 32  # values per canonical sub-block


@dataclass(frozen=True)
class Format:
    qtype: T
    block_values: int
    block_bytes: int
    quantised: bool  # False: a plain float type

    def row_bytes(self, n: int) -> int:
        if n % self.block_values:
            raise ValueError(f"{self.qtype.name} rows must be multiples of {self.block_values} values, got {n}")
        return n // self.block_values * self.block_bytes


FORMATS: dict[T, Format] = {
    T.F32: Format(T.F32, 1, 4, False),
    T.F16: Format(T.F16, 1, 2, False),
    T.BF16: Format(T.BF16, 1, 2, False),
    T.Q8_0: Format(T.Q8_0, 32, 34, True),
    T.Q4_K: Format(T.Q4_K, 256, 144, True),
    T.IQ3_S: Format(T.IQ3_S, 256, 110, True),
}
EXPERT_TYPES = (T.IQ3_S, T.Q4_K, T.Q8_0)
DENSE_TYPES = (T.Q8_0, T.F16, T.BF16, T.F32)


def fmt(qtype: T) -> Format:
    try:
        return FORMATS[T(qtype)]
    except (KeyError, ValueError):
        name = T(qtype).name if qtype in T._value2member_map_ else str(qtype)
        raise ValueError(f"unsupported tensor type {name}") from None


def parse_type(name: str) -> T:
    try:
        t = T[name.upper()]
    except KeyError:
        raise ValueError(f"unknown tensor type {name!r}; supported: {', '.join(f.name for f in FORMATS)}") from None
    fmt(t)
    return t


@lru_cache(maxsize=1)
def iq3s_grid() -> np.ndarray:
    """The 512 x 4 IQ3_S magnitude grid, from the gguf package's copy of the format's table."""
    from gguf.quants import IQ3_S

    IQ3_S.init_grid()
    return np.ascontiguousarray(IQ3_S.grid.reshape(512, 4).astype(np.int8))


@dataclass
class IntBlocks:
    """Rows as integer sub-blocks: value = scale * q - minimum (minimum only for Q4_K)."""

    q: np.ndarray  # int8 (..., nsub, 32)
    scale: np.ndarray  # float32 (..., nsub)
    minimum: np.ndarray | None  # float32 (..., nsub) or None


def _blocks(raw: np.ndarray, f: Format) -> np.ndarray:
    raw = np.asarray(raw).view(np.uint8)
    return raw.reshape(raw.shape[:-1] + (raw.shape[-1] // f.block_bytes, f.block_bytes))


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _q4k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # 12 bytes hold eight 6-bit scales and eight 6-bit minimums
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_int(qtype: T, raw: np.ndarray) -> IntBlocks:
    """Integer sub-block view of quantised rows (raw: uint8 (..., row_bytes))."""
    f = fmt(qtype)
    b = _blocks(raw, f)
    lead = b.shape[:-2]
    if f.qtype == T.Q8_0:
        q = b[..., 2:].view(np.int8)
        return IntBlocks(q.reshape(lead + (-1, SUB)), _f16(b[..., 0:2]).reshape(lead + (-1,)), None)
    if f.qtype == T.Q4_K:
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _q4k_scale_min(b[..., 4:16])
        qs = b[..., 16:].reshape(b.shape[:-1] + (4, 1, 32)) >> np.array([0, 4], np.uint8).reshape(2, 1)
        q = (qs & 0x0F).astype(np.int8).reshape(lead + (-1, SUB))
        scale = (d[..., None] * sc.astype(np.float32)).reshape(lead + (-1,))
        minimum = (dmin[..., None] * mn.astype(np.float32)).reshape(lead + (-1,))
        return IntBlocks(q, scale, minimum)
    if f.qtype == T.IQ3_S:
        d = _f16(b[..., 0:2])
        qs, qh, signs, sc = b[..., 2:66], b[..., 66:74], b[..., 74:106], b[..., 106:110]
        hi = (qh[..., :, None] >> np.arange(8, dtype=np.uint8)) & 1
        idx = qs.astype(np.uint16) | (hi.reshape(qs.shape).astype(np.uint16) << 8)
        mag = iq3s_grid()[idx].reshape(b.shape[:-1] + (8, SUB))
        neg = ((signs[..., :, None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(b.shape[:-1] + (8, SUB))
        q = np.where(neg == 1, -mag, mag).astype(np.int8).reshape(lead + (-1, SUB))
        nib = ((sc[..., :, None] >> np.array([0, 4], np.uint8)) & 0x0F).reshape(b.shape[:-1] + (8,))
        scale = (d[..., None] * (1 + 2 * nib).astype(np.float32)).reshape(lead + (-1,))
        return IntBlocks(q, scale, None)
    raise ValueError(f"{f.qtype.name} is a float type; it has no integer blocks")


def dequantize(qtype: T, raw: np.ndarray) -> np.ndarray:
    """float32 values of rows stored as `qtype` (raw: the reader's array, uint8 (..., row_bytes) or float)."""
    f = fmt(qtype)
    if not f.quantised:
        u8 = np.ascontiguousarray(raw).view(np.uint8)
        if f.qtype == T.F32:
            return u8.view(np.float32).copy()
        if f.qtype == T.F16:
            return u8.view(np.float16).astype(np.float32)
        return (u8.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    ib = decode_int(qtype, raw)
    v = ib.scale[..., None] * ib.q.astype(np.float32)
    if ib.minimum is not None:
        v = v - ib.minimum[..., None]
    return v.reshape(v.shape[:-2] + (-1,))


# ---- random valid blocks, for the model generator ------------------------------------------------------------


def _put_f16(b: np.ndarray, off: int, v: np.ndarray) -> None:
    b[..., off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(v.shape + (2,))


def random_rows(qtype: T, rng: np.random.Generator, rows: int, n: int, rms: float) -> np.ndarray:
    """`rows` rows of `n` values as valid `qtype` data whose values have roughly the given RMS.

    Quantised types are written directly as blocks (random integers and scales), never quantised from floats,
    so that the a3b shape is produced at disk speed. Returns uint8 (rows, row_bytes) or the float array.
    """
    f = fmt(qtype)
    if not f.quantised:
        v = (rng.standard_normal((rows, n), dtype=np.float32) * np.float32(rms))
        if f.qtype == T.F32:
            return v
        if f.qtype == T.F16:
            return v.astype(np.float16)
        return (v.view(np.uint32) >> 16).astype(np.uint16)
    nb = n // f.block_values
    f.row_bytes(n)
    b = np.frombuffer(rng.bytes(rows * nb * f.block_bytes), np.uint8).reshape(rows, nb, f.block_bytes).copy()
    jitter = rng.uniform(0.8, 1.2, size=(rows, nb)).astype(np.float32)
    if f.qtype == T.Q8_0:
        q = b[..., 2:].view(np.int8)
        q[q == -128] = -127  # the symmetric range llama.cpp's quantiser produces
        _put_f16(b, 0, np.float32(rms / 73.3) * jitter)  # RMS of uniform int8 is ~73.3
    elif f.qtype == T.Q4_K:
        sc = rng.integers(4, 9, size=(rows, nb, 8), dtype=np.uint8)  # 6-bit scales kept small so that
        mn = np.round(sc * 7.5).astype(np.uint8)  # minimum = 7.5 * scale (< 64) centres q in 0..15
        s = b[..., 4:16]
        s[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
        s[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
        s[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
        d = np.float32(rms / (6.0 * 4.61)) * jitter  # q has std 4.61, sc averages 6
        _put_f16(b, 0, d)
        _put_f16(b, 2, d)
    elif f.qtype == T.IQ3_S:
        nib = rng.integers(5, 10, size=(rows, nb, 8), dtype=np.uint8)  # sub-block scale 1 + 2 * nib
        b[..., 106:110] = nib[..., 0::2] | (nib[..., 1::2] << 4)
        _put_f16(b, 0, np.float32(rms / (15.0 * np.sqrt(57.67))) * jitter)  # grid mean square is 57.67
    return b.reshape(rows, nb * f.block_bytes)
