"""Tensor encodings of GGUF files: one unit per type (block layout, float decode, canonical integer view, random
valid blocks), in the family modules floats / legacy / kquants / iquants; this module is their registry.

Every type is viewed as sub-blocks of 32 values, value = scale * q - minimum * mweight with integer q
(docs/quant-types.md defines each type's view; the float types' is a power-of-two scale and 13-bit q). `decode_int` exposes that view; it is what the canonical expert
dot product (stratad.engine.canonical), the CPU pool and the GPU kernels consume. `dequantize` gives float32
values equal bit for bit to `gguf.quants.dequantize` (tested for every type).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from . import floats, iquants, kquants, legacy, mx
from .common import SUB, Format, IntBlocks, Unit

__all__ = ["SUB", "Format", "IntBlocks", "Unit", "FORMATS", "UNITS", "EXPERT_TYPES", "DENSE_TYPES", "fmt", "unit",
           "parse_type", "decode_int", "dequantize", "random_rows", "iq3s_grid", "supported_names"]

UNITS: dict[T, Unit] = {**floats.UNITS, **legacy.UNITS, **kquants.UNITS, **iquants.UNITS, **mx.UNITS}
FORMATS: dict[T, Format] = {t: u.fmt for t, u in UNITS.items()}
# every type has the canonical integer view experts need (the float types' is floats.float_view); dense tensors
# use only the float decode
EXPERT_TYPES = tuple(FORMATS)
DENSE_TYPES = tuple(FORMATS)


def supported_names(types=None) -> str:
    return ", ".join(t.name for t in (types or FORMATS))


def unit(qtype: T) -> Unit:
    try:
        return UNITS[T(qtype)]
    except (KeyError, ValueError):
        name = T(qtype).name if qtype in T._value2member_map_ else str(qtype)
        raise ValueError(f"unsupported tensor type {name}; supported: {supported_names()}") from None


def fmt(qtype: T) -> Format:
    return unit(qtype).fmt


def parse_type(name: str) -> T:
    try:
        t = T[name.upper()]
    except KeyError:
        raise ValueError(f"unknown tensor type {name!r}; supported: {supported_names()}") from None
    fmt(t)
    return t


def iq3s_grid() -> np.ndarray:
    """The 512 x 4 IQ3_S magnitude grid (int8)."""
    return iquants.grid(T.IQ3_S)


def _blocks(raw: np.ndarray, f: Format) -> np.ndarray:
    raw = np.asarray(raw).view(np.uint8)
    return raw.reshape(raw.shape[:-1] + (raw.shape[-1] // f.block_bytes, f.block_bytes))


def decode_int(qtype: T, raw: np.ndarray) -> IntBlocks:
    """Integer sub-block view of quantised rows (raw: uint8 (..., row_bytes))."""
    u = unit(qtype)
    return u.int_view(_blocks(raw, u.fmt))


def dequantize(qtype: T, raw: np.ndarray) -> np.ndarray:
    """float32 values of rows stored as `qtype` (raw: the reader's array, uint8 (..., row_bytes) or float)."""
    u = unit(qtype)
    if not u.fmt.quantised:
        return u.dequant(raw)
    b = _blocks(raw, u.fmt)
    if u.dequant is not None:
        return u.dequant(b)
    return u.int_view(b).values()


def random_rows(qtype: T, rng: np.random.Generator, rows: int, n: int, rms: float) -> np.ndarray:
    """`rows` rows of `n` values as valid `qtype` data whose values have roughly the given RMS.

    Quantised types are written directly as blocks (random codes and sub-block scales, the float scale fitted per
    block), never quantised from floats, so that the a3b shape is produced at disk speed. Returns uint8
    (rows, row_bytes) or the float array.
    """
    u = unit(qtype)
    f = u.fmt
    if not f.quantised:
        return u.randomize(rng, rows, n, rms)
    f.row_bytes(n)
    nb = n // f.block_values
    b = np.frombuffer(rng.bytes(rows * nb * f.block_bytes), np.uint8).reshape(rows, nb, f.block_bytes).copy()
    jitter = rng.uniform(0.8, 1.2, size=(rows, nb)).astype(np.float32)
    u.randomize(rng, b, rms, jitter)
    return b.reshape(rows, nb * f.block_bytes)
