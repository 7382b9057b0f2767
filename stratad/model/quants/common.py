"""What every tensor type's unit is made of: its Format, the canonical integer view (IntBlocks), the Unit record
and the small byte helpers the per-family modules share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


@dataclass
class IntBlocks:
    """Rows as integer sub-blocks of 32 values: value = scale * q - minimum * mweight (docs/quant-types.md).

    q: int8, or int16 for the types whose 16-value scales are folded into q (|q| <= 4096 always, so a sub-block's
    integer dot with int8 activations stays below 2^24); mweight: int8 per value, None meaning all ones (the
    minimum then is per sub-block, as Q4_K's); minimum None: no minimum."""

    q: np.ndarray  # int8 / int16 (..., nsub, 32)
    scale: np.ndarray  # float32 (..., nsub)
    minimum: np.ndarray | None = None  # float32 (..., nsub)
    mweight: np.ndarray | None = None  # int8 (..., nsub, 32)

    def values(self) -> np.ndarray:
        """float32 (..., nsub * 32): scale * q [- minimum * mweight], each op rounded on its own."""
        v = self.scale[..., None] * self.q.astype(np.float32)
        if self.minimum is not None:
            m = self.minimum[..., None]
            v = v - (m if self.mweight is None else m * self.mweight.astype(np.float32))
        return v.reshape(v.shape[:-2] + (-1,))


@dataclass(frozen=True)
class Unit:
    """One tensor type: its block layout, its canonical integer view, its float decode and random valid blocks.

    int_view(b): blocks uint8 (..., nblocks, block_bytes) -> IntBlocks (..., nblocks * block_values / 32, 32).
    dequant(b): float32 (..., nblocks * block_values) equal bit for bit to gguf.quants.dequantize; None: the int
      view's values() are (the products are exact, in the same order as gguf's).
    randomize(rng, b, rms, jitter): turns random bytes b (rows, nblocks, block_bytes) into valid blocks whose values
      have RMS ~ rms * jitter (rows, nblocks) per block and mean ~0."""

    fmt: Format
    int_view: Callable[[np.ndarray], IntBlocks]
    randomize: Callable | None
    dequant: Callable[[np.ndarray], np.ndarray] | None = None


# ---- byte helpers -----------------------------------------------------------------------------------------------


def f16(b: np.ndarray, off: int) -> np.ndarray:
    """The little-endian f16 at byte off of each block, as float32 (..., )."""
    return np.ascontiguousarray(b[..., off:off + 2]).view(np.float16)[..., 0].astype(np.float32)


def put_f16(b: np.ndarray, off: int, v: np.ndarray) -> None:
    b[..., off:off + 2] = np.asarray(v, np.float32).astype(np.float16).view(np.uint8).reshape(v.shape + (2,))


def u16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.uint16)


def u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.uint32)


def nibbles(b: np.ndarray, lo_first_span: int) -> np.ndarray:
    """4-bit values of bytes b (..., k): in groups of `lo_first_span` bytes, the low nibbles of the group then
    its high nibbles (ggml's layout for 4-bit quants) -> uint8 (..., 2 k)."""
    g = b.reshape(b.shape[:-1] + (-1, 1, lo_first_span)) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (g & 0x0F).reshape(b.shape[:-1] + (-1,))


def bits(b: np.ndarray, width: int, span: int) -> np.ndarray:
    """`width`-bit fields of bytes b (..., k): in groups of `span` bytes, field 0 of every byte of the group, then
    field 1, ... (ggml's layout for 2-bit, 1-bit and packed high bits) -> uint8 (..., k * 8 / width)."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)
    g = b.reshape(b.shape[:-1] + (-1, 1, span)) >> shifts.reshape(-1, 1)
    return (g & ((1 << width) - 1)).reshape(b.shape[:-1] + (-1,))


def subs(x: np.ndarray, lead: tuple) -> np.ndarray:
    """Flat per-block values (..., nblocks, n) as canonical sub-blocks (lead..., nsub, 32)."""
    return x.reshape(lead + (-1, SUB))


def per16(x: np.ndarray, lead: tuple) -> np.ndarray:
    """Per-16-value factors (..., nblocks, n / 16) spread to every value (lead..., nsub, 32)."""
    return np.repeat(x, 16, axis=-1).reshape(lead + (-1, SUB))


def fit_scale(unit: Unit, b: np.ndarray, rms: float, jitter: np.ndarray, put, signed: bool,
              rng: np.random.Generator) -> None:
    """Set each block's float scale(s) (put(b, c): c float32 (rows, nblocks)) so that the block's values have RMS
    rms * jitter: measured with c = 1, then scaled. signed: a random sign per block (quantisers whose scale carries
    the sign, e.g. Q4_0's d = max / -8), which also centres types whose integer range is lopsided."""
    put(b, np.ones(b.shape[:2], np.float32))
    v = unit.int_view(b).values().reshape(b.shape[:2] + (-1,)).astype(np.float64)
    r = np.sqrt(np.mean(v * v, axis=-1))
    c = np.float32(rms) * jitter / np.where(r > 0, r, 1.0).astype(np.float32)
    if signed:
        c = np.where(rng.integers(0, 2, size=c.shape) == 1, -c, c)
    put(b, c.astype(np.float32))
