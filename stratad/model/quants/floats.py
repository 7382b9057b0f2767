"""The plain float types F32, F16, BF16: dense tensors only (experts need an integer view)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import Format, Unit


def _u8(raw):
    return np.ascontiguousarray(raw).view(np.uint8)


def _f32(raw):
    return _u8(raw).view(np.float32).copy()


def _f16(raw):
    return _u8(raw).view(np.float16).astype(np.float32)


def _bf16(raw):
    return (_u8(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _gauss(rng, rows, n, rms):
    return rng.standard_normal((rows, n), dtype=np.float32) * np.float32(rms)


UNITS: dict[T, Unit] = {
    T.F32: Unit(Format(T.F32, 1, 4, False), None, _gauss, _f32),
    T.F16: Unit(Format(T.F16, 1, 2, False), None, lambda *a: _gauss(*a).astype(np.float16), _f16),
    T.BF16: Unit(Format(T.BF16, 1, 2, False), None,
                 lambda *a: (_gauss(*a).view(np.uint32) >> 16).astype(np.uint16), _bf16),
}
