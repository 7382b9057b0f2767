"""ggml's 32-value block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (layouts: ggml-common.h block_q4_0 ... block_q8_0).

Each block is one canonical sub-block: scale = d; Q4_1 / Q5_1 add m, which the view carries as minimum = -m
(value = d * q - (-m) = d * q + m, the same IEEE result)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .common import Format, IntBlocks, Unit, f16, fit_scale, nibbles, put_f16, subs, u32


def _q4(b: np.ndarray) -> np.ndarray:
    return nibbles(b, 16)


def _q5(b: np.ndarray, qh_off: int, qs_off: int) -> np.ndarray:
    hi = (u32(b[..., qh_off:qh_off + 4])[..., :1] >> np.arange(32, dtype=np.uint32)) & 1
    return _q4(b[..., qs_off:qs_off + 16]) | (hi.astype(np.uint8) << 4)


def _view(q: np.ndarray, d: np.ndarray, m: np.ndarray | None, lead: tuple) -> IntBlocks:
    return IntBlocks(subs(q, lead), d.reshape(lead + (-1,)), None if m is None else (-m).reshape(lead + (-1,)))


def q4_0(b):
    return _view(_q4(b[..., 2:]).astype(np.int8) - np.int8(8), f16(b, 0), None, b.shape[:-2])


def q4_1(b):
    return _view(_q4(b[..., 4:]).astype(np.int8), f16(b, 0), f16(b, 2), b.shape[:-2])


def q5_0(b):
    return _view(_q5(b, 2, 6).astype(np.int8) - np.int8(16), f16(b, 0), None, b.shape[:-2])


def q5_1(b):
    return _view(_q5(b, 4, 8).astype(np.int8), f16(b, 0), f16(b, 2), b.shape[:-2])


def q8_0(b):
    return _view(b[..., 2:].view(np.int8), f16(b, 0), None, b.shape[:-2])


# ---- random valid blocks -----------------------------------------------------------------------------------------


def _put_d(b, c):
    put_f16(b, 0, c)


def _put_dm(centre: float):
    """d = c and m = -centre * c: the block's values d * q + m are centred on q = centre."""
    def put(b, c):
        put_f16(b, 0, c)
        put_f16(b, 2, np.float32(-centre) * c)
    return put


def _random_symmetric(name):
    def randomize(rng, b, rms, jitter):
        fit_scale(UNITS[name], b, rms, jitter, _put_d, True, rng)
    return randomize


def _random_min(name, centre):
    def randomize(rng, b, rms, jitter):
        fit_scale(UNITS[name], b, rms, jitter, _put_dm(centre), False, rng)
    return randomize


def _random_q8_0(rng, b, rms, jitter):
    q = b[..., 2:].view(np.int8)
    q[q == -128] = -127  # the symmetric range llama.cpp's quantiser produces
    put_f16(b, 0, np.float32(rms / 73.3) * jitter)  # RMS of uniform int8 is ~73.3


UNITS: dict[T, Unit] = {
    T.Q4_0: Unit(Format(T.Q4_0, 32, 18, True), q4_0, _random_symmetric(T.Q4_0)),
    T.Q4_1: Unit(Format(T.Q4_1, 32, 20, True), q4_1, _random_min(T.Q4_1, 7.5)),
    T.Q5_0: Unit(Format(T.Q5_0, 32, 22, True), q5_0, _random_symmetric(T.Q5_0)),
    T.Q5_1: Unit(Format(T.Q5_1, 32, 24, True), q5_1, _random_min(T.Q5_1, 15.5)),
    T.Q8_0: Unit(Format(T.Q8_0, 32, 34, True), q8_0, _random_q8_0),
}
