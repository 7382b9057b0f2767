"""The canonical expert function (stratad.engine.canonical), bit for bit against a slow scalar re-implementation.

The scalar code below is written from the format descriptions (llama.cpp's block layouts and the canonical rule in
canonical.py's docstring), not from quants.decode_int: it parses a row's bytes one block at a time (IQ3_S, Q4_K,
Q8_0; the other types' sub-blocks come from their integer view, which test_quants checks value for value against
gguf.quants.dequantize) and does every float operation on one np.float32 scalar, in the documented order. Any difference in the bits is a bug in one of
the two, and the GPU kernels and the CPU pool will be checked against the same function.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from stratad.engine import canonical
from stratad.model import quants
from stratad.model.quants import iquants

F32 = np.float32
EXPERT_TYPES = list(quants.EXPERT_TYPES)
IDS = [t.name for t in EXPERT_TYPES]


# ---- a slow scalar implementation -----------------------------------------------------------------------------


def _f16(b: bytes) -> np.float32:
    return F32(np.frombuffer(bytes(b), np.float16)[0])


def _iq3s_table() -> np.ndarray:
    gq.IQ3_S.init_grid()
    return gq.IQ3_S.grid.reshape(512, 4).astype(int)


def scalar_subblocks(qtype: T, row: bytes) -> list[tuple]:
    """One row's sub-blocks of 32 values: (integer values, scale, minimum or None[, minimum weights]), block by
    block."""
    out = []
    if qtype == T.Q8_0:
        for o in range(0, len(row), 34):
            d = _f16(row[o:o + 2])
            q = [int(v) for v in np.frombuffer(bytes(row[o + 2:o + 34]), np.int8)]
            out.append((q, d, None))
    elif qtype == T.Q4_K:
        for o in range(0, len(row), 144):
            d, dmin = _f16(row[o:o + 2]), _f16(row[o + 2:o + 4])
            s = list(row[o + 4:o + 16])
            qs = list(row[o + 16:o + 144])
            for j in range(8):  # get_scale_min_k4
                if j < 4:
                    sc, m = s[j] & 63, s[j + 4] & 63
                else:
                    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4)
                    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
                chunk = qs[32 * (j // 2):32 * (j // 2) + 32]  # sub-blocks 2k / 2k+1: low / high nibbles
                q = [(b >> 4) if j % 2 else (b & 0x0F) for b in chunk]
                out.append((q, d * F32(sc), dmin * F32(m)))
    elif qtype == T.IQ3_S:
        grid = _iq3s_table()
        for o in range(0, len(row), 110):
            d = _f16(row[o:o + 2])
            qs, qh = row[o + 2:o + 66], row[o + 66:o + 74]
            signs, scales = row[o + 74:o + 106], row[o + 106:o + 110]
            for ib in range(8):
                nib = (scales[ib // 2] >> (4 * (ib % 2))) & 0x0F
                q = []
                for k in range(8):  # 8 grid entries of 4 values
                    idx = qs[8 * ib + k] | (((qh[ib] >> k) & 1) << 8)
                    for j in range(4):
                        v = 8 * (k // 2) + 4 * (k % 2) + j  # value index within the sub-block
                        neg = (signs[4 * ib + v // 8] >> (v % 8)) & 1
                        q.append(-int(grid[idx][j]) if neg else int(grid[idx][j]))
                out.append((q, d * F32(1 + 2 * nib), None))
    else:  # from the integer view (see the module doc)
        ib = quants.decode_int(qtype, np.frombuffer(bytes(row), np.uint8)[None])
        for j in range(ib.q.shape[1]):
            mw = None if ib.mweight is None else [int(v) for v in ib.mweight[0, j]]
            out.append(([int(v) for v in ib.q[0, j]], ib.scale[0, j],
                        None if ib.minimum is None else ib.minimum[0, j], mw))
    return out


def scalar_quantize(x: list) -> tuple[list[list[int]], list[np.float32]]:
    """Canonical activation quantisation of one row, one sub-block at a time."""
    qs, ds = [], []
    for b in range(0, len(x), 32):
        blk = [F32(v) for v in x[b:b + 32]]
        amax = F32(0)
        for v in blk:
            amax = max(amax, F32(abs(v)))
        d = amax / F32(127)
        inv = F32(1) / d if d > 0 else F32(0)
        if np.isinf(inv):
            inv = F32(0)
        qs.append([int(round(float(v * inv))) for v in blk])  # Python's round: half to even
        ds.append(d)
    return qs, ds


def scalar_lane_sum(terms: list) -> np.float32:
    lanes = [F32(0)] * 32
    for i, t in enumerate(terms):  # lane l adds terms l, l+32, ... in order
        lanes[i % 32] = lanes[i % 32] + t
    off = 16
    while off:
        for lane in range(off):
            lanes[lane] = lanes[lane] + lanes[lane + off]
        off //= 2
    return lanes[0]


def scalar_qdot(sub: list, qa: list[list[int]], da: list) -> np.float32:
    terms = []
    for blk, qx, d in zip(sub, qa, da, strict=True):
        qw, scale, minimum = blk[:3]
        mw = blk[3] if len(blk) > 3 and blk[3] is not None else [1] * len(qx)
        isum = 0
        for a, b in zip(qw, qx, strict=True):
            isum += a * b
        t = (scale * d) * F32(isum)
        if minimum is not None:
            t = t - (minimum * d) * F32(sum(m * a for m, a in zip(mw, qx, strict=True)))
        terms.append(t)
    return scalar_lane_sum(terms)


def scalar_expert(gate: list, up: list, down: list, x: list) -> list:
    """One token through one expert: gate / up / down are lists of rows' sub-blocks."""
    qa, da = scalar_quantize(x)
    h = []
    for g_row, u_row in zip(gate, up, strict=True):
        g = scalar_qdot(g_row, qa, da)
        u = scalar_qdot(u_row, qa, da)
        e = canonical.exp(np.array([-g], F32))[0]  # the canonical exp is checked on its own below
        h.append((g / (F32(1) + e)) * u)
    qh, dh = scalar_quantize(h)
    return [scalar_qdot(d_row, qh, dh) for d_row in down]


# ---- helpers --------------------------------------------------------------------------------------------------


def weight_rows(qtype: T, rng: np.random.Generator, rows: int, n: int, source: str) -> np.ndarray:
    """uint8 (rows, row_bytes): generator output, or random bytes whose f16 scales are finite (of any sign)."""
    if source == "random_rows":
        return quants.random_rows(qtype, rng, rows, n, rms=0.05)
    f = quants.fmt(qtype)
    raw = np.frombuffer(rng.bytes(rows * f.row_bytes(n)), np.uint8).reshape(rows, -1, f.block_bytes).copy()
    nb = raw.shape[1]
    for off in F16_AT.get(qtype, (0,)):
        s = (rng.uniform(-1, 1, (rows, nb)) * 10.0 ** rng.uniform(-4, 0, (rows, nb))).astype(np.float16)
        if qtype == T.IQ1_M:  # d in the top nibbles of the four scale words
            iquants._put_iq1m_d(raw, s.astype(F32))
        else:
            raw[..., off:off + 2] = s.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, -1)


# byte offsets of each type's f16 fields where they are not just d at 0
F16_AT = {T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q2_K: (80, 82), T.Q3_K: (108,),
          T.Q6_K: (208,), T.IQ1_M: (None,)}


def activations(rng: np.random.Generator, tokens: int, n: int) -> np.ndarray:
    """Inputs whose sub-blocks have very different magnitudes, one all-zero sub-block, and an exact tie."""
    x = rng.standard_normal((tokens, n)).astype(F32)
    x *= (10.0 ** rng.uniform(-3, 1, (tokens, n // 32, 1))).astype(F32).repeat(32, axis=1).reshape(tokens, n)
    x[:, 32:64] = 0
    x[0, 64:96] = np.arange(32, dtype=F32) - F32(16.5)  # amax 16.5: some x / d land on .5 exactly
    return x


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---- qdot ------------------------------------------------------------------------------------------------------

# 256 values: 8 sub-blocks (24 padding lanes); 768: 24 sub-blocks; 1280: 40 (a second, partial pass over the
# lanes); 2048: 64 (two full passes)
@pytest.mark.parametrize("n", [256, 768, 1280, 2048])
@pytest.mark.parametrize("source", ["random_rows", "random_bytes"])
@pytest.mark.parametrize("qtype", EXPERT_TYPES, ids=IDS)
def test_qdot_matches_scalar(qtype, source, n):
    rng = np.random.default_rng([int(qtype), n, source == "random_rows"])
    rows, tokens = 3, 2
    raw = weight_rows(qtype, rng, rows, n, source)
    x = activations(rng, tokens, n)
    # random bytes as float scales hold infinities, NaNs and huge values: their overflow is compared bit for bit too
    with np.errstate(over="ignore", invalid="ignore"):
        qa, da = canonical.quantize_act(x)
        ours = canonical.qdot(quants.decode_int(qtype, raw), qa, da)
        assert ours.dtype == F32 and ours.shape == (tokens, rows)
        sqa, sda = zip(*(scalar_quantize(list(x[t])) for t in range(tokens)))
        for t in range(tokens):
            assert np.array_equal(qa[t], np.array(sqa[t], np.int8)) and bits_equal(da[t], sda[t])
            for r in range(rows):
                want = scalar_qdot(scalar_subblocks(qtype, raw[r].tobytes()), sqa[t], sda[t])
                assert bits_equal(ours[t, r], want), f"token {t} row {r}: {ours[t, r]!r} != {want!r}"


def test_qdot_summation_order_is_observable():
    """The check above can see a wrong order: summing the same terms left to right changes some bits."""
    rng = np.random.default_rng(11)
    differ = 0
    for _ in range(50):
        terms = (rng.standard_normal(64) * 10.0 ** rng.uniform(-4, 2, 64)).astype(F32)
        seq = F32(0)
        for t in terms:
            seq = seq + t
        lane = canonical.lane_sum(terms[None])[0]
        assert bits_equal(lane, scalar_lane_sum(list(terms)))
        differ += not bits_equal(lane, seq)
    assert differ > 10


@pytest.mark.parametrize("nsub", [1, 5, 31, 32, 33, 64, 100])
def test_lane_sum_matches_scalar(nsub):
    rng = np.random.default_rng(nsub)
    terms = (rng.standard_normal((4, nsub)) * 10.0 ** rng.uniform(-3, 3, (4, nsub))).astype(F32)
    got = canonical.lane_sum(terms)
    for i in range(4):
        assert bits_equal(got[i], scalar_lane_sum(list(terms[i])))


@pytest.mark.parametrize("qtype", EXPERT_TYPES, ids=IDS)
def test_expert_matches_scalar(qtype):
    """The whole expert (gate, up, SwiGLU with the canonical exp, h quantised, down) for one token."""
    rng = np.random.default_rng([7, int(qtype)])
    d_model, d_ff = 256, 256
    gate, up = (weight_rows(qtype, rng, d_ff, d_model, "random_rows") for _ in range(2))
    down = quants.random_rows(qtype, rng, d_model, d_ff, rms=0.05)
    x = rng.standard_normal((1, d_model)).astype(F32)
    qa, da = canonical.quantize_act(x)
    ib = [quants.decode_int(qtype, w) for w in (gate, up, down)]
    ours = canonical.expert(*ib, qa, da)
    subs = [[scalar_subblocks(qtype, w[r].tobytes()) for r in range(w.shape[0])] for w in (gate, up, down)]
    want = scalar_expert(*subs, list(x[0]))
    assert ours.shape == (1, d_model)
    assert bits_equal(ours[0], np.array(want, F32))


@pytest.mark.parametrize("qtype", EXPERT_TYPES, ids=IDS)
def test_qdot_close_to_float_dot(qtype):
    """The canonical dot against the float64 dot of gguf's dequantised weights with the unquantised input. Stated
    bound: |qdot - w.x| <= sum_v |w_v| (d_b / 2 + 2^-22 |x_v|) + 2^-20 sum_v |w_v| |x_v| (the activation's rounding to
    the grid of step d_b, then float32 rounding of the terms and their sum), plus for the float types
    sum_v (|x_v| + d_b / 2) scale_v / 2 (their view rounds each weight to a step of scale_v = 2^k, at most 2^-12 of
    the sub-block's largest weight); a wrong scale in a view breaks it."""
    rng = np.random.default_rng([13, int(qtype)])
    rows, n = 16, 2048
    raw = quants.random_rows(qtype, rng, rows, n, rms=0.05)
    x = activations(rng, 3, n)
    qa, da = canonical.quantize_act(x)
    ours = canonical.qdot(quants.decode_int(qtype, raw), qa, da).astype(np.float64)
    w = gq.dequantize(np.ascontiguousarray(raw).view(np.uint8), qtype).astype(np.float64)
    x64, step = x.astype(np.float64), np.repeat(da.astype(np.float64), 32, axis=1)
    want = x64 @ w.T
    bound = np.abs(w) @ (step / 2 + 2.0 ** -22 * np.abs(x64)).T + 2.0 ** -20 * (np.abs(x64) @ np.abs(w).T).T
    if not quants.fmt(qtype).quantised:
        half = np.repeat(quants.decode_int(qtype, raw).scale.astype(np.float64) / 2, 32, axis=1)
        assert float(np.max(half / np.repeat(np.abs(w).reshape(rows, -1, 32).max(-1), 32, axis=1))) <= 2.0 ** -12
        bound = bound + half @ (np.abs(x64) + step / 2).T
    err = np.abs(ours - want)
    assert np.all(err <= bound.T), f"worst error / bound {float((err / bound.T).max()):.3g}"
    assert float((err / bound.T).max()) > 1e-3  # the bound is not vacuous: errors come within reach of it


# ---- quantize_act ---------------------------------------------------------------------------------------------


def test_quantize_act_range_and_scale():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((9, 1024)) * 10.0 ** rng.uniform(-20, 20, (9, 1024))).astype(F32)
    q, d = canonical.quantize_act(x)
    assert q.dtype == np.int8 and q.shape == (9, 32, 32) and d.dtype == F32 and d.shape == (9, 32)
    assert q.min() >= -127 and q.max() <= 127
    xb = x.reshape(9, 32, 32)
    amax = np.abs(xb).max(axis=-1)
    assert bits_equal(d, amax / F32(127))
    # the largest magnitude of each block maps to +-127, and every value is within half a step
    at = np.take_along_axis(q, np.abs(xb).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    assert np.all(np.abs(at.astype(int)) == 127)
    err = np.abs(q.astype(np.float64) * d[..., None] - xb)
    assert np.all(err <= 0.5 * d[..., None].astype(np.float64) * (1 + 1e-6) + 1e-45)


def test_quantize_act_zero_block():
    x = np.ones((2, 96), F32)
    x[0, 32:64] = 0
    x[1, :] = 0
    with np.errstate(all="raise"):  # no 1/0 and no NaN cast
        q, d = canonical.quantize_act(x)
    assert d[0, 1] == 0 and not q[0, 1].any()
    assert not d[1].any() and not q[1].any()
    assert np.all(q[0, 0] == 127) and d[0, 0] == F32(1) / F32(127)


def test_quantize_act_rounds_half_to_even():
    # amax 127 -> d = 1 exactly, so x * (1 / d) = x: the .5 cases are exact ties
    x = np.zeros(32, F32)
    x[:10] = [127, 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 126.5, -125.5]
    q, d = canonical.quantize_act(x)
    assert d[0] == 1
    assert q[0, :10].tolist() == [127, 0, 2, 2, 4, 0, -2, -2, 126, -126]


def test_quantize_act_subnormal_scale():
    """amax so small that 1 / d overflows: q = 0 by definition (never a cast of inf to int8)."""
    x = np.zeros((2, 32), F32)
    x[0, :3] = [1e-38, -5e-39, 3e-39]  # d subnormal, 1/d = inf
    x[1, :2] = [1e-36, -5e-37]  # d subnormal, 1/d finite: quantised normally
    with np.errstate(invalid="raise"):
        q, d = canonical.quantize_act(x)
    assert not q[0].any() and d[0, 0] == F32(1e-38) / F32(127)
    assert q[1, 0, 0] == 127 and q[1, 0, 1] in (-63, -64)  # a subnormal d carries few bits: -63 here


# ---- exp -------------------------------------------------------------------------------------------------------

EXP_LO, EXP_HI = -87.0, 88.0


def _exp_samples() -> np.ndarray:
    """~6M float32 inputs over [-87, 88]: random bit patterns (every binade), a fine grid, consecutive floats
    around 0 and around the range reduction's switch points x = (k + 1/2) ln 2."""
    rng = np.random.default_rng(0)
    lo, hi = np.float32(EXP_HI).view(np.uint32), np.float32(-EXP_LO).view(np.uint32)
    pos = rng.integers(0, lo, 2_000_000, dtype=np.uint32).view(F32)
    neg = -rng.integers(0, hi, 2_000_000, dtype=np.uint32).view(F32)
    grid = np.linspace(EXP_LO, EXP_HI, 1_000_001, dtype=F32)
    near0 = np.arange(-500_000, 500_000, dtype=np.int32)
    near0 = np.where(near0 < 0, (-near0).view(np.uint32) | np.uint32(0x80000000), near0.view(np.uint32)).view(F32)
    k = np.arange(-126, 128)
    sw = ((k + 0.5) * np.log(2)).astype(F32)
    sw = sw[(sw > EXP_LO) & (sw < EXP_HI)]
    around = (sw.view(np.int32)[:, None] + np.arange(-200, 200, dtype=np.int32)[None, :]).ravel().view(F32)
    return np.concatenate([pos, neg, grid, near0, around])


def test_exp_relative_error():
    """Measured: max relative error 1.03e-7 (at x = 59.265) over EVERY float32 in [-87, 88] (a one-off
    exhaustive scan of 2.24e9 inputs, 48 s); the sample here checks the same bound."""
    x = _exp_samples()
    got = canonical.exp(x)
    assert got.dtype == F32
    rel = np.abs(got.astype(np.float64) / np.exp(x.astype(np.float64)) - 1)
    worst = float(rel.max())
    print(f"[canonical.exp] max relative error {worst:.3g} at x={float(x[rel.argmax()])!r} over {x.size} inputs")
    assert worst < 2e-7


def test_exp_exact_at_zero_and_clamped():
    assert canonical.exp(np.array([0.0, -0.0], F32)).tolist() == [1.0, 1.0]
    big = canonical.exp(np.array([88.0, 1000.0, np.inf, -87.0, -1000.0, -np.inf], F32))
    assert np.all(np.isfinite(big)) and np.all(big > 0)
    assert big[0] == big[1] == big[2] and big[3] == big[4] == big[5]
    assert canonical.exp(np.array([1.0], F32))[0] == pytest.approx(np.e, rel=2e-7)


def test_exp_monotonic():
    """Non-decreasing over the sample, up to one ulp: the measured exhaustive scan found exactly 2861 places
    where exp(next float) is one ulp below exp(x), all with x in [-0.25, -0.031] (where the polynomial is
    evaluated directly, n = 0; Horner's rounding). Never across the switch points of the range reduction,
    never by more than one ulp; strictly increasing on a grid of step 1.75e-4."""
    start = np.float32(-0.25).view(np.uint32)  # consecutive floats from -0.25 towards 0: holds such steps
    window = (start - np.arange(400_000, dtype=np.uint32)).view(F32)
    x = np.unique(np.concatenate([_exp_samples(), window]))
    y = canonical.exp(x)
    dec = np.flatnonzero(y[1:] < y[:-1])
    assert np.all(y[1:] >= np.nextafter(y[:-1], F32(0))), "a step down of more than one ulp"
    assert np.all((x[dec] > -0.26) & (x[dec] < -0.03)), x[dec][(x[dec] <= -0.26) | (x[dec] >= -0.03)][:5]
    assert 0 < dec.size <= 2861, dec.size  # some of the known one-ulp steps are seen (so the check can see them)
    g = np.linspace(EXP_LO, EXP_HI, 1_000_001, dtype=F32)
    assert np.all(np.diff(canonical.exp(g)) > 0)


def test_silu_uses_canonical_exp():
    g = np.linspace(-30, 30, 10001, dtype=F32)
    s = canonical.silu(g)
    assert bits_equal(s, g / (F32(1) + canonical.exp(-g)))
    ref = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))
    assert np.max(np.abs(s - ref) / np.maximum(np.abs(ref), 1e-30)) < 1e-6


# ---- batch invariance and combine ------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", EXPERT_TYPES, ids=IDS)
def test_expert_batch_invariant(qtype):
    """A token's expert output does not depend on which other tokens share the batch (or where it sits in it)."""
    rng = np.random.default_rng([9, int(qtype)])
    d_model, d_ff = 512, 768
    ib = [quants.decode_int(qtype, quants.random_rows(qtype, rng, r, c, 0.05))
          for r, c in ((d_ff, d_model), (d_ff, d_model), (d_model, d_ff))]
    x = rng.standard_normal((7, d_model)).astype(F32)
    qa, da = canonical.quantize_act(x)
    batch = canonical.expert(*ib, qa, da)
    for t in range(7):
        alone = canonical.expert(*ib, qa[t:t + 1], da[t:t + 1])
        assert bits_equal(alone[0], batch[t]), f"token {t}"
    perm = rng.permutation(7)
    assert bits_equal(canonical.expert(*ib, qa[perm], da[perm]), batch[perm])


def test_engine_experts_batch_invariant(tiny_model):
    """The reference engine's canonical expert runner: one token alone == the same token in a batch of 7."""
    from stratad.engine.reference import CanonicalExperts

    c = tiny_model.config
    runner = CanonicalExperts(tiny_model)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, c.d_model)).astype(F32)
    ids = np.stack([rng.choice(c.n_expert, c.n_expert_used, replace=False) for _ in range(7)])
    ids[3] = ids[1]  # two tokens routed to the same experts
    for layer in (0, c.n_layer - 1):
        batch = runner(layer, x, ids)
        assert batch.shape == (7, c.n_expert_used, c.d_model)
        for t in range(7):
            assert bits_equal(runner(layer, x[t:t + 1], ids[t:t + 1])[0], batch[t]), (layer, t)


def test_combine_is_router_order_sum():
    rng = np.random.default_rng(2)
    tokens, k, d = 5, 8, 64
    w = rng.dirichlet(np.ones(k), tokens).astype(F32)
    y = (rng.standard_normal((tokens, k, d)) * 10.0 ** rng.uniform(-3, 3, (tokens, k, 1))).astype(F32)
    got = canonical.combine(w, y)
    assert got.dtype == F32 and got.shape == (tokens, d)
    reordered = 0
    for t in range(tokens):
        for i in range(d):
            acc = F32(0)
            for j in range(k):
                acc = acc + w[t, j] * y[t, j, i]
            assert bits_equal(got[t, i], acc), (t, i)
            rev = F32(0)
            for j in reversed(range(k)):
                rev = rev + w[t, j] * y[t, j, i]
            reordered += not bits_equal(rev, acc)
    assert reordered > 0  # the order is observable, so the check above pins it
    # float64 weights (as a caller might pass) are rounded to float32 before the multiply
    assert bits_equal(canonical.combine(w.astype(np.float64), y), got)


@pytest.mark.parametrize("nsub", [3, 8, 24, 32, 40, 64, 96])
def test_leaf_fold_order_is_lane_sum(nsub):
    """The tensor-core expert kernels sum a row's terms leaf by leaf in bit-reversed lane order, merged as a binary
    counter (experts_mma.cuh); that is canonical.lane_sum's tree, bit for bit, signed zeros and huge / tiny terms
    included."""
    from lane.kernels.experts import leaf_fold_ref

    rng = np.random.default_rng(nsub)
    t = (rng.standard_normal((400, nsub)) * np.exp(rng.uniform(-30, 30, (400, nsub)))).astype(np.float32)
    t[rng.random((400, nsub)) < 0.2] = -0.0
    want, got = canonical.lane_sum(t), leaf_fold_ref(t)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # and the order matters: a plain left-to-right sum differs somewhere
    assert nsub < 8 or not np.array_equal(np.cumsum(t, axis=1, dtype=np.float32)[:, -1].view(np.uint32),
                                          want.view(np.uint32))


def _prmt(a: np.ndarray, b: np.ndarray | int, sel: int) -> np.ndarray:
    """PTX prmt.b32 (default mode, selector nibbles 0..7): byte i of the result is byte sel[i] of b:a."""
    src = [(np.asarray(x, np.uint32) >> np.uint32(8 * i)) & np.uint32(255) for x in (a, b) for i in range(4)]
    return sum(src[(sel >> 4 * i) & 7] << np.uint32(8 * i) for i in range(4)).astype(np.uint32)


def test_signed_grid_holds_signed_groups():
    """experts.py's signed_grid, the IQ3_S decode kernels' table: word (signs4 << 9) | idx is grid entry idx with
    byte b negated where bit b of signs4 is set (every entry), which is what fill_grid's byte negation makes of the
    plain grid; and the index arithmetic of experts.cu's iq3s_term_fast, mirrored here word for word, fetches
    decode_int's signed weights of every group of real rows."""
    from lane.kernels.experts import signed_grid

    g = quants.iq3s_grid().astype(int)
    t = signed_grid()
    assert t.dtype == np.uint32 and t.shape == (16 * 512,)
    tb = t.view(np.int8)  # little endian: byte b of word w at 4 w + b, as the kernel's dp4a takes it
    s, idx = np.meshgrid(np.arange(16), np.arange(512), indexing="ij")
    addr = (s << 11) | (idx << 2)  # the byte address of word (s << 9) | idx
    for b in range(4):
        want = np.where((s >> b) & 1, -g[idx, b], g[idx, b])
        np.testing.assert_array_equal(tb[addr + b], want)
    plain = np.ascontiguousarray(quants.iq3s_grid()).view(np.uint32).reshape(-1)
    np.testing.assert_array_equal(t[:512], plain)
    for p in range(16):  # experts.cu's fill_grid builds pattern p from the plain grid as (v ^ m) + (m & 0x01010101)
        m = np.uint32(sum(0xFF << 8 * b for b in range(4) if (p >> b) & 1))
        np.testing.assert_array_equal((plain ^ m) + (m & np.uint32(0x01010101)), t[512 * p:512 * (p + 1)])

    raw = quants.random_rows(T.IQ3_S, np.random.default_rng(3), 8, 4096, 1.0)
    want = quants.decode_int(T.IQ3_S, raw).q.reshape(-1, 8, 32)  # (block, sub-block j, value)
    blk = raw.reshape(-1, 110)
    u32 = lambda b: b.copy().view(np.uint32)[:, 0]  # noqa: E731  4 bytes (little endian) -> uint32
    for j in range(8):
        qs0, qs1 = u32(blk[:, 2 + 8 * j:6 + 8 * j]), u32(blk[:, 6 + 8 * j:10 + 8 * j])
        sg, qh = u32(blk[:, 74 + 4 * j:78 + 4 * j]), blk[:, 66 + j].astype(np.uint32)
        tl, th = _prmt(sg, 0, 0x1100), _prmt(sg, 0, 0x3322)
        gl = (((qh & 15) * 0x00204081) & 0x01010101) | ((tl << 1) & 0x001E001E) | ((tl >> 3) & 0x1E001E00)
        gh = (((qh >> 4) * 0x00204081) & 0x01010101) | ((th << 1) & 0x001E001E) | ((th >> 3) & 0x1E001E00)
        P = [_prmt(qs0, gl, 0x5140), _prmt(qs0, gl, 0x7362), _prmt(qs1, gh, 0x5140), _prmt(qs1, gh, 0x7362)]
        for k in range(8):
            pw = P[k >> 1].astype(np.int64)
            a = (pw >> 14) if k & 1 else ((pw << 2) & 0x7FFC)
            assert a.max() < 16 * 512 * 4
            got = tb[a[:, None] + np.arange(4)]
            np.testing.assert_array_equal(got, want[:, j, 4 * k:4 * k + 4], err_msg=f"sub-block {j} group {k}")
