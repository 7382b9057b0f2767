"""lane/kernels/expert_term.cuh, the GPU expert kernels' generic path (every type without a tuned decoder), compiled
for the host with a C++ compiler and compared bit for bit with stratad.engine.canonical on every expert type:
the decoded sub-blocks against quants.decode_int, and a row's dot (decode, exact integer sums, the canonical
term, the terms summed over 32 virtual lanes in the canonical order) against canonical.qdot. The device runs the
same functions; only the lanes' fold is written twice (shuffles there, the loop below here)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_canonical import activations, weight_rows
from test_decode_cuh import IGNORE_NAN_WARNINGS, _ptr, assert_bits_equal, assert_int_view_equal
import host_cxx

from lane.kernels import decode_tables
from lane.kernels.experts import TABLE_PARTS, table_part
from stratad.engine import canonical
from stratad.model import quants

HEADER = Path(decode_tables.HEADER).parent / "expert_term.cuh"
TYPES = list(quants.EXPERT_TYPES)
F32 = np.float32

SHIM = r"""
#include "expert_term.cuh"

// a sub-block's view as decode_int gives it (q = fold * code, scale, minimum, mweight), from the packed XtW
template <int QT>
static void view(const dq_u8* raw, long long row_bytes, int rows, int nsub, const dq_u8* tab, short* q, float* scale,
                 float* minimum, signed char* mw) {
    for (int r = 0; r < rows; ++r)
        for (int s = 0; s < nsub; ++s) {
            XtW<QT> w;
            xt_decode<QT>(raw + r * row_bytes, s, tab, w);
            const long long k = (long long)r * nsub + s;
            scale[k] = w.scale;
            minimum[k] = w.minimum;
            for (int v = 0; v < 32; ++v) {
                q[32 * k + v] = (short)(w.fold[v >> 4] * xt_code<QT>(w, v));
                mw[32 * k + v] = (signed char)w.mw[v >> 4];
            }
        }
}

// out[t, r] = the canonical dot of row r with token t's quantised input: lane l adds the terms of sub-blocks l,
// l + 32, ... (0.0f past the row, as the kernels' lanes do) to 0.0f, then lanes fold 16, 8, 4, 2, 1
template <int QT>
static void qdot(const dq_u8* raw, long long row_bytes, int rows, int nsub, const dq_u8* tab, const signed char* qa,
                 const float* da, int tokens, float* out) {
    for (int t = 0; t < tokens; ++t)
        for (int r = 0; r < rows; ++r) {
            float lane[32];
            for (int l = 0; l < 32; ++l) {
                float acc = 0.f;
                for (int s = l; s < (nsub + 31) / 32 * 32; s += 32) {
                    float term = 0.f;
                    if (s < nsub) {
                        XtW<QT> w;
                        xt_decode<QT>(raw + r * row_bytes, s, tab, w);
                        XtAct A;
                        __builtin_memcpy(A.a, qa + ((long long)t * nsub + s) * 32, 32);
                        A.d = da[(long long)t * nsub + s];
                        xt_act_sums<QT>(A);
                        term = xt_term<QT>(w, A);
                    }
                    acc = dq_add(acc, term);
                }
                lane[l] = acc;
            }
            for (int o = 16; o; o >>= 1)
                for (int l = 0; l < o; ++l) lane[l] = dq_add(lane[l], lane[l + o]);
            out[(long long)t * rows + r] = lane[0];
        }
}

// each sub-block's words as the tensor-core fragments take them (xt_locate, then xt_word with k known only at run
// time, as a lane's t is) beside xt_decode's, and the fields both set (scale, minimum, folds, minimum weights, delta)
template <int QT>
static void words(const dq_u8* raw, long long row_bytes, int rows, int nsub, const dq_u8* tab, const int* ks,
                  unsigned* by_word, unsigned* by_sub, float* fields) {
    if constexpr (DqTraits<QT>::QUANT)
        for (int r = 0; r < rows; ++r)
            for (int s = 0; s < nsub; ++s) {
                const long long k0 = (long long)r * nsub + s;
                XtW<QT> a, b;
                xt_decode<QT>(raw + r * row_bytes, s, tab, a);
                a.delta &= XtTraits<QT>::IQ1 ? 15u : 0u;
                b.delta = 0u;
                const XtSub c = xt_locate<QT>(raw + r * row_bytes, s, tab, b);
                for (int i = 0; i < 8; ++i) {
                    by_word[8 * k0 + i] = xt_word<QT>(c, ks[i]);
                    by_sub[8 * k0 + ks[i]] = a.q[ks[i]];
                }
                const float fa[7] = {a.scale, a.minimum, (float)a.fold[0], (float)a.fold[1], (float)a.mw[0],
                                     (float)a.mw[1], (float)a.delta};
                const float fb[7] = {b.scale, b.minimum, (float)b.fold[0], (float)b.fold[1], (float)b.mw[0],
                                     (float)b.mw[1], (float)(b.delta & (XtTraits<QT>::IQ1 ? 15u : 0u))};
                for (int i = 0; i < 7; ++i) {
                    fields[14 * k0 + i] = fa[i];
                    fields[14 * k0 + 7 + i] = fb[i];
                }
            }
}

extern "C" int xt_frag_words(int qt, const dq_u8* raw, long long row_bytes, int rows, int nsub, const dq_u8* tab,
                             const int* ks, unsigned* by_word, unsigned* by_sub, float* fields) {
    switch (qt) {
#define X(name, code) case code: words<code>(raw, row_bytes, rows, nsub, tab, ks, by_word, by_sub, fields); return 0;
        DQ_ALL_TYPES(X)
#undef X
    }
    return -1;
}

extern "C" int xt_view(int qt, const dq_u8* raw, long long row_bytes, int rows, int nsub, const dq_u8* tab, short* q,
                       float* scale, float* minimum, signed char* mw) {
    switch (qt) {
#define X(name, code) case code: view<code>(raw, row_bytes, rows, nsub, tab, q, scale, minimum, mw); return 0;
        DQ_ALL_TYPES(X)
#undef X
    }
    return -1;
}

extern "C" int xt_qdot(int qt, const dq_u8* raw, long long row_bytes, int rows, int nsub, const dq_u8* tab,
                       const signed char* qa, const float* da, int tokens, float* out) {
    switch (qt) {
#define X(name, code) case code: qdot<code>(raw, row_bytes, rows, nsub, tab, qa, da, tokens, out); return 0;
        DQ_ALL_TYPES(X)
#undef X
    }
    return -1;
}
"""


@pytest.fixture(scope="module")
def lib():
    lib = host_cxx.build("expert-term", SHIM, [HEADER, decode_tables.HEADER])
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.xt_view.argtypes = [i, p, ctypes.c_longlong, i, i, p, p, p, p, p]
    lib.xt_qdot.argtypes = [i, p, ctypes.c_longlong, i, i, p, p, p, i, p]
    lib.xt_frag_words.argtypes = [i, p, ctypes.c_longlong, i, i, p, p, p, p, p]
    return lib


def _raw(qtype: T, rng, rows: int, n: int, source: str) -> np.ndarray:
    """uint8 (rows, row_bytes): test_canonical's weight rows; for the float types random bytes are any floats
    (NaN, inf and subnormals among them)."""
    if not quants.fmt(qtype).quantised and source == "random_bytes":
        return np.frombuffer(rng.bytes(rows * quants.fmt(qtype).row_bytes(n)), np.uint8).reshape(rows, -1).copy()
    return np.ascontiguousarray(weight_rows(qtype, rng, rows, n, source)).view(np.uint8).reshape(rows, -1)


def host_view(lib, qtype: T, raw: np.ndarray, tab: np.ndarray | None = None) -> quants.IntBlocks:
    """tab: the table blob the decode reads (decode.cuh's, by default)."""
    tab = decode_tables.host_tables() if tab is None else tab
    rows, rb = raw.shape
    nsub = rb // quants.fmt(qtype).block_bytes * quants.fmt(qtype).block_values // 32
    q = np.empty((rows, nsub, 32), np.int16)
    scale, minimum = np.empty((rows, nsub), F32), np.empty((rows, nsub), F32)
    mw = np.empty((rows, nsub, 32), np.int8)
    assert lib.xt_view(int(qtype), _ptr(raw), rb, rows, nsub, _ptr(tab), _ptr(q),
                       _ptr(scale), _ptr(minimum), _ptr(mw)) == 0
    return quants.IntBlocks(q, scale, minimum, mw)


def host_qdot(lib, qtype: T, raw: np.ndarray, qa: np.ndarray, da: np.ndarray) -> np.ndarray:
    rows, rb = raw.shape
    tokens, nsub = da.shape
    qa, da = np.ascontiguousarray(qa, np.int8), np.ascontiguousarray(da, F32)
    out = np.empty((tokens, rows), F32)
    assert lib.xt_qdot(int(qtype), _ptr(raw), rb, rows, nsub, _ptr(decode_tables.host_tables()), _ptr(qa), _ptr(da),
                       tokens, _ptr(out)) == 0
    return out


SOURCES = ["random_rows", "random_bytes"]


@IGNORE_NAN_WARNINGS
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_decoded_sub_blocks_are_decode_int(lib, qtype, source):
    raw = _raw(qtype, np.random.default_rng([5, int(qtype)]), 6, 512, source)
    assert_int_view_equal(host_view(lib, qtype, raw), quants.decode_int(qtype, raw), qtype.name)


QUANTISED = [t for t in TYPES if quants.fmt(t).quantised]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("qtype", QUANTISED, ids=[t.name for t in QUANTISED])
def test_words_one_at_a_time_are_the_sub_blocks(lib, qtype, source):
    """The tensor-core fragments decode only the two words of a sub-block a lane holds (xt_word, the word's index
    known at run time): every word so made, and the head's fields beside it, equal the whole sub-block's decode."""
    raw = _raw(qtype, np.random.default_rng([8, int(qtype)]), 4, 512, source)
    rows, rb = raw.shape
    nsub = rb // quants.fmt(qtype).block_bytes * quants.fmt(qtype).block_values // 32
    ks = np.array([5, 0, 7, 2, 4, 1, 6, 3], np.int32)  # an order the compiler cannot unroll into xt_words's
    by_word, by_sub = (np.zeros((rows * nsub, 8), np.uint32) for _ in range(2))
    fields = np.zeros((rows * nsub, 2, 7), F32)
    assert lib.xt_frag_words(int(qtype), _ptr(raw), rb, rows, nsub, _ptr(decode_tables.host_tables()), _ptr(ks),
                             _ptr(by_word), _ptr(by_sub), _ptr(fields)) == 0
    bad = np.argwhere(by_word[:, np.argsort(ks)] != by_sub)
    assert bad.size == 0, f"{qtype.name}: word {bad[0][1]} of sub-block {bad[0][0]} differs ({len(bad)} words)"
    assert np.array_equal(fields[:, 0].view(np.uint32), fields[:, 1].view(np.uint32)), qtype.name


@pytest.mark.parametrize("qtype", list(TABLE_PARTS), ids=[t.name for t in TABLE_PARTS])
def test_a_table_type_reads_its_own_part_of_the_blob(lib, qtype):
    """A GPU block of a generic table type holds only its part of the blob (experts.table_part): with every other
    byte of the blob poisoned, its decode still gives decode_int's view."""
    start, end = table_part(qtype)
    tab = decode_tables.host_tables()
    poisoned = np.full_like(tab, 0x5A)
    poisoned[start:end] = tab[start:end]
    raw = _raw(qtype, np.random.default_rng([7, int(qtype)]), 6, 512, "random_bytes")
    assert_int_view_equal(host_view(lib, qtype, raw, poisoned), quants.decode_int(qtype, raw), qtype.name)


@pytest.mark.parametrize("n", [256, 1280, 2048], ids=["8sub", "40sub", "64sub"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_row_dot_is_canonical_qdot(lib, qtype, source, n):
    """Rows of 8 sub-blocks (lanes past the row add 0.0f), 40 (a partial second round) and 64, against
    canonical.qdot on decode_int's view; inputs with sub-blocks of very different sizes, a zero one and ties."""
    rng = np.random.default_rng([6, int(qtype), n])
    raw = _raw(qtype, rng, 5, n, source)
    qa, da = canonical.quantize_act(activations(rng, 3, n))
    with np.errstate(invalid="ignore", over="ignore"):
        want = canonical.qdot(quants.decode_int(qtype, raw), qa, da)
    assert_bits_equal(host_qdot(lib, qtype, raw, qa.reshape(3, -1), da), want, f"{qtype.name} {source} n={n}")


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=["F32", "F16", "BF16"])
def test_float_view_edges(lib, qtype):
    """The float view's edge cases in one row each: ties of w * 2^-k at .5, subnormals only (k = -126), a zero
    sub-block (k = -12), non-finite values beside finite ones, the largest finite value of the type."""
    big = {T.F32: np.finfo(F32).max, T.F16: F32(65504.0), T.BF16: F32(3.3895314e38)}[qtype]
    rows = np.zeros((5, 32), F32)
    rows[0, :8] = F32(4096.0) + np.arange(8, dtype=F32) * F32(0.5)  # amax in [4096, 8192): k = 1, w / 2 ties
    rows[0, 8:] = np.linspace(-4100, 4100, 24, dtype=F32)
    rows[1, :4] = [1e-45, -3e-45, 5e-40, -1e-39] if qtype == T.F32 else [6e-8, -1.2e-7, 3e-5, -6e-5]
    rows[3] = np.linspace(-1, 1, 32, dtype=F32)
    rows[3, [2, 5, 9]] = [np.inf, -np.inf, np.nan]
    rows[4, 0], rows[4, 1:] = big, np.linspace(-big / 2, big / 3, 31, dtype=F32)
    if qtype == T.F16:
        raw = rows.astype(np.float16).view(np.uint8)
    elif qtype == T.BF16:
        raw = (rows.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = rows.view(np.uint8)
    raw = np.ascontiguousarray(raw).reshape(5, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = quants.decode_int(qtype, raw)
    ours = host_view(lib, qtype, raw)
    assert np.array_equal(ours.q, ref.q.astype(np.int16))
    assert_bits_equal(ours.scale, ref.scale, f"{qtype.name} scale")
