"""The plain float types F32, F16, BF16: dense tensors as they are; experts through an integer view.

An expert's dot product is defined on integer sub-blocks (stratad.engine.canonical), so a float expert gets one:
per 32 values, a power-of-two scale 2^k and 13-bit integers q = rint(w / 2^k) with |q| <= 2^12 (the bound that keeps
a sub-block's dot with int8 activations exact in float32). k is the smallest exponent that fits the sub-block's
largest magnitude, so each value is within 2^-12 of that magnitude of the file's (docs/quant-types.md): an F16
sub-block whose values span at most two binades is exact.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import SUB, Format, IntBlocks, Unit

Q_BITS = 12  # |q| <= 2^12


def _u8(raw):
    return np.ascontiguousarray(raw).view(np.uint8)


def _f32(raw):
    return _u8(raw).view(np.float32).copy()


def _f16(raw):
    return _u8(raw).view(np.float16).astype(np.float32)


def _bf16(raw):
    return (_u8(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def pow2(k: np.ndarray) -> np.ndarray:
    """float32 2^k for integer k in [-126, 127] (built from the exponent bits: exact)."""
    return ((np.asarray(k, np.int32) + 127) << 23).view(np.float32)


def float_view(w: np.ndarray) -> IntBlocks:
    """float32 (..., n) -> IntBlocks (..., n / 32, 32): per sub-block, amax = the largest finite |w| (non-finite
    values read as 0), e its exponent (amax = f 2^e, 1/2 <= f < 1; e = 0 for amax = 0), k = max(e - 12, -126),
    q = rint(w * 2^-k) (one float32 multiply, half to even), scale = 2^k."""
    w = np.asarray(w, np.float32)
    w = w.reshape(w.shape[:-1] + (-1, SUB))
    w = np.where(np.isfinite(w), w, np.float32(0))
    _, e = np.frexp(np.max(np.abs(w), axis=-1))
    k = np.maximum(e.astype(np.int32) - Q_BITS, -126)
    q = np.rint(w * pow2(-k)[..., None]).astype(np.int16)
    return IntBlocks(q, pow2(k))


def _view(decode):
    """The int_view of a float type: its blocks are single values (..., n, bytes)."""
    return lambda b: float_view(decode(b).reshape(b.shape[:-2] + (-1,)))


def _gauss(rng, rows, n, rms):
    return rng.standard_normal((rows, n), dtype=np.float32) * np.float32(rms)


UNITS: dict[T, Unit] = {
    T.F32: Unit(Format(T.F32, 1, 4, False), _view(_f32), _gauss, _f32),
    T.F16: Unit(Format(T.F16, 1, 2, False), _view(_f16), lambda *a: _gauss(*a).astype(np.float16), _f16),
    T.BF16: Unit(Format(T.BF16, 1, 2, False), _view(_bf16),
                 lambda *a: (_gauss(*a).view(np.uint32) >> 16).astype(np.uint16), _bf16),
}
