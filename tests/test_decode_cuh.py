"""lane/kernels/decode.cuh, the GPU kernels' weight decoding, compiled for the host with a C++ compiler and compared
bit for bit with stratad.model.quants on every type: the canonical integer view (decode_int: q, scale, minimum,
mweight) and the float decode (dequantize), on generator rows and on random bytes (NaN / inf / subnormal /
negative f16 scales included). The GPU kernels run the same source; only the arithmetic helpers differ (explicit
round-to-nearest PTX there, IEEE float with contraction off here)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import host_cxx
from lane.kernels import decode_tables
from stratad.model import quants

HEADER = decode_tables.HEADER
QUANTISED = [t for t, f in quants.FORMATS.items() if f.quantised]
ALL = list(quants.FORMATS)
IGNORE_NAN_WARNINGS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                                 "ignore:overflow encountered:RuntimeWarning")

# extern "C" entry points over decode.cuh: n blocks of a type into the view's arrays, n values into floats
SHIM = r"""
#include "decode.cuh"

template <int QT>
static void int_blocks(const dq_u8* raw, long long nblocks, const dq_u8* tab, short* q, float* scale, float* minimum,
                       signed char* mweight) {
    typedef DqTraits<QT> Tr;
    for (long long b = 0; b < nblocks; ++b)
        for (int j = 0; j < Tr::NSUB; ++j) {
            DqSub s;
            dq_sub<QT>(raw + b * Tr::BB, j, tab, s);
            const long long k = b * Tr::NSUB + j;
            scale[k] = s.scale;
            minimum[k] = s.minimum;
            for (int v = 0; v < 32; ++v) {
                q[32 * k + v] = (short)dq_q(s, v);
                mweight[32 * k + v] = (signed char)s.mw[v >> 4];
            }
        }
}

template <int QT>
static void float_values(const dq_u8* raw, long long n, const dq_u8* tab, float* out) {
    typedef DqSpan<QT> S;
    for (long long s = 0; s < n / S::SPAN; ++s) S::decode(raw, s, tab, out + s * S::SPAN);
}

extern "C" int dq_int(int qt, const dq_u8* raw, long long nblocks, const dq_u8* tab, short* q, float* scale,
                      float* minimum, signed char* mweight) {
    switch (qt) {
#define X(name, code) case code: int_blocks<code>(raw, nblocks, tab, q, scale, minimum, mweight); return 0;
        DQ_QUANT_TYPES(X)
#undef X
    }
    return -1;
}

extern "C" int dq_float(int qt, const dq_u8* raw, long long n, const dq_u8* tab, float* out) {
    switch (qt) {
#define X(name, code) case code: float_values<code>(raw, n, tab, out); return 0;
        DQ_ALL_TYPES(X)
#undef X
    }
    return -1;
}

extern "C" int dq_pack(int qt, const dq_u8* raw, long long rows, long long row_bytes, int nsub, const dq_u8* tab,
                       int ns, int nm, dq_u8* out) {
    const long long bb = 32 + 4 * (ns + nm);
    switch (qt) {
#define X(name, code)                                                                                          \
    case code:                                                                                                 \
        for (long long r = 0; r < rows; ++r)                                                                   \
            for (int s = 0; s < nsub; ++s) rq_pack<code>(raw + r * row_bytes, s, tab, ns, nm, out + (r * nsub + s) * bb); \
        return 0;
        DQ_QUANT_TYPES(X)
#undef X
    }
    return -1;
}

// rq_part of every part of every sub-block of rows: scale, minimum, the codes' two words
extern "C" int dq_parts(int qt, const dq_u8* raw, long long rows, long long row_bytes, int nsub, const dq_u8* tab,
                        float* scale, float* minimum, unsigned* words) {
    switch (qt) {
#define X(name, code)                                                                                          \
    case code:                                                                                                 \
        for (long long r = 0; r < rows; ++r)                                                                   \
            for (int s = 0; s < nsub; ++s)                                                                     \
                for (int p = 0; p < 4; ++p) {                                                                  \
                    typedef DqTraits<code> Tr;                                                                 \
                    const RqPart o = rq_part<code>(raw + r * row_bytes + (s / Tr::NSUB) * Tr::BB, s % Tr::NSUB, p,  \
                                                   tab + RqTab<code>::OFF);                                    \
                    const long long k = (r * nsub + s) * 4 + p;                                                \
                    scale[k] = o.scale;                                                                        \
                    minimum[k] = o.minimum;                                                                    \
                    words[2 * k] = o.qa;                                                                       \
                    words[2 * k + 1] = o.qb;                                                                   \
                }                                                                                              \
        return 0;
        RQ_PART_TYPES(X)
#undef X
    }
    return -1;
}

extern "C" int dq_tab_bytes() { return DQ_TAB_BYTES; }
"""
@pytest.fixture(scope="module")
def lib():
    lib = host_cxx.build("decode", SHIM, [HEADER])
    p = ctypes.c_void_p
    lib.dq_int.argtypes = [ctypes.c_int, p, ctypes.c_longlong, p, p, p, p, p]
    lib.dq_float.argtypes = [ctypes.c_int, p, ctypes.c_longlong, p, p]
    lib.dq_pack.argtypes = [ctypes.c_int, p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, p, ctypes.c_int,
                            ctypes.c_int, p]
    lib.dq_parts.argtypes = [ctypes.c_int, p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, p, p, p, p]
    return lib


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def host_int(lib, qtype: T, raw: np.ndarray) -> quants.IntBlocks:
    """decode.cuh's view of rows raw (uint8 (rows, row_bytes)), shaped as decode_int's."""
    f = quants.fmt(qtype)
    raw = np.ascontiguousarray(raw, np.uint8)
    rows, nblocks = raw.shape[0], raw.size // f.block_bytes
    nsub = nblocks * f.block_values // 32
    q = np.empty((nsub, 32), np.int16)
    scale, minimum = np.empty(nsub, np.float32), np.empty(nsub, np.float32)
    mw = np.empty((nsub, 32), np.int8)
    tab = decode_tables.host_tables()
    assert lib.dq_int(int(qtype), _ptr(raw), nblocks, _ptr(tab), _ptr(q), _ptr(scale), _ptr(minimum), _ptr(mw)) == 0
    return quants.IntBlocks(q.reshape(rows, -1, 32), scale.reshape(rows, -1), minimum.reshape(rows, -1),
                            mw.reshape(rows, -1, 32))


def host_float(lib, qtype: T, raw: np.ndarray) -> np.ndarray:
    f = quants.fmt(qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8)
    n = raw.size // f.block_bytes * f.block_values
    out = np.empty(n, np.float32)
    assert lib.dq_float(int(qtype), _ptr(raw), n, _ptr(decode_tables.host_tables()), _ptr(out)) == 0
    return out.reshape(raw.shape[0], -1)


def assert_bits_equal(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    """float32 equal bit for bit, any NaN matching any NaN (payloads are not specified)."""
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, what
    nan_o, nan_r = np.isnan(ours), np.isnan(ref)
    assert np.array_equal(nan_o, nan_r), f"{what}: NaN positions differ at {np.argwhere(nan_o != nan_r)[:5].tolist()}"
    bad = np.flatnonzero(ours[~nan_o].view(np.uint32) != ref[~nan_r].view(np.uint32))
    assert bad.size == 0, f"{what}: {bad.size} values differ, first: ours {ours[~nan_o][bad[0]]!r} " \
                          f"ref {ref[~nan_r][bad[0]]!r}"


def assert_int_view_equal(ours: quants.IntBlocks, ref: quants.IntBlocks, what: str) -> None:
    """A C++ integer view (codes, scales, minimums, minimum weights) equal to quants.decode_int's, bit for bit; a
    type without minimums (or minimum weights) has zeros (ones) there."""
    assert np.array_equal(ours.q, ref.q.astype(np.int16)), f"{what}: q differs"
    assert_bits_equal(ours.scale, ref.scale, f"{what} scale")
    if ref.minimum is None:
        assert not ours.minimum.any(), f"{what}: a minimum where the view has none"
    else:
        assert_bits_equal(ours.minimum, ref.minimum, f"{what} minimum")
    want_mw = np.ones_like(ours.mweight) if ref.mweight is None else ref.mweight
    assert np.array_equal(ours.mweight, want_mw), f"{what}: mweight differs"


def _rows(qtype: T, source: str, seed: int, rows: int = 12, n: int = 768) -> np.ndarray:
    rng = np.random.default_rng([seed, int(qtype)])
    if source == "random_rows":
        return np.ascontiguousarray(quants.random_rows(qtype, rng, rows, n, rms=0.3)).view(np.uint8).reshape(rows, -1)
    nbytes = quants.fmt(qtype).row_bytes(n)
    return np.frombuffer(rng.bytes(rows * nbytes), np.uint8).reshape(rows, nbytes).copy()


def test_tables_fill_the_header_layout(lib):
    blob = decode_tables.host_tables()
    assert blob.size == lib.dq_tab_bytes()
    off = decode_tables.offsets()
    assert np.array_equal(blob[off["IQ3S"]:off["IQ3S"] + 2048].view(np.int8).reshape(512, 4), quants.iq3s_grid())


def _listed(macro: str) -> dict:
    """{type: code} of one of decode.cuh's X-lists (a #define continued over lines)."""
    import re

    body = re.search(rf"#define {macro}\(X\)(.*?)\n(?!\s)", HEADER.read_text(), flags=re.S).group(1)
    return {T[n.upper()]: int(c) for n, c in re.findall(r"X\((\w+), (\d+)\)", body)}


def test_type_lists_are_the_quants_types():
    """decode.cuh's X-lists name every type of stratad.model.quants by its GGML code, nothing else."""
    quant, floats = _listed("DQ_QUANT_TYPES"), _listed("DQ_FLOAT_TYPES")
    assert set(quant) == set(QUANTISED) and set(floats) == set(ALL) - set(QUANTISED)
    assert all(int(t) == c for t, c in {**quant, **floats}.items())


@IGNORE_NAN_WARNINGS
@pytest.mark.parametrize("source", ["random_rows", "random_bytes"])
@pytest.mark.parametrize("qtype", QUANTISED, ids=[t.name for t in QUANTISED])
def test_int_view_equals_decode_int(lib, qtype, source):
    raw = _rows(qtype, source, 1)
    assert_int_view_equal(host_int(lib, qtype, raw), quants.decode_int(qtype, raw), qtype.name)


@IGNORE_NAN_WARNINGS
@pytest.mark.parametrize("source", ["random_rows", "random_bytes"])
@pytest.mark.parametrize("qtype", ALL, ids=[t.name for t in ALL])
def test_float_decode_equals_dequantize(lib, qtype, source):
    raw = _rows(qtype, source, 2)
    assert_bits_equal(host_float(lib, qtype, raw), quants.dequantize(qtype, raw), qtype.name)


@IGNORE_NAN_WARNINGS
@pytest.mark.parametrize("qtype", QUANTISED, ids=[t.name for t in QUANTISED])
def test_special_scales(lib, qtype):
    """Every f16 field of a block set to NaN, +-inf, +-0, the smallest subnormal or 65504 (the other bytes random):
    the scales' edge cases, including those that only the random bytes test would hit by chance."""
    f = quants.fmt(qtype)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 6e-8, 65504.0], np.float16).view(np.uint8).reshape(-1, 2)
    raw = _rows(qtype, "random_bytes", 3, rows=4 * len(specials), n=f.block_values)
    for r in range(raw.shape[0]):
        for at in F16_FIELDS.get(qtype, (0,)):
            raw[r, at:at + 2] = specials[r % len(specials)]
    assert_bits_equal(host_float(lib, qtype, raw), quants.dequantize(qtype, raw), qtype.name)
    ref, ours = quants.decode_int(qtype, raw), host_int(lib, qtype, raw)
    assert_bits_equal(ours.scale, ref.scale, f"{qtype.name} scale")
    if ref.minimum is not None:
        assert_bits_equal(ours.minimum, ref.minimum, f"{qtype.name} minimum")


@IGNORE_NAN_WARNINGS
@pytest.mark.parametrize("source", ["random_rows", "random_bytes"])
@pytest.mark.parametrize("qtype", QUANTISED, ids=[t.name for t in QUANTISED])
def test_packed_rows_hold_the_values(lib, qtype, source):
    """rq_pack (the mat-vec's packed rows, lane/kernels/weights.PackedRows) in the type's own format and in the
    widest one (a stack of types packed alike): scale * code - minimum is dequantize's value as a number (a -0.0 of
    Q3_K / Q6_K reads as +0.0; NaN where it is NaN)."""
    from lane.kernels.matvec import rq_values_ref
    from lane.kernels.weights import rq_block_bytes, rq_format

    raw = _rows(qtype, source, 4)
    ref = quants.dequantize(qtype, raw)
    nsub = ref.shape[1] // 32
    for fmt in {rq_format(qtype), (2, 2)}:
        out = np.empty((raw.shape[0], nsub * rq_block_bytes(fmt)), np.uint8)
        assert lib.dq_pack(int(qtype), _ptr(raw), raw.shape[0], raw.shape[1], nsub,
                           _ptr(decode_tables.host_tables()), fmt[0], fmt[1], _ptr(out)) == 0
        got = rq_values_ref(out, fmt)
        assert np.array_equal(got, ref, equal_nan=True), \
            f"{qtype.name} {fmt}: {np.sum(~((got == ref) | (np.isnan(got) & np.isnan(ref))))} values differ"


PART_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.IQ3_S]


def test_part_types_are_the_file_row_types():
    """decode.cuh's RQ_PART_TYPES are the types the mat-vec reads as the file holds them (weights.FILE_BLK)."""
    from lane.kernels.weights import FILE_BLK

    listed = _listed("RQ_PART_TYPES")
    assert set(listed) == set(PART_TYPES) == set(FILE_BLK) - {T.Q8_0}
    assert all(int(t) == c for t, c in listed.items())


@IGNORE_NAN_WARNINGS
@pytest.mark.parametrize("source", ["random_rows", "random_bytes", "special_scales"])
@pytest.mark.parametrize("qtype", PART_TYPES, ids=[t.name for t in PART_TYPES])
def test_parts_read_from_the_file_are_the_packed_parts(lib, qtype, source):
    """rq_part (what matvec.cuh's FileBlk reads from a staged file block, 8 values a lane) gives rq_pack's numbers in
    the type's own format for every part: the scale of its half and its minimum bit for bit, the 8 codes byte for
    byte, so the file-row mat-vec and the packed one compute the same bits."""
    from lane.kernels.weights import rq_block_bytes, rq_format

    raw = _rows(qtype, "random_bytes" if source == "special_scales" else source, 5, n=2048)
    if source == "special_scales":
        specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 6e-8, 65504.0], np.float16).view(np.uint8)
        bb = quants.fmt(qtype).block_bytes
        blocks = raw.reshape(-1, bb)
        for i in range(blocks.shape[0]):
            for at in F16_FIELDS.get(qtype, (0,)):
                blocks[i, at:at + 2] = specials.reshape(-1, 2)[i % 7]
    rows, nsub = raw.shape[0], 2048 // 32
    tab = decode_tables.host_tables()
    fmt = rq_format(qtype)
    ns, nm = fmt
    packed = np.empty((rows, nsub * rq_block_bytes(fmt)), np.uint8)
    assert lib.dq_pack(int(qtype), _ptr(raw), rows, raw.shape[1], nsub, _ptr(tab), ns, nm, _ptr(packed)) == 0
    n = rows * nsub * 4
    scale, minimum, words = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(2 * n, np.uint32)
    assert lib.dq_parts(int(qtype), _ptr(raw), rows, raw.shape[1], nsub, _ptr(tab), _ptr(scale), _ptr(minimum),
                        _ptr(words)) == 0
    blocks = packed.reshape(rows * nsub, -1)
    f = blocks[:, :4 * (ns + nm)].copy().view(np.float32)
    half = np.arange(4) // 2 if ns == 2 else np.zeros(4, np.int64)
    assert_bits_equal(scale.reshape(-1, 4), f[:, :ns][:, half], f"{qtype.name} scale")
    want_min = f[:, ns:ns + 1][:, [0, 0, 0, 0]] if nm else np.zeros((rows * nsub, 4), np.float32)
    assert_bits_equal(minimum.reshape(-1, 4), want_min, f"{qtype.name} minimum")
    codes = blocks[:, 4 * (ns + nm):].copy().view(np.uint32)  # 8 words a block: part p's are 2p, 2p + 1
    assert np.array_equal(words.reshape(-1, 8), codes), f"{qtype.name}: codes differ"


# byte offsets of each block's f16 fields (d, and dmin / m where there is one); IQ1_M spreads d over nibbles
F16_FIELDS = {T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q2_K: (80, 82), T.Q3_K: (108,),
              T.Q6_K: (208,), T.IQ1_M: ()}
