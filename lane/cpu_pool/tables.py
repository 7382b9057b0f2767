"""The pool's constants: the GGML type codes its kernels dispatch on, each decoded type's buffer kind, block
bytes and values as arrays for the njit code (global arrays are compile-time constants there), and the lookup
tables (f16 exponents, the canonical exp's powers of two and constants, the IQ grids and sign tables)."""

import numpy as np
from gguf import GGMLQuantizationType as T

from stratad.model.quants import EXPERT_TYPES, fmt, iq3s_grid
from stratad.model.quants.iquants import IQ4_VALUES, grid, ksigns
from stratad.model.quants.mx import MXFP4_VALUES


F32 = np.float32
LANES = 32

# GGML type codes the kernels dispatch on
IQ3_S, Q4_K, Q6_K, Q8_0 = int(T.IQ3_S), int(T.Q4_K), int(T.Q6_K), int(T.Q8_0)
Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL = int(T.Q4_0), int(T.Q4_1), int(T.Q5_0), int(T.Q5_1), int(T.IQ4_NL)
Q2_K, Q3_K, Q5_K, IQ4_XS, IQ3_XXS = int(T.Q2_K), int(T.Q3_K), int(T.Q5_K), int(T.IQ4_XS), int(T.IQ3_XXS)
IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M = int(T.IQ2_XXS), int(T.IQ2_XS), int(T.IQ2_S), int(T.IQ1_S), int(T.IQ1_M)
MXFP4 = int(T.MXFP4)
F32_T, F16_T, BF16_T = int(T.F32), int(T.F16), int(T.BF16)

# The decoded-block types (_rows_dec) by the buffer their q is decoded into and their minimum term: int8 q, no
# minimum; uint8 q (codes >= 0), a minimum of weight 1; uint8 q with uint8 mweights (Q2_K); int16 q (16-value
# scales folded in), no minimum.
_K_I8, _K_U8_MIN, _K_U8_MW, _K_I16 = 0, 1, 2, 3
_DECODED = {Q4_0: _K_I8, Q5_0: _K_I8, IQ4_NL: _K_I8, IQ4_XS: _K_I8, IQ3_XXS: _K_I8, IQ2_XXS: _K_I8, IQ1_S: _K_I8,
            MXFP4: _K_I8,
            Q4_1: _K_U8_MIN, Q5_1: _K_U8_MIN, Q5_K: _K_U8_MIN, Q2_K: _K_U8_MW,
            Q3_K: _K_I16, Q6_K: _K_I16, IQ2_XS: _K_I16, IQ2_S: _K_I16, IQ1_M: _K_I16,
            F32_T: _K_I16, F16_T: _K_I16, BF16_T: _K_I16}
# the types with kernels reading raw blocks: every expert type
_BLOCK_BYTES = {t: fmt(t).block_bytes for t in (IQ3_S, Q4_K, Q8_0, *_DECODED)}
_SUPPORTED = {int(t) for t in EXPERT_TYPES}
# per type code, for the njit code (global arrays are compile-time constants there): decoded kind, block bytes and
# values
_KIND = np.full(64, -1, np.int64)
_BB = np.zeros(64, np.int64)
_BV = np.zeros(64, np.int64)
for _t, _k in _DECODED.items():
    _KIND[_t], _BB[_t], _BV[_t] = _k, fmt(_t).block_bytes, fmt(_t).block_values


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(f16 exponent scales, exp's 2^n table, IQ3_S grid packed as uint32).

    f16: value = (mantissa | 0x400) * 2^(e - 25) for 1 <= e <= 30, mantissa * 2^-24 for e == 0: products of
    small integers and powers of two, exact in float32, so this equals numpy's float16 -> float32 conversion.
    pow2[n + 126] = 2^n for n in -126..127 (canonical.exp builds the same float from its exponent bits).
    grid[i] = the 4 int8 magnitudes of IQ3_S grid entry i, little endian (value m in byte m).
    """
    f16e = np.ldexp(np.ones(32, np.float64), np.arange(32) - 25).astype(F32)
    f16e[0] = F32(2.0 ** -24)
    pow2 = np.ldexp(np.ones(254, np.float64), np.arange(-126, 128)).astype(F32)
    grid = np.ascontiguousarray(iq3s_grid()).view(np.uint32).reshape(-1).copy()
    return f16e, pow2, grid


F16E, POW2, GRID = _tables()


def _decode_tables() -> tuple[np.ndarray, dict[str, int]]:
    """The decoders' tables as one int8 array, and each one's offset in it: IQ4's kvalues, MXFP4's; 16 ones; 8 eights;
    sign8[8 m + v] = -1 if bit v of byte m is set, else 1; ggml's ksigns (int8: read & 0xFF); the IQ grids
    (entries x values, flat)."""
    bit = (np.arange(256)[:, None] >> np.arange(8)) & 1
    parts = {"iq4": IQ4_VALUES, "mxfp4": MXFP4_VALUES, "ones": np.ones(16, np.int8), "eights": np.full(8, 8, np.int8),
             "sign8": (1 - 2 * bit).astype(np.int8).reshape(-1), "ksigns": ksigns().view(np.int8),
             **{t.name: grid(t).reshape(-1) for t in (T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M)}}
    offsets, at = {}, 0
    for name, x in parts.items():
        offsets[name], at = at, at + x.size
    return np.concatenate(list(parts.values())).astype(np.int8), offsets


TAB, _OFF = _decode_tables()
_T_IQ4, _T_MXFP4, _T_ONES, _T_EIGHTS, _T_SIGN8, _T_KSIGNS = (
    _OFF[k] for k in ("iq4", "mxfp4", "ones", "eights", "sign8", "ksigns"))
_T_IQ3XXS, _T_IQ2XXS, _T_IQ2XS, _T_IQ2S, _T_IQ1S, _T_IQ1M = (_OFF[t.name] for t in (T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS,
                                                                                   T.IQ2_S, T.IQ1_S, T.IQ1_M))
assert _T_IQ3XXS % 4 == 0 and all(o % 8 == 0 for o in (_T_IQ2XXS, _T_IQ2XS, _T_IQ2S, _T_IQ1S, _T_IQ1M)), \
    "the in-register kernels read the grids' entries as aligned words"

# the canonical exp's constants, as float32 (numba must never see a python float in float32 arithmetic)
_LOG2E = F32(1.44269502)
_LN2_HI = F32(0.693145751953125)
_LN2_LO = F32(1.42860677e-06)
_P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7 = (F32(c) for c in (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2,
                                                          1.0, 1.0))
_EXP_LO = F32(-87.0)
_EXP_HI = F32(88.0)
_ONE = F32(1.0)
_ZERO = F32(0.0)
_127 = F32(127.0)
_HALF = F32(0.5)
_QUARTER = F32(0.25)
_EIGHTH = F32(0.125)


