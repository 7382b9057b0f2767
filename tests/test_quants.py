"""Our block decoders (stratad.model.quants) against gguf.quants.dequantize, the reference for every format."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from stratad.model import quants
from stratad.model.quants import iquants

ALL_TYPES = list(quants.FORMATS)
QUANTISED = [t for t in ALL_TYPES if quants.FORMATS[t].quantised]
# random bytes hold NaN / inf scales: both implementations warn about the NaNs they (rightly) produce
IGNORE_NAN_WARNINGS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                                 "ignore:overflow encountered:RuntimeWarning")
# (rows, values per row): several blocks per row, and 3-D (expert-like) inputs are covered below
SHAPES = [(1, 256), (7, 512), (16, 768)]


def _ids(ts):
    return [t.name for t in ts]


def as_bytes(a: np.ndarray) -> np.ndarray:
    """Rows as the reader hands them over: uint8 (..., row_bytes)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape[:-1] + (-1,))


def assert_bits_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    """float32 arrays equal bit for bit, except that any NaN matches any NaN (payloads are not specified)."""
    assert ours.dtype == np.float32 and ref.dtype == np.float32
    assert ours.shape == ref.shape
    nan_o, nan_r = np.isnan(ours), np.isnan(ref)
    assert np.array_equal(nan_o, nan_r), f"NaN positions differ at {np.argwhere(nan_o != nan_r)[:5].tolist()}"
    ok = ~nan_o
    bits_o, bits_r = ours.view(np.uint32)[ok], ref.view(np.uint32)[ok]
    bad = np.flatnonzero(bits_o != bits_r)
    assert bad.size == 0, (f"{bad.size} values differ, first: ours {ours[ok][bad[0]]!r} "
                           f"ref {ref[ok][bad[0]]!r}")


def gguf_dequantize(qtype: T, raw: np.ndarray) -> np.ndarray:
    out = gq.dequantize(np.ascontiguousarray(raw), qtype)
    return np.ascontiguousarray(out, dtype=np.float32)


def random_bytes(rng: np.random.Generator, qtype: T, rows: int, n: int) -> np.ndarray:
    nbytes = quants.fmt(qtype).row_bytes(n)
    return np.frombuffer(rng.bytes(rows * nbytes), np.uint8).reshape(rows, nbytes).copy()


# ---- formats ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_format_sizes_match_gguf(qtype):
    f = quants.fmt(qtype)
    assert (f.block_values, f.block_bytes) == GGML_QUANT_SIZES[qtype]
    for n in (256, 512, 2048):
        assert f.row_bytes(n) == gq.quant_shape_to_byte_shape((n,), qtype)[0]


# every type llama.cpp's quantiser writes for a qwen3moe file (the list, and MXFP4: its MXFP4_MOE file type's
# experts)
WRITTEN_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                 T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS, T.MXFP4]


def test_supported_type_sets():
    assert set(quants.FORMATS) == set(WRITTEN_TYPES)
    assert set(quants.DENSE_TYPES) == set(WRITTEN_TYPES)
    assert set(quants.EXPERT_TYPES) == set(WRITTEN_TYPES)  # the float types through floats.float_view


# ---- random_rows output ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
@pytest.mark.parametrize("rows,n", SHAPES)
def test_random_rows_dequantize_matches_gguf(qtype, rows, n):
    rng = np.random.default_rng([1, int(qtype), rows, n])
    data = quants.random_rows(qtype, rng, rows, n, rms=0.05)
    raw = as_bytes(data)
    assert raw.shape == (rows, quants.fmt(qtype).row_bytes(n))
    ours = quants.dequantize(qtype, raw)
    assert ours.shape == (rows, n)
    assert_bits_equal(ours, gguf_dequantize(qtype, raw))
    # the array random_rows returns (floats for the float types) decodes the same as its bytes
    assert_bits_equal(quants.dequantize(qtype, data), ours)
    assert np.all(np.isfinite(ours))


@pytest.mark.parametrize("qtype", QUANTISED, ids=_ids(QUANTISED))
def test_dequantize_3d_expert_tensor(qtype):
    """Expert tensors are (n_expert, rows, row_bytes): leading dimensions are kept."""
    rng = np.random.default_rng(3)
    raw = quants.random_rows(qtype, rng, 4 * 8, 512, rms=0.1).reshape(4, 8, -1)
    ours = quants.dequantize(qtype, raw)
    assert ours.shape == (4, 8, 512)
    assert_bits_equal(ours, gguf_dequantize(qtype, raw.reshape(32, -1)).reshape(4, 8, 512))
    ib = quants.decode_int(qtype, raw)
    assert ib.q.shape == (4, 8, 16, 32) and ib.scale.shape == (4, 8, 16)


# ---- fully random bytes ----------------------------------------------------------------------------------------


@IGNORE_NAN_WARNINGS
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_random_bytes_dequantize_matches_gguf(qtype):
    """Any bit pattern, scales included: f16 scales that are NaN, inf, subnormal or negative (MXFP4's power-of-two
    scales hold no NaN: there the largest exponents overflow to inf, and the two smallest are subnormal)."""
    rng = np.random.default_rng([2, int(qtype)])
    raw = random_bytes(rng, qtype, 64, 1024)
    ours = quants.dequantize(qtype, raw)
    ref = gguf_dequantize(qtype, raw)
    assert_bits_equal(ours, ref)
    if qtype == T.MXFP4:
        assert np.isinf(ref).any() and (np.abs(ref[ref != 0]) < np.finfo(np.float32).tiny).any()
    else:
        assert np.isnan(ref).any(), "the NaN cases were not exercised"


@IGNORE_NAN_WARNINGS
@pytest.mark.parametrize("qtype", QUANTISED, ids=_ids(QUANTISED))
def test_special_f16_scales(qtype):
    """Blocks whose f16 scale(s) are exactly NaN, +inf, -inf, 0, -0 and the smallest subnormal."""
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 6e-8, 65504.0], np.float16).view(np.uint8).reshape(-1, 2)
    f = quants.fmt(qtype)
    rng = np.random.default_rng([4, int(qtype)])
    raw = random_bytes(rng, qtype, len(specials) * 2, f.block_values)
    d_at, other_at = F16_FIELDS.get(qtype, (0, None))
    for i, s in enumerate(specials):
        for r, fields in ((2 * i, (d_at,)), (2 * i + 1, (d_at, other_at))):
            for at in fields:
                if at is not None:
                    raw[r, at:at + 2] = s
    if qtype == T.IQ1_M:  # its d is spread over the top nibbles of the four scale words
        raw = raw.reshape(-1, 1, f.block_bytes)
        iquants._put_iq1m_d(raw, np.repeat(specials.view(np.float16).astype(np.float32), 2)[:, None])
        raw = raw.reshape(-1, f.block_bytes)
    assert_bits_equal(quants.dequantize(qtype, raw), gguf_dequantize(qtype, raw))


# byte offsets of (d, the second f16: dmin or m) where they are not (0, none)
F16_FIELDS = {T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q2_K: (80, 82), T.Q3_K: (108, None),
              T.Q6_K: (208, None), T.IQ1_M: (None, None)}


# ---- the integer view ------------------------------------------------------------------------------------------


# the canonical views' shapes: q's integer type, and which types carry a minimum (per sub-block, or weighted)
WIDE_Q = {T.Q3_K, T.Q6_K, T.IQ2_XS, T.IQ2_S, T.IQ1_M}  # 16-value scales folded into q: int16
WITH_MINIMUM = {T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K, T.Q2_K}
# (d * sc) * code in ggml against d * (sc * code) in the view: equal values, but a zero code under a negative scale
# is -0.0 in ggml and +0.0 in the view (docs/quant-types.md); the float decode follows ggml's order
ZERO_SIGN_ONLY = {T.Q3_K, T.Q6_K}


@IGNORE_NAN_WARNINGS
@pytest.mark.parametrize("qtype", QUANTISED, ids=_ids(QUANTISED))
@pytest.mark.parametrize("source", ["random_rows", "random_bytes"])
def test_decode_int_reconstructs_gguf_dequantize(qtype, source):
    rng = np.random.default_rng([5, int(qtype), source == "random_rows"])
    rows, n = 24, 768
    raw = (as_bytes(quants.random_rows(qtype, rng, rows, n, rms=0.3)) if source == "random_rows"
           else random_bytes(rng, qtype, rows, n))
    ib = quants.decode_int(qtype, raw)
    nsub = n // quants.SUB
    assert ib.q.dtype == (np.int16 if qtype in WIDE_Q else np.int8) and ib.q.shape == (rows, nsub, quants.SUB)
    assert np.abs(ib.q.astype(np.int32)).max() <= 4096  # the canonical dot's exactness bound (canonical.py)
    assert ib.scale.dtype == np.float32 and ib.scale.shape == (rows, nsub)
    if qtype in WITH_MINIMUM:
        assert ib.minimum is not None and ib.minimum.dtype == np.float32 and ib.minimum.shape == (rows, nsub)
    else:
        assert ib.minimum is None
    if qtype == T.Q2_K:
        assert ib.mweight.dtype == np.int8 and ib.mweight.shape == ib.q.shape
        assert ib.mweight.min() >= 0 and ib.mweight.max() <= 15
    else:
        assert ib.mweight is None
    if qtype == T.Q4_K:
        assert ib.q.min() >= 0 and ib.q.max() <= 15
    if qtype == T.IQ3_S:
        mag = np.abs(ib.q.astype(np.int32))
        assert np.all(mag % 2 == 1) and mag.max() <= 15  # grid values are 1, 3, ..., 15
    if qtype == T.Q8_0 and source == "random_rows":
        assert ib.q.min() >= -127  # the symmetric range llama.cpp's quantiser produces
    ref = gguf_dequantize(qtype, raw)
    if qtype in ZERO_SIGN_ONLY:
        v = ib.values()
        assert np.array_equal(v, ref, equal_nan=True)
    else:
        assert_bits_equal(ib.values(), ref)


def test_iq3s_grid_is_the_format_table():
    g = quants.iq3s_grid()
    assert g.shape == (512, 4) and g.dtype == np.int8
    assert set(np.unique(g).tolist()) <= {1, 3, 5, 7, 9, 11, 13, 15}
    assert g[0].tolist() == [1, 1, 1, 1]  # iq3s_grid[0] = 0x01010101 in ggml-common.h


def _scalar_float_view(values) -> tuple[list[int], float]:
    """One sub-block of float weights as docs/quant-types.md defines the float types' view, in Python floats."""
    import math

    v = [x if math.isfinite(x) else 0.0 for x in values]
    e = math.frexp(max(abs(x) for x in v))[1]
    k = max(e - 12, -126)
    return [round(x / 2.0 ** k) for x in v], 2.0 ** k  # round: half to even, as rint


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=["F32", "F16", "BF16"])
def test_float_types_integer_view(qtype):
    """Float experts' view: 13-bit q and a power-of-two scale per 32 values; non-finite weights read as 0."""
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((6, 32)) * 10.0 ** rng.uniform(-30, 4, (6, 1))).astype(np.float32)
    w[1, 3], w[1, 4], w[2] = np.inf, np.nan, 0  # a broken weight, an all-zero sub-block
    w[3] = np.float32(2.0 ** -130) * np.arange(32)  # subnormal weights: k stops at -126
    w[4, :2] = (4095.5, -4096.5)  # large weights: k > 0
    w[5, 0], w[5, 1:] = 1.0, 0.25 + (2 * np.arange(31) + 1) * 2.0 ** -12  # k = -11: q ties (F16, F32), half to even
    raw = {T.F32: w, T.F16: w.astype(np.float16), T.BF16: (w.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(6, -1)
    f = quants.dequantize(qtype, raw)
    ib = quants.decode_int(qtype, raw)
    assert ib.q.dtype == np.int16 and ib.minimum is None and int(np.abs(ib.q).max()) <= 4096
    for r in range(6):
        q, scale = _scalar_float_view([float(x) for x in f[r]])
        assert list(ib.q[r, 0]) == q and float(ib.scale[r, 0]) == scale, r
    if qtype == T.F16:  # 11 significant bits: sub-blocks within two binades of their largest value are exact
        x = rng.uniform(0.26, 1, (4, 32)).astype(np.float16)
        assert np.array_equal(quants.decode_int(T.F16, x.view(np.uint8)).values(), x.astype(np.float32))


# ---- random_rows statistics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
@pytest.mark.parametrize("rms", [0.02, 1.0])
def test_random_rows_rms_close_to_target(qtype, rms):
    rng = np.random.default_rng([6, int(qtype)])
    v = quants.dequantize(qtype, quants.random_rows(qtype, rng, 64, 2048, rms)).astype(np.float64)
    measured = np.sqrt(np.mean(v * v))
    assert measured == pytest.approx(rms, rel=0.06), f"{qtype.name}: RMS {measured:.4g}, target {rms}"
    assert abs(v.mean()) < 0.03 * rms  # centred
    # rows are alike, not a few large rows and many empty ones
    row_rms = np.sqrt(np.mean(v * v, axis=1))
    assert row_rms.min() > 0.8 * rms and row_rms.max() < 1.25 * rms


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_random_rows_reproducible(qtype):
    a = quants.random_rows(qtype, np.random.default_rng(7), 4, 512, 1.0)
    b = quants.random_rows(qtype, np.random.default_rng(7), 4, 512, 1.0)
    c = quants.random_rows(qtype, np.random.default_rng(8), 4, 512, 1.0)
    assert np.array_equal(as_bytes(a), as_bytes(b))
    assert not np.array_equal(as_bytes(a), as_bytes(c))


# ---- errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype,n", [(T.Q4_K, 100), (T.Q4_K, 288), (T.IQ3_S, 32), (T.IQ3_S, 384), (T.Q8_0, 48),
                                     (T.Q6_K, 128), (T.IQ4_NL, 48), (T.IQ1_M, 512 + 32)])
def test_row_size_not_whole_blocks(qtype, n):
    f = quants.fmt(qtype)
    with pytest.raises(ValueError, match=rf"{qtype.name} rows must be multiples of {f.block_values} values, got {n}"):
        f.row_bytes(n)
    with pytest.raises(ValueError, match=rf"multiples of {f.block_values}"):
        quants.random_rows(qtype, np.random.default_rng(0), 2, n, 1.0)


def test_row_bytes_values():
    assert quants.fmt(T.Q8_0).row_bytes(256) == 8 * 34
    assert quants.fmt(T.Q4_K).row_bytes(2048) == 8 * 144
    assert quants.fmt(T.IQ3_S).row_bytes(768) == 3 * 110
    assert quants.fmt(T.F32).row_bytes(3) == 12
    assert quants.fmt(T.BF16).row_bytes(5) == 10


@pytest.mark.parametrize("qtype", [T.Q8_1, T.Q8_K, T.TQ1_0, T.TQ2_0])
def test_unsupported_type_named(qtype):
    with pytest.raises(ValueError, match=rf"unsupported tensor type {qtype.name}; supported: F32, F16, BF16, Q4_0"):
        quants.fmt(qtype)
    with pytest.raises(ValueError, match=rf"unsupported tensor type {qtype.name}"):
        quants.parse_type(qtype.name.lower())


def test_parse_type():
    assert quants.parse_type("iq3_s") is T.IQ3_S
    assert quants.parse_type("Q8_0") is T.Q8_0
    with pytest.raises(ValueError, match="unknown tensor type 'Q9_9'"):
        quants.parse_type("Q9_9")


# ---- float encoders (the generator's rows with columns set by value) ---------------------------------------------

# relative RMS error of round-to-nearest encoding of Gaussian rows, measured ~ 0.33 / 0.19 / 0.08 / 0.04 / 0.02 /
# 0.09 / 0.09 / 0.17; bounds with some room
ENCODE_ERROR = {T.Q2_K: 0.36, T.Q3_K: 0.22, T.Q4_K: 0.1, T.Q5_K: 0.05, T.Q6_K: 0.025, T.IQ4_NL: 0.1, T.IQ4_XS: 0.1,
                T.IQ3_S: 0.2}


@pytest.mark.parametrize("qtype", list(ENCODE_ERROR), ids=_ids(ENCODE_ERROR))
def test_encode_approximates_rows(qtype):
    from stratad.model.quants import encode

    rng = np.random.default_rng([8, int(qtype)])
    x = rng.standard_normal((64, 512)).astype(np.float32)
    x[:, 0] = 3.0
    x[5] = 0  # an all-zero row: zero scales, no NaN
    raw = encode.encode(qtype, x)
    assert raw.dtype == np.uint8 and raw.shape == (64, quants.fmt(qtype).row_bytes(512))
    v = gguf_dequantize(qtype, raw)
    assert_bits_equal(quants.dequantize(qtype, raw), v)
    assert not v[5].any()
    err = np.sqrt(np.mean((v - x) ** 2) / np.mean(x * x))
    assert err < ENCODE_ERROR[qtype], f"{qtype.name}: relative RMS error {err:.3f}"
    assert np.median(v[:, 0]) == pytest.approx(3.0, rel=0.3)


def test_pack_inverts_unpack():
    from stratad.model.quants import common, encode

    b = np.frombuffer(np.random.default_rng(1).bytes(4 * 64), np.uint8).reshape(4, 64)
    for span in (1, 16, 32):
        assert np.array_equal(encode.pack_nibbles(common.nibbles(b, span), span), b)
    for width, span in ((1, 1), (1, 32), (2, 32), (2, 1)):
        assert np.array_equal(encode.pack_bits(common.bits(b, width, span), width, span), b)


def test_encode_refuses_types_without_encoder():
    from stratad.model.quants import encode

    with pytest.raises(ValueError, match="no float encoder for IQ2_XS; encodable: F32, F16, BF16, Q4_0"):
        encode.encode(T.IQ2_XS, np.zeros((1, 256), np.float32))
