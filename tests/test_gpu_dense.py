"""GPU dense-path kernels (lane/kernels: matvec, gemm, norm, rope_kv, attention, router, sampling, embedding)
against their numpy references.

Run on the device machine: `python3 -m pytest -q -m gpu tests/test_gpu_dense.py`. Without CuPy or a CUDA device
these tests skip. Inputs are fresh random data (never zeros); outputs are poisoned with NaN (or a sentinel) first so
an unwritten element cannot pass; every test synchronises, so a faulting launch raises here.

Tolerances (measured on the H200, docs/perf-notes.md "dense kernels"; the test prints the measured values):
  rms_norm, q/k norm + RoPE, embed, argmax, router ids, sampler tokens: exact.
  matvec: |y - y64| <= 1e-5 * (|W| @ |x|) elementwise (float32 sums in another order).
  router weights: relative 2e-6 (CUDA expf vs numpy's exp).
  attention: normwise 3e-3 against float64 on the f16 cache (q and P rounded to f16 for the tensor cores),
  6e-3 against the float32 reference on unrounded K/V (f16 cache included).
  cuBLAS GEMM (fp16): 3e-3 normwise.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from lane.kernels import attention, device, embedding, gemm, matvec, norm, rope_kv, router, sampling, weights
from stratad.engine import reference
from stratad.model import quants

pytestmark = pytest.mark.gpu

F32 = np.float32
DENSE = [T.Q8_0, T.F16, T.BF16, T.F32]
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module")
def D(cp):
    """Every dense op's module compiled for the device (a compile error fails here, once)."""
    for source in ("matvec.cu", "gemm.cu", "norm.cu", "rope_kv.cu", "attention_decode.cu", "attention_prefill.cu",
                   "router.cu", "sampling.cu", "embedding.cu"):
        device.module(source)


@pytest.fixture(scope="module", autouse=True)
def report_measured():
    yield
    if MEASURED:
        print("\nmeasured errors:")
        for k in sorted(MEASURED):
            print(f"  {k:60s} {MEASURED[k]:.3e}")


def note(key: str, v: float) -> float:
    MEASURED[key] = max(MEASURED.get(key, 0.0), float(v))
    return float(v)


def sync(cp):
    cp.cuda.Device().synchronize()


def nan_like(cp, shape, dtype=np.float32):
    return cp.full(shape, np.nan, dtype)


def rand_weight(rng, qt, rows, cols, rms=None):
    raw = quants.random_rows(qt, rng, rows, cols, rms or 1 / np.sqrt(cols))
    if qt == T.Q8_0:  # include the -128 code the random generator avoids
        b = raw.reshape(rows, -1, 34)
        b[rng.integers(rows), rng.integers(b.shape[1]), 2 + rng.integers(32)] = 0x80
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)


def bound_err(y, W64, x64, r=None):
    """max |y - y64| / (|W| @ |x|) elementwise."""
    y64 = W64 @ x64 + (r.astype(np.float64) if r is not None else 0)
    b = np.abs(W64) @ np.abs(x64) + (np.abs(r) if r is not None else 0) + 1e-30
    return float(np.max(np.abs(y.astype(np.float64) - y64) / b))


def normwise(y, ref):
    ref = ref.astype(np.float64)
    return float(np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref))


# ---- 1. mat-vec ------------------------------------------------------------------------------------------------
# Q8_0 rows of up to 4096 columns stage x in shared memory, 8192 reads it from global memory
SHAPES = [(512, 2048), (4096, 2048), (2048, 4096), (128, 2048), (130, 256), (1000, 512), (256, 8192)]


@pytest.mark.parametrize("qt", DENSE, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matvec(cp, D, qt, shape):
    rng = np.random.default_rng(hash((int(qt), shape)) & 0xffff)
    rows, cols = shape
    raw = rand_weight(rng, qt, rows, cols)
    W = weights.DenseWeight.upload(raw, qt, cols)
    assert W.fast
    W64 = quants.dequantize(qt, raw).astype(np.float64)
    x = rng.standard_normal(cols, dtype=F32) * F32(2)
    r = rng.standard_normal(rows, dtype=F32)
    xd, rd = cp.asarray(x), cp.asarray(r)
    plans = weights.PLANS if shape in ((512, 2048), (130, 256), (4096, 2048)) else [None]
    for plan in plans:
        y = nan_like(cp, rows)
        matvec.matvec(W, xd, y, plan=plan)
        sync(cp)
        got = y.get()
        assert np.isfinite(got).all(), plan
        e = note(f"matvec {qt.name} bound-rel", bound_err(got, W64, x.astype(np.float64)))
        assert e <= 1e-5, (plan, e)
        # residual, out of place and in place
        y = nan_like(cp, rows)
        matvec.matvec(W, xd, y, residual=rd, plan=plan)
        yi = rd.copy()
        matvec.matvec(W, xd, yi, residual=yi, plan=plan)
        sync(cp)
        assert bound_err(y.get(), W64, x.astype(np.float64), r) <= 1e-5
        assert np.array_equal(y.get(), yi.get())
    note(f"matvec {qt.name} normwise vs numpy f32", normwise(got, matvec.matvec_ref(raw, qt, x)))
    if qt == T.Q8_0 and plans is weights.PLANS:
        # one warp a row (KS = 1) sums a row in the same order whatever its rows per warp: the plans that stage x
        # in shared memory (one or two rows a warp, cols <= 4096) give the bits of the one that reads it from
        # global memory (four rows a warp)
        ys = []
        for plan in [p for p in weights.PLANS if p[1] == 1]:
            y = nan_like(cp, rows)
            matvec.matvec(W, xd, y, residual=rd, plan=plan)
            ys.append((plan, y.get()))
        for plan, y in ys[1:]:
            assert np.array_equal(y, ys[0][1]), (plan, ys[0][0])


@pytest.mark.parametrize("qt,cols", [(T.Q8_0, 96), (T.F16, 36), (T.BF16, 20), (T.F32, 10)],
                         ids=lambda v: str(v))
def test_matvec_generic(cp, D, qt, cols):
    rng = np.random.default_rng(cols)
    raw = rand_weight(rng, qt, 77, cols)
    W = weights.DenseWeight.upload(raw, qt, cols)
    assert not W.fast
    x = rng.standard_normal(cols, dtype=F32)
    y = nan_like(cp, 77)
    matvec.matvec(W, cp.asarray(x), y)
    sync(cp)
    assert bound_err(y.get(), quants.dequantize(qt, raw).astype(np.float64), x.astype(np.float64)) <= 1e-5


# ---- 1b. batched -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qt", [T.Q8_0, T.BF16, T.F32], ids=lambda q: q.name)
def test_dense_batched(cp, D, qt):
    rng = np.random.default_rng(7)
    for rows, cols, Tn in [(512, 2048, 70), (256, 256, 1), (200, 512, 7)]:
        raw = rand_weight(rng, qt, rows, cols)
        W = weights.DenseWeight.upload(raw, qt, cols)
        W64 = quants.dequantize(qt, raw).astype(np.float64)
        X = rng.standard_normal((Tn, cols), dtype=F32)
        R = rng.standard_normal((Tn, rows), dtype=F32)
        Y = nan_like(cp, (Tn, rows))
        gemm.dense_batched(W, cp.asarray(X), Y)
        Yr = nan_like(cp, (Tn, rows))
        gemm.dense_batched(W, cp.asarray(X), Yr, residual=cp.asarray(R), cache=True)
        sync(cp)
        got, gotr = Y.get(), Yr.get()
        assert np.isfinite(got).all() and np.isfinite(gotr).all()
        ref = X.astype(np.float64) @ W64.T
        e = note("batched f16 normwise", normwise(got, ref))
        assert e <= 3e-3
        assert normwise(gotr, ref + R) <= 3e-3
        W.drop_cache()


# ---- 2. RMSNorm --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2048, 4096, 256, 128, 64, 16, 384])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "x+4B"])
def test_rms_norm_exact(cp, D, n, offset):
    """Bit for bit numpy's; offset 1: x and w 4 bytes past a 16-byte boundary (the kernel's 4-byte copies)."""
    rng = np.random.default_rng(n)
    assert norm.pairwise_plan(n) is not None
    for rows in (1, 3, 32):
        x = rng.standard_normal((rows, n), dtype=F32) * rng.uniform(0.01, 30, size=(rows, 1)).astype(F32)
        w = rng.uniform(0.5, 1.5, n).astype(F32)
        y = nan_like(cp, (rows, n))
        xd, wd = cp.empty(rows * n + offset, cp.float32), cp.empty(n + offset, cp.float32)
        xd[offset:] = cp.asarray(x.ravel())
        wd[offset:] = cp.asarray(w)
        norm.rms_norm(xd[offset:].reshape(rows, n), wd[offset:], 1e-6, y)
        sync(cp)
        want = reference.rms_norm(x, w, 1e-6)
        got = y.get()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
            f"{np.sum(got != want)} differ, max rel {np.max(np.abs(got - want) / np.abs(want))}"


@pytest.mark.parametrize("n", [2048, 256, 96])
def test_rms_norm_quantised_for_the_experts(cp, D, n):
    """The same launch also quantises each normalised row as canonical.quantize_act does (the experts' input):
    every bit of y, q and d."""
    from stratad.engine import canonical

    rng = np.random.default_rng(n + 7)
    for rows in (1, 5):
        x = rng.standard_normal((rows, n), dtype=F32) * rng.uniform(0.01, 30, size=(rows, 1)).astype(F32)
        x[0, :32] = 0.0  # an all-zero group: scale 0, integers 0
        w = rng.uniform(0.5, 1.5, n).astype(F32)
        y = nan_like(cp, (rows, n))
        q = cp.full((rows, n), 99, cp.int8)
        d = nan_like(cp, (rows, n // 32))
        norm.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, y, quant=(q, d))
        sync(cp)
        want_y = reference.rms_norm(x, w, 1e-6)
        want_q, want_d = canonical.quantize_act(want_y)
        assert np.array_equal(y.get().view(np.uint32), want_y.view(np.uint32)) or norm.pairwise_plan(n) is None
        h = y.get()  # the kernel's y is what it quantised (n = 96 has no numpy-order plan)
        hq, hd = canonical.quantize_act(h)
        np.testing.assert_array_equal(q.get(), hq.reshape(rows, n))
        np.testing.assert_array_equal(d.get().view(np.uint32), hd.reshape(rows, n // 32).view(np.uint32))
        if norm.pairwise_plan(n) is not None:
            np.testing.assert_array_equal(q.get(), want_q.reshape(rows, n))


@pytest.mark.parametrize("qt,rows,cols", [(T.Q8_0, 5120, 2048), (T.Q8_0, 300, 4096), (T.F32, 128, 2048),
                                          (T.BF16, 130, 2304), (T.F16, 64, 1504)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_norm_matvec_is_rms_norm_then_matvec(cp, D, qt, rows, cols):
    """The decode step's RMSNorm folded into the mat-vec: every bit of y (every plan, with and without a
    residual) and of the experts' quantised row equals rms_norm (with quant) followed by matvec."""
    rng = np.random.default_rng(rows + cols)
    raw = rand_weight(rng, qt, rows, cols)
    W = weights.DenseWeight.upload(raw, qt, cols)
    assert matvec.norm_matvec_ok(W)
    x = cp.asarray(rng.standard_normal(cols, dtype=F32) * F32(rng.uniform(0.05, 20)))
    nw = cp.asarray(rng.uniform(0.5, 1.5, cols).astype(F32))
    res = cp.asarray(rng.standard_normal(rows, dtype=F32))
    h = nan_like(cp, (1, cols))
    hq, hd = cp.full((1, cols), 99, cp.int8), nan_like(cp, (1, cols // 32))
    norm.rms_norm(x[None], nw, 1e-6, h, quant=(hq, hd))
    for plan in weights.PLANS:
        for r in (None, res):
            # (no four-row kernel: norm_matvec runs (4, 1) as (2, 1))
            want = matvec.matvec(W, h[0], nan_like(cp, rows), residual=r, plan=(min(plan[0], 2), plan[1]))
            q, d = cp.full((1, cols), 77, cp.int8), nan_like(cp, (1, cols // 32))
            got = matvec.norm_matvec(W, x, nw, 1e-6, nan_like(cp, rows), residual=r, quant=(q, d), plan=plan)
            sync(cp)
            assert np.array_equal(got.get().view(np.uint32), want.get().view(np.uint32)), (plan, r is None)
            assert np.array_equal(q.get(), hq.get()) and np.array_equal(d.get().view(np.uint32), hd.get().view(np.uint32))
    y = nan_like(cp, rows)
    matvec.norm_matvec(W, x, nw, 1e-6, y)  # no quantised row
    sync(cp)
    assert np.array_equal(y.get().view(np.uint32), matvec.matvec(W, h[0]).get().view(np.uint32))


@pytest.mark.parametrize("qt", [T.Q8_0, T.IQ3_S], ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(2048, 4096), (512, 2048), (130, 2048)])  # IQ3_S rows 16-byte aligned
def test_matvec_qx(cp, D, rows, cols, qt):
    """The Q8_0 and IQ3_S mat-vecs on x quantised to 8 bits (qx, the o projection of a decode step): the function
    of matvec_qx_ref summed in float32 within 1e-5 of its float64 value, with a residual out of place and in place
    (same bits), every plan; plans of one warp a row give the same bits."""
    rng = np.random.default_rng(rows * cols)
    raw = rand_weight(rng, qt, rows, cols)
    W = weights.DenseWeight.upload(raw, qt, cols)
    assert W.fast and W.takes_qx
    W64 = quants.dequantize(qt, raw).astype(np.float64)
    x = rng.standard_normal(cols, dtype=F32) * F32(rng.uniform(0.05, 20))
    x[rng.integers(cols)] = 0  # a zero, and a group of zeros (scale 0)
    x[32:64] = 0
    xr = matvec.quantize_row(x)
    q, d = xr[:cols].astype(np.float64), xr[cols:].view(F32).astype(np.float64)
    xq64 = (q.reshape(-1, 32) * d[:, None]).reshape(-1)
    ref = matvec.matvec_qx_ref(raw, qt, x)
    assert bound_err(ref, W64, xq64) <= 1e-6
    res = rng.standard_normal(rows, dtype=F32)
    xd, rd = cp.asarray(xr), cp.asarray(res)
    one_warp = {}
    for plan in weights.PLANS:
        got = matvec.matvec(W, xd, nan_like(cp, rows), plan=plan, qx=True)
        with_r = matvec.matvec(W, xd, nan_like(cp, rows), residual=rd, plan=plan, qx=True)
        inplace = rd.copy()
        matvec.matvec(W, xd, inplace, residual=inplace, plan=plan, qx=True)
        sync(cp)
        e = note("matvec qx bound-rel", bound_err(got.get(), W64, xq64))
        assert e <= 1e-5, (plan, e)
        assert bound_err(with_r.get(), W64, xq64, res) <= 1e-5, plan
        assert np.array_equal(with_r.get().view(np.uint32), inplace.get().view(np.uint32)), plan
        if plan[1] == 1:
            one_warp[plan] = got.get()
    first = next(iter(one_warp.values()))
    assert all(np.array_equal(v.view(np.uint32), first.view(np.uint32)) for v in one_warp.values())
    note("matvec qx normwise vs float x", normwise(first, W64 @ x.astype(np.float64)))
    Wf = weights.DenseWeight.upload(rand_weight(rng, T.F16, 64, cols), T.F16, cols)
    with pytest.raises(ValueError, match="8-bit x takes fast Q8_0 or IQ3_S"):
        matvec.matvec(Wf, xd, qx=True)
    with pytest.raises(TypeError, match="x \\(8-bit\\) must be"):
        matvec.matvec(W, cp.asarray(x), qx=True)


def test_rms_norm_quant_into_an_8_bit_row(cp, D):
    """The final norm's quantised output written into one 8-bit row buffer (the LM head's x on 8 bits: codes, then
    scales) is quantize_row of the norm's output."""
    rng = np.random.default_rng(11)
    n = 2048
    x = cp.asarray(rng.standard_normal((1, n), dtype=F32) * F32(4))
    w = cp.asarray(rng.uniform(0.5, 1.5, n).astype(F32))
    row = cp.full((matvec.q8_row_bytes(n),), 55, cp.int8)
    y = nan_like(cp, (1, n))
    norm.rms_norm(x, w, 1e-6, y, quant=(row[:n].reshape(1, -1), row[n:].view(cp.float32)[None]))
    sync(cp)
    assert np.array_equal(row.get(), matvec.quantize_row(y.get()[0]))


def test_rms_norm_generic(cp, D):
    rng = np.random.default_rng(1)
    n = 200
    assert norm.pairwise_plan(n) is None
    x = rng.standard_normal((5, n), dtype=F32)
    w = rng.uniform(0.5, 1.5, n).astype(F32)
    y = nan_like(cp, (5, n))
    norm.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, y)
    sync(cp)
    want = reference.rms_norm(x, w, 1e-6)
    e = note("rms_norm generic (n=200) max rel", np.max(np.abs(y.get() - want) / np.abs(want)))
    assert e <= 1e-6


# ---- 3. q/k norm + RoPE + KV append ------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [(32, 4, 128), (4, 2, 64)], ids=["a3b", "tiny"])
@pytest.mark.parametrize("Tn,pos0", [(1, 0), (1, 1000), (5, 37)])
def test_qk_norm_rope_kv(cp, D, cfg, Tn, pos0):
    n_head, n_kv, hd = cfg
    rng = np.random.default_rng(pos0 + Tn)
    max_ctx = 2048
    rope = rope_kv.RopeTable(max_ctx, hd, 1e6)
    qkv = rng.standard_normal((Tn, (n_head + 2 * n_kv) * hd), dtype=F32) * F32(3)
    qnw, knw = rng.uniform(0.5, 1.5, hd).astype(F32), rng.uniform(0.5, 1.5, hd).astype(F32)
    K0 = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    V0 = rng.standard_normal((n_kv, hd, max_ctx)).astype(np.float16)  # V^T; the cache holds it in blocks
    Kc, Vc = cp.asarray(K0), cp.asarray(rope_kv.v_blocked(V0))
    q_out = nan_like(cp, (Tn, n_head, hd))
    pos = cp.asarray(np.array([pos0], np.int32))
    rope_kv.qk_norm_rope_kv(cp.asarray(qkv), cp.asarray(qnw), cp.asarray(knw), 1e-6, rope, pos, q_out, Kc, Vc,
                      n_head=n_head, n_kv=n_kv)
    sync(cp)
    q, k, v = rope_kv.qk_norm_rope_kv_ref(qkv, pos0, qnw, knw, 1e-6, 1e6, n_head, n_kv, hd)
    assert np.array_equal(q_out.get().view(np.uint32), q.view(np.uint32))
    K1, V1 = Kc.get(), rope_kv.v_unblocked(Vc.get())
    Kw, Vw = K0.copy(), V0.copy()
    for t in range(Tn):
        Kw[:, pos0 + t] = k[t].astype(np.float16)
        Vw[:, :, pos0 + t] = v[t].astype(np.float16)
    assert np.array_equal(K1.view(np.uint16), Kw.view(np.uint16))
    assert np.array_equal(V1.view(np.uint16), Vw.view(np.uint16))


@pytest.mark.parametrize("cfg", [(32, 4, 128), (4, 2, 64), (16, 1, 128), (8, 8, 64)],
                         ids=["a3b", "tiny", "g16", "mha"])
@pytest.mark.parametrize("pos0", [0, 15, 16, 63, 64, 100, 1000, 5000])
def test_decode_step_attention_is_qk_norm_rope_kv_then_attention(cp, D, cfg, pos0):
    """The decode step's split launch with qk_norm_rope_kv's work (DecodeAttention.step): every bit of the output
    and of both caches equals qk_norm_rope_kv followed by the attention, at split edges and long contexts."""
    n_head, n_kv, hd = cfg
    rng = np.random.default_rng(pos0 * 3 + hd)
    max_ctx = 8192
    rope = rope_kv.RopeTable(max_ctx, hd, 1e6)
    qkv = cp.asarray(rng.standard_normal((1, (n_head + 2 * n_kv) * hd), dtype=F32) * F32(3))
    qnw, knw = (cp.asarray(rng.uniform(0.5, 1.5, hd).astype(F32)) for _ in range(2))
    K0 = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    V0 = rope_kv.v_blocked(rng.standard_normal((n_kv, hd, max_ctx)).astype(np.float16))
    pos = cp.asarray(np.array([pos0], np.int32))
    att = attention.DecodeAttention(n_head, n_kv, hd, max_ctx)
    Ka, Va, Kb, Vb = cp.asarray(K0), cp.asarray(V0), cp.asarray(K0), cp.asarray(V0)
    q = nan_like(cp, (1, n_head, hd))
    want, got = nan_like(cp, (1, n_head * hd)), nan_like(cp, (1, n_head * hd))
    rope_kv.qk_norm_rope_kv(qkv, qnw, knw, 1e-6, rope, pos, q, Ka, Va, n_head=n_head, n_kv=n_kv)
    att(q, Ka, Va, pos, want)
    att.step(qkv, qnw, knw, 1e-6, rope, pos, Kb, Vb, got)
    sync(cp)
    assert np.isfinite(got.get()).all()
    assert np.array_equal(got.get().view(np.uint32), want.get().view(np.uint32))
    assert np.array_equal(Kb.get().view(np.uint16), Ka.get().view(np.uint16))
    assert np.array_equal(Vb.get().view(np.uint16), Va.get().view(np.uint16))
    # both load paths of the step's kernel (the register prefetch, the plain loop) on the same splits (their
    # occupancy may differ): same bits
    for kw in ({"pipelined": True}, {"pipelined": False}):
        other = attention.DecodeAttention(n_head, n_kv, hd, max_ctx, nsplit=att.nsplit(1), **kw)
        Kc, Vc, got2 = cp.asarray(K0), cp.asarray(V0), nan_like(cp, (1, n_head * hd))
        other.step(qkv, qnw, knw, 1e-6, rope, pos, Kc, Vc, got2)
        sync(cp)
        assert np.array_equal(got2.get().view(np.uint32), got.get().view(np.uint32)), kw
        assert np.array_equal(Kc.get().view(np.uint16), Ka.get().view(np.uint16)), kw
        assert np.array_equal(Vc.get().view(np.uint16), Va.get().view(np.uint16)), kw
    # the output also quantised to 8 bits by the combine (out_q, for the o mat-vec on 8-bit x): the float row's bits
    # unchanged, the codes and scales those of quantize_row on it
    n = n_head * hd
    Kc, Vc, got3 = cp.asarray(K0), cp.asarray(V0), nan_like(cp, (1, n))
    out_q = cp.full((matvec.q8_row_bytes(n),), 77, cp.int8)
    att.step(qkv, qnw, knw, 1e-6, rope, pos, Kc, Vc, got3, out_q=out_q)
    sync(cp)
    assert np.array_equal(got3.get().view(np.uint32), got.get().view(np.uint32))
    assert np.array_equal(out_q.get(), matvec.quantize_row(got.get()[0]))


# ---- 4. decode attention ------------------------------------------------------------------------------------------
def _attn_case(cp, D, rng, n_head, n_kv, hd, max_ctx, L, Tn=1, q_scale=1.0, prefill=False, **kw):
    """Random K/V (float32 and their f16 cache), positions >= L filled with NaN; returns (got, ref64_on_f16,
    ref32_on_f32)."""
    pos0 = L - Tn
    Kf = rng.standard_normal((L, n_kv, hd), dtype=F32)
    Vf = rng.standard_normal((L, n_kv, hd), dtype=F32)
    q = rng.standard_normal((Tn, n_head, hd), dtype=F32) * F32(q_scale)
    Kc = cp.full((n_kv, max_ctx, hd), np.nan, cp.float16)
    Vt = np.full((n_kv, hd, max_ctx), np.nan, np.float16)
    Kc[:, :L] = cp.asarray(Kf.transpose(1, 0, 2).astype(np.float16))
    Vt[:, :, :L] = Vf.transpose(1, 2, 0).astype(np.float16)
    Vc = cp.asarray(rope_kv.v_blocked(Vt))
    out = nan_like(cp, (Tn, n_head * hd))
    if prefill:  # blocks of 128 query rows, and of 64 (a card of 99 KB a block): the same bits
        attention.PrefillAttention(n_head, n_kv, hd, max_ctx, block_rows=128)(cp.asarray(q), Kc, Vc, pos0, out)
        out64 = nan_like(cp, (Tn, n_head * hd))
        attention.PrefillAttention(n_head, n_kv, hd, max_ctx, block_rows=64)(cp.asarray(q), Kc, Vc, pos0, out64)
        sync(cp)
        assert np.array_equal(out64.get().view(np.uint32), out.get().view(np.uint32)), "block_rows 64 vs 128"
    else:
        att = attention.DecodeAttention(n_head, n_kv, hd, max_ctx, max_T=Tn, **kw)
        att(cp.asarray(q), Kc, Vc, cp.asarray(np.array([pos0], np.int32)), out, Tn)
    sync(cp)
    got = out.get()
    K16 = Kf.astype(np.float16).astype(np.float64)
    V16 = Vf.astype(np.float16).astype(np.float64)
    ref64 = attention.attention_ref(q.astype(np.float64), K16, V16, pos0)
    ref32 = attention.attention_ref(q, Kf, Vf, pos0)
    return got, ref64, ref32


ATTN_VARIANTS = [{"pipelined": True}, {"pipelined": False}, {"pipelined": False, "combine_cols": 1},
                 {"combine_cols": 32}, {"combine_cols": 1}]
ATTN_IDS = ["pipe", "plain", "plain-cols1", "cols32", "cols1"]


@pytest.mark.parametrize("cfg", [(32, 4, 128), (4, 2, 64), (16, 1, 128), (8, 8, 64)],
                         ids=["a3b", "tiny", "g16", "mha"])
@pytest.mark.parametrize("L", [1, 15, 16, 17, 100, 1000, 5000])
@pytest.mark.parametrize("var", ATTN_VARIANTS[:2], ids=ATTN_IDS[:2])
def test_attention(cp, D, cfg, L, var):
    n_head, n_kv, hd = cfg
    rng = np.random.default_rng(L * 7 + hd)
    for q_scale in (1.0, 4.0):
        got, ref64, ref32 = _attn_case(cp, D, rng, n_head, n_kv, hd, 8192, L, q_scale=q_scale, **var)
        assert np.isfinite(got).all()
        e = note(f"attention vs f64 on f16 cache (q x{q_scale:g})", normwise(got, ref64))
        e2 = note(f"attention vs f32 reference, unrounded K/V (q x{q_scale:g})", normwise(got, ref32))
        assert e <= 3e-3 and e2 <= 6e-3, (e, e2)


def test_attention_out_q_takes_one_token_and_whole_groups(cp, D):
    n_head, n_kv, hd, max_ctx = 8, 2, 64, 256
    K = cp.zeros((n_kv, max_ctx, hd), cp.float16)
    V = cp.zeros(rope_kv.v_cache_shape(n_kv, hd, max_ctx), cp.float16)
    pos = cp.zeros((1,), cp.int32)
    out_q = cp.zeros((matvec.q8_row_bytes(n_head * hd),), cp.int8)
    att = attention.DecodeAttention(n_head, n_kv, hd, max_ctx, max_T=2)
    with pytest.raises(ValueError, match="out_q takes one token"):
        att(cp.zeros((2, n_head, hd), cp.float32), K, V, pos, cp.zeros((2, n_head * hd), cp.float32), 2, out_q=out_q)
    narrow = attention.DecodeAttention(n_head, n_kv, hd, max_ctx, combine_cols=4)
    assert not narrow.quantizes()
    with pytest.raises(ValueError, match="multiple of 8 combine columns"):
        narrow(cp.zeros((1, n_head, hd), cp.float32), K, V, pos, cp.zeros((1, n_head * hd), cp.float32), out_q=out_q)


@pytest.mark.parametrize("kw", [{"nsplit": 1}, {"nsplit": 7, "chunk_min": 16}, {"chunk_min": 1024}],
                         ids=["nsplit1", "nsplit7", "chunk1024"])
@pytest.mark.parametrize("var", ATTN_VARIANTS, ids=ATTN_IDS)
def test_attention_splits(cp, D, kw, var):
    rng = np.random.default_rng(3)
    for L in (3001, 64, 80):
        got, ref64, _ = _attn_case(cp, D, rng, 32, 4, 128, 8192, L, **kw, **var)
        assert np.isfinite(got).all()
        assert normwise(got, ref64) <= 3e-3


@pytest.mark.parametrize("var", ATTN_VARIANTS[:2], ids=ATTN_IDS[:2])
def test_attention_prefill_tokens(cp, D, var):
    rng = np.random.default_rng(4)
    got, ref64, ref32 = _attn_case(cp, D, rng, 32, 4, 128, 4096, 700, Tn=9, **var)
    assert np.isfinite(got).all()
    assert normwise(got, ref64) <= 3e-3


@pytest.mark.parametrize("cfg", [(32, 4, 128), (4, 2, 64), (16, 1, 128), (8, 8, 64)],
                         ids=["a3b", "tiny", "g16", "mha"])
def test_attention_load_paths_have_the_same_bits(cp, D, cfg):
    """The register prefetch computes the same tiles in the same order as the plain loop: every bit equal on the
    same splits, for tile and split edges and several tokens."""
    n_head, n_kv, hd = cfg
    rng = np.random.default_rng(hd + n_head)
    max_ctx = 8192
    K = cp.asarray(rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16))
    V = cp.asarray(rope_kv.v_blocked(rng.standard_normal((n_kv, hd, max_ctx)).astype(np.float16)))
    for L, Tn in ((1, 1), (16, 1), (47, 1), (64, 1), (200, 1), (1000, 3), (5000, 1), (8192, 1)):
        q = cp.asarray(rng.standard_normal((Tn, n_head, hd), dtype=F32) * F32(2))
        pos = cp.asarray(np.array([L - Tn], np.int32))
        outs, ns = [], attention.DecodeAttention(n_head, n_kv, hd, max_ctx, max_T=Tn).nsplit(Tn)
        for kw in ({"pipelined": True}, {"pipelined": False}):
            att = attention.DecodeAttention(n_head, n_kv, hd, max_ctx, max_T=Tn, nsplit=ns, **kw)
            out = nan_like(cp, (Tn, n_head * hd))
            att(q, K, V, pos, out, Tn)
            sync(cp)
            outs.append(out.get())
        assert np.isfinite(outs[0]).all()
        for o in outs[1:]:
            assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)), (L, Tn)


@pytest.mark.parametrize("var", ATTN_VARIANTS[:2], ids=ATTN_IDS[:2])
def test_attention_long(cp, D, var):
    rng = np.random.default_rng(5)
    got, ref64, _ = _attn_case(cp, D, rng, 32, 4, 128, 131072, 100003, q_scale=2.0, **var)
    assert note("attention 100K vs f64 on f16 cache", normwise(got, ref64)) <= 3e-3


@pytest.mark.parametrize("cfg,L,Tn", [((32, 4, 128), 300, 300), ((32, 4, 128), 5000, 256), ((4, 2, 64), 77, 13),
                                        ((8, 8, 64), 1000, 1), ((32, 4, 128), 40000, 64)],
                         ids=["a3b-first-chunk", "a3b-later-chunk", "tiny", "mha-one", "a3b-40K"])
def test_prefill_attention(cp, D, cfg, L, Tn):
    """Tensor-core prefill attention (fp16 Q and P, float32 accumulation) against float64 on the f16 cache; blocks
    of 128 and of 64 query rows give the same bits (_attn_case)."""
    rng = np.random.default_rng(L + Tn)
    for q_scale in (1.0, 4.0):
        got, ref64, _ = _attn_case(cp, D, rng, *cfg, 65536, L, Tn=Tn, q_scale=q_scale, prefill=True)
        assert np.isfinite(got).all()
        assert note(f"prefill attention {cfg} L={L} T={Tn} (q x{q_scale:g}) vs f64", normwise(got, ref64)) <= 1e-2


# ---- 5. router ---------------------------------------------------------------------------------------------------
# 512 and 1024: past a lane's registers
@pytest.mark.parametrize("n,k", [(128, 8), (16, 4), (160, 8), (64, 1), (256, 16), (512, 8), (1024, 32)])
def test_route(cp, D, n, k):
    rng = np.random.default_rng(n + k)
    Tn = 9
    x = rng.standard_normal((Tn, n), dtype=F32) * F32(2)
    x[1, 5] = x[1, 9] = x[1].max() + 1  # tie at the top
    x[2, :] = x[2, 0]  # all equal
    x[3, 10:20] = x[3, 3]  # a tie run
    x[4] *= F32(30)  # peaky
    x[5, ::37] = x[5].max() + 1  # ties held by different lanes at different register places
    x[6, ::67] = x[6].max() + 1  # and past the registers (n > 256)
    ids, w = cp.full((Tn, k), -1, cp.int32), nan_like(cp, (Tn, k))
    router.route(cp.asarray(x), k, ids, w)
    sync(cp)
    want_ids, want_w = reference.route(x, k)
    assert np.array_equal(ids.get(), want_ids.astype(np.int32))
    got_w = w.get()
    assert np.isfinite(got_w).all()
    nz = want_w != 0  # numpy's exp underflowed to 0 for the others: ours must be (near) 0 too
    assert np.all(np.abs(got_w[~nz]) <= 1e-30)
    e = note("route weights max rel", np.max(np.abs(got_w[nz] - want_w[nz]) / np.abs(want_w[nz])))
    assert e <= 2e-6


# ---- 6. argmax and sampling --------------------------------------------------------------------------------------
def test_argmax(cp, D):
    rng = np.random.default_rng(11)
    n = 151936
    am = sampling.Argmax(n)
    out = cp.full(1, -1, cp.int32)
    cases = []
    x = rng.standard_normal(n, dtype=F32)
    cases.append(x.copy())
    y = x.copy()
    y[[5000, 100, 140000]] = y.max() + 1
    cases.append(y)
    y = x.copy()
    y[[7, 99999]] = np.nan
    cases.append(y)
    y = np.full(n, -np.inf, F32)
    cases.append(y)
    y = -np.abs(x)
    y[[3000, 20]] = -0.0
    y[[50, 9000]] = 0.0
    cases.append(y)
    for c in cases:
        out.fill(-1)
        am(cp.asarray(c), out)
        sync(cp)
        assert int(out.get()[0]) == int(np.argmax(c))


def test_sample(cp, D):
    rng = np.random.default_rng(12)
    for n in (151936, 1000):
        s = sampling.DeviceSampler(n)
        out = cp.full(1, -1, cp.int32)
        for trial in range(6):
            x = rng.standard_normal(n, dtype=F32) * F32(3)
            if trial == 1:
                x[[10, 20, 30]] = x.max()  # ties at the top
            xd = cp.asarray(x)
            for temp, tk, tp in [(0.0, 0, 1.0), (0.7, 40, 0.9), (1.0, 0, 1.0), (1.3, 1000, 0.3), (0.5, 1, 1.0),
                                 (0.8, 256, 0.95), (0.3, 0, 0.9), (2.0, 0, 0.99)]:  # top-p alone: may be -1
                for u in (0.0, rng.random(), rng.random(), 0.999999):
                    params = cp.asarray(sampling.sampling_params(temp, tk, tp, u))
                    out.fill(-1)
                    s(xd, params, out)
                    sync(cp)
                    want = sampling.sample_ref(x, temp, tk, tp, u)
                    assert int(out.get()[0]) == want, (n, trial, temp, tk, tp, u)
                    if temp == 0:
                        assert want == int(np.argmax(x))


def test_cdf_sample_is_the_host_samplers(cp, D):
    """Whole-vocabulary temperature sampling on the device gives Sampler.pick's token; where they differ the draw
    must lie within float64 rounding of the boundary between the two (sums in another order)."""
    from stratad.engine.sampling import Sampler, SamplingParams

    rng = np.random.default_rng(13)
    for n in (151936, 4097, 1000, 7):
        s = sampling.CdfSampler(n)
        out = cp.full(1, -1, cp.int32)
        for trial in range(4):
            x = rng.standard_normal(n, dtype=F32) * F32(rng.uniform(0.5, 6))
            xd = cp.asarray(x)
            for temp in (0.3, 0.7, 1.0, 2.5):
                c = np.cumsum(np.exp((x.astype(np.float64) - float(x.max())) / temp))
                for u in (0.0, rng.random(), rng.random(), rng.random(), 0.999999):
                    out.fill(-1)
                    s(xd, cp.asarray(sampling.sampling_params(temp, 0, 1.0, u)), out)
                    sync(cp)
                    got, want = int(out.get()[0]), Sampler(SamplingParams(temperature=temp)).pick(x, u)
                    if got != want:
                        assert abs(c[min(got, want)] - u * c[-1]) <= 1e-12 * c[-1], (n, temp, u, got, want)


# ---- 7. embedding ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qt", DENSE, ids=lambda q: q.name)
def test_embed(cp, D, qt):
    rng = np.random.default_rng(int(qt))
    vocab, d = 1000, 2048
    raw = rand_weight(rng, qt, vocab, d, rms=0.05)
    tab = weights.DenseWeight.upload(raw, qt, d)
    toks = np.array([0, 999, 17, 500, 17], np.int32)
    out = nan_like(cp, (len(toks), d))
    embedding.embed(tab, cp.asarray(toks), out)
    sync(cp)
    want = embedding.embed_ref(raw, qt, toks)
    assert np.array_equal(out.get().view(np.uint32), want.view(np.uint32))
    bad = cp.zeros((1, d), cp.float32)
    embedding.embed(tab, cp.asarray(np.array([vocab], np.int32)), bad)
    sync(cp)
    assert np.isnan(bad.get()).all()


# ---- a decode step captured in a CUDA graph, replayed with the position advancing on the device -------------------
def test_graph_decode_step(cp, D):
    """embed -> norm -> qkv -> q/k norm+rope+KV -> attention -> o-proj (+res) -> norm -> router -> route -> LM
    head -> argmax -> advance pos: captured once, replayed 6 times; equal to the same launches run eagerly, and
    the token / ids equal a numpy forward of the same (expert-free) step within tolerance."""
    rng = np.random.default_rng(21)
    d, n_head, n_kv, hd, n_exp, k, vocab, max_ctx = 256, 4, 2, 64, 16, 4, 1000, 256
    qd, kd = n_head * hd, n_kv * hd
    raws = {
        "emb": rand_weight(rng, T.Q8_0, vocab, d, rms=0.5),
        "qkv": rand_weight(rng, T.Q8_0, qd + 2 * kd, d),
        "o": rand_weight(rng, T.Q8_0, d, qd),
        "router": rand_weight(rng, T.F32, n_exp, d),
        "head": rand_weight(rng, T.Q8_0, vocab, d),
    }
    qts = {"emb": T.Q8_0, "qkv": T.Q8_0, "o": T.Q8_0, "router": T.F32, "head": T.Q8_0}
    Wd = {n: weights.DenseWeight.upload(r, qts[n], d if n != "o" else qd) for n, r in raws.items()}
    nw = {n: rng.uniform(0.5, 1.5, m).astype(F32) for n, m in [("attn", d), ("q", hd), ("k", hd), ("ffn", d),
                                                                 ("out", d)]}
    nwd = {n: cp.asarray(v) for n, v in nw.items()}
    rope = rope_kv.RopeTable(max_ctx, hd, 1e6)
    att = attention.DecodeAttention(n_head, n_kv, hd, max_ctx)
    am = sampling.Argmax(vocab)

    def buffers():
        b = {"tok": cp.asarray(np.array([3], np.int32)), "pos": cp.zeros(1, cp.int32)}
        b["K"], b["V"] = rope_kv.alloc_kv_cache(n_kv, max_ctx, hd)
        for name, shape in [("x", (1, d)), ("h", (1, d)), ("qkv", (1, qd + 2 * kd)), ("q", (1, n_head, hd)),
                            ("a", (1, qd)), ("h2", (1, d)), ("lg", (1, n_exp)), ("hf", (1, d)), ("logits", (vocab,))]:
            b[name] = nan_like(cp, shape)
        b["ids"], b["w"] = cp.full((1, k), -1, cp.int32), nan_like(cp, (1, k))
        return b

    def step(b, s=None):
        embedding.embed(Wd["emb"], b["tok"], b["x"], stream=s)
        norm.rms_norm(b["x"], nwd["attn"], 1e-6, b["h"], stream=s)
        matvec.matvec(Wd["qkv"], b["h"][0], b["qkv"][0], stream=s)
        rope_kv.qk_norm_rope_kv(b["qkv"], nwd["q"], nwd["k"], 1e-6, rope, b["pos"], b["q"], b["K"], b["V"],
                          n_head=n_head, n_kv=n_kv, stream=s)
        att(b["q"], b["K"], b["V"], b["pos"], b["a"], stream=s)
        matvec.matvec(Wd["o"], b["a"][0], b["x"][0], residual=b["x"][0], stream=s)
        norm.rms_norm(b["x"], nwd["ffn"], 1e-6, b["h2"], stream=s)
        matvec.matvec(Wd["router"], b["h2"][0], b["lg"][0], stream=s)
        router.route(b["lg"], k, b["ids"], b["w"], stream=s)
        norm.rms_norm(b["x"], nwd["out"], 1e-6, b["hf"], stream=s)
        matvec.matvec(Wd["head"], b["hf"][0], b["logits"], stream=s)
        am(b["logits"], b["tok"], stream=s)
        rope_kv.advance_pos(b["pos"], 1, stream=s)

    # eager
    be = buffers()
    eager = []
    for _ in range(6):
        step(be)
        sync(cp)
        eager.append((int(be["tok"].get()[0]), be["ids"].get().copy(), be["logits"].get().copy()))
    # graph
    bg = buffers()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        step(bg, s)
        g = s.end_capture()
    graph = []
    for _ in range(6):
        g.launch(s)
        s.synchronize()
        graph.append((int(bg["tok"].get()[0]), bg["ids"].get().copy(), bg["logits"].get().copy()))
    for (t1, i1, l1), (t2, i2, l2) in zip(eager, graph):
        assert t1 == t2 and np.array_equal(i1, i2) and np.array_equal(l1.view(np.uint32), l2.view(np.uint32))
    assert int(bg["pos"].get()[0]) == 6

    # numpy forward of the same step (float32 reference pieces)
    Wf = {n: quants.dequantize(qts[n], r) for n, r in raws.items()}
    tok, K, V = 3, np.zeros((0, n_kv, hd), F32), np.zeros((0, n_kv, hd), F32)
    for i in range(6):
        x = Wf["emb"][tok][None]
        h = reference.rms_norm(x, nw["attn"], 1e-6)
        qkv = h @ Wf["qkv"].T
        q, kk, v = rope_kv.qk_norm_rope_kv_ref(qkv, i, nw["q"], nw["k"], 1e-6, 1e6, n_head, n_kv, hd)
        K, V = np.concatenate([K, kk]), np.concatenate([V, v])
        a = attention.attention_ref(q, K, V, i)
        x = x + a @ Wf["o"].T
        ids, _ = reference.route(reference.rms_norm(x, nw["ffn"], 1e-6) @ Wf["router"].T, k)
        logits = (reference.rms_norm(x, nw["out"], 1e-6) @ Wf["head"].T)[0]
        gt, gi, gl = graph[i]
        note("graph step logits normwise vs numpy", normwise(gl, logits))
        assert normwise(gl, logits) <= 6e-3
        srt = np.sort(logits)
        if srt[-1] - srt[-2] > 1e-2 * np.abs(srt[-1]):  # a clear winner must match
            assert gt == int(np.argmax(logits))
        tok = gt  # follow the GPU's token so both sides see the same inputs
