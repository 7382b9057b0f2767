"""The OCP microscaling type llama.cpp writes for MoE experts: MXFP4 (ggml-common.h block_mxfp4: one E8M0 exponent
byte e, then 16 bytes of 4-bit E2M1 codes, value v < 16 the low nibble of byte v, else the high nibble of v - 16).

Canonical integer view (docs/quant-types.md): q = the code's E2M1 value doubled (MXFP4_VALUES, |q| <= 12), scale =
2^(e - 128) (ggml's e8m0 "half": the doubling undone), a float32 for every e (2^-128 and 2^-127 as subnormals).
scale * q is ggml's d * kvalue, the same single rounding, so the view's values equal gguf.quants' bit for bit."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import Format, IntBlocks, Unit, nibbles, subs

MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """2^(e - 128) as float32 for uint8 exponents e, built from its bits (subnormal below e = 2)."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def mxfp4(b):
    lead = b.shape[:-2]
    return IntBlocks(subs(MXFP4_VALUES[nibbles(b[..., 1:17], 16)], lead), e8m0_half(b[..., 0]).reshape(lead + (-1,)))


def _put_e(rng):
    """c as a power-of-two scale, the exponent byte of each block: 2^k or 2^(k + 1) around c = 2^(k + f), the larger
    with probability (4^f - 1) / 3, so that the blocks' mean square is c's (2^-127 .. 2^126: no overflow)."""
    def put(b, c):
        x = np.log2(np.maximum(np.abs(np.asarray(c, np.float64)), 2.0 ** -127))
        k = np.floor(x)
        up = rng.random(x.shape) < (4.0 ** (x - k) - 1) / 3
        b[..., 0] = np.clip(k + up + 128, 1, 254).astype(np.uint8)
    return put


def _random_mxfp4(rng, b, rms, jitter):
    # random codes: the values' mean square is that of MXFP4_VALUES, so the scale follows in closed form (a fit
    # through the values, as fit_scale does, made the a3b's experts take an hour)
    ms = float(np.mean(MXFP4_VALUES.astype(np.float64) ** 2))
    _put_e(rng)(b, np.float32(rms / np.sqrt(ms)) * jitter)


UNITS: dict[T, Unit] = {
    T.MXFP4: Unit(Format(T.MXFP4, 32, 17, True), mxfp4, _random_mxfp4),
}
