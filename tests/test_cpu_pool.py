"""The CPU pool computes exactly canonical.expert's bits, straight from raw GGUF bytes, for any thread count."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from lane.cpu_pool import CpuPool, LayerJobs
from stratad.engine import canonical
from stratad.model.quants import EXPERT_TYPES, decode_int, fmt, random_rows

F32 = np.float32
TINY = (256, 256)  # (d_model, d_ff)
A3B = (2048, 768)


@pytest.fixture(scope="module")
def seed():
    """Fresh random inputs on every run; the seed is printed so that a failure can be replayed."""
    s = int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"test_cpu_pool seed {s}")
    return s


@pytest.fixture(scope="module")
def pools():
    ps = {1: CpuPool(1), 2: CpuPool(2)}
    yield ps
    for p in ps.values():
        p.close()


def make_layer(rng, types, n_expert, d_model, d_ff, rms=(0.02, 0.02, 0.02)):
    tg, tu, td = types
    gate = np.stack([random_rows(tg, rng, d_ff, d_model, rms[0]) for _ in range(n_expert)])
    up = np.stack([random_rows(tu, rng, d_ff, d_model, rms[1]) for _ in range(n_expert)])
    down = np.stack([random_rows(td, rng, d_model, d_ff, rms[2]) for _ in range(n_expert)])
    return gate, up, down


def make_tokens(rng, n_tok, d_model):
    """Activations of very different magnitudes; token 0 has one all-zero block (d == 0), the last is all zeros
    when there are 3 or more (then h == 0 and the down projection quantises blocks with d == 0 too)."""
    x = rng.standard_normal((n_tok, d_model)).astype(F32)
    x *= (10.0 ** rng.uniform(-3, 2, size=(n_tok, 1))).astype(F32)
    x[0, 32:64] = 0
    if n_tok >= 3:
        x[-1] = 0
    return canonical.quantize_act(x)


def reference(types, layer, pairs, qa, da):
    gate, up, down = layer
    out = np.empty((len(pairs), down.shape[1]), F32)
    for i, (t, e) in enumerate(pairs):
        w = [decode_int(ty, m[e]) for ty, m in zip(types, layer)]
        out[i] = canonical.expert(*w, qa[t:t + 1], da[t:t + 1])[0]
    return out


def assert_bits(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    same = got.view(np.uint32) == want.view(np.uint32)
    if not same.all():
        i = np.argwhere(~same)[0]
        raise AssertionError(f"{(~same).sum()} of {same.size} outputs differ, first at {tuple(i)}: "
                             f"{got[tuple(i)]!r} vs canonical {want[tuple(i)]!r}")
    assert np.array_equal(got, want, equal_nan=True)


def run_all(pools, jobs):
    """Every pool configuration gives the same bits; returns the 1-thread result."""
    outs = {k: p.run(jobs) for k, p in pools.items()}
    for k, o in outs.items():
        assert_bits(o, outs[1])
    return outs[1]


@pytest.mark.parametrize("qtype", [T.IQ3_S, T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [TINY, A3B], ids=["tiny", "a3b"])
def test_bit_exact_vs_canonical(pools, seed, qtype, shape):
    d_model, d_ff = shape
    rng = np.random.default_rng([seed, int(qtype), d_model])
    types = (qtype,) * 3
    layer = make_layer(rng, types, 6, d_model, d_ff)
    qa, da = make_tokens(rng, 3, d_model)
    # several experts, one token each (the single-token path) ...
    pairs = np.array([(0, 4), (1, 1), (2, 5), (1, 3)], np.int32)
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    assert_bits(run_all(pools, jobs), reference(types, layer, pairs, qa, da))
    assert np.all(da[0, 1] == 0) and np.all(da[2] == 0)


@pytest.mark.parametrize("qtype", EXPERT_TYPES, ids=lambda t: t.name)
def test_every_type_bit_exact_vs_canonical(pools, seed, qtype):
    """Every expert type (each has a raw-block kernel), several tokens per expert."""
    d_model, d_ff = TINY
    rng = np.random.default_rng([seed, int(qtype), 3])
    types = (qtype,) * 3
    layer = make_layer(rng, types, 4, d_model, d_ff)
    qa, da = make_tokens(rng, 3, d_model)
    pairs = np.array([(0, 3), (1, 1), (2, 3), (1, 3), (0, 0)], np.int32)
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    assert_bits(run_all(pools, jobs), reference(types, layer, pairs, qa, da))


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.IQ3_S, T.IQ3_S, T.Q6_K), (T.Q2_K, T.Q3_K, T.Q6_K),
                                   (T.Q6_K, T.Q6_K, T.Q8_0), (T.Q5_K, T.Q3_K, T.Q6_K),
                                   (T.IQ2_XXS, T.IQ2_XXS, T.IQ3_S), (T.IQ1_M, T.IQ1_S, T.IQ4_XS)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_mixed_types_bit_exact(pools, seed, types):
    """One layer's gate / up / down of different types, as llama.cpp's mixes write them, at the a3b shape."""
    d_model, d_ff = A3B
    rng = np.random.default_rng([seed, *map(int, types)])
    layer = make_layer(rng, types, 3, d_model, d_ff)
    qa, da = make_tokens(rng, 2, d_model)
    pairs = np.array([(0, 2), (1, 0), (1, 2)], np.int32)
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    assert_bits(run_all(pools, jobs), reference(types, layer, pairs, qa, da))


FLOATS = [T.F16, T.BF16, T.F32]


def special_floats(rng, qtype, rows, n):
    """Rows of a float type whose 32-value sub-blocks hit the float view's edges: zeros and -0, infinities and NaNs
    (read as 0), subnormals (a sub-block of them alone: its e from the mantissa's length), large values beside
    tiny ones (q rounds to 0 or half to even), and random bit patterns; exponents of the 8-bit-exponent types up to
    2^24, so that the dot products stay finite."""
    bits = {T.F16: (np.uint16, 5, 10, 30), T.BF16: (np.uint16, 8, 7, 151), T.F32: (np.uint32, 8, 23, 151)}
    dt, eb, mb, big = bits[qtype]
    emax, top = (1 << eb) - 1, 1 << (eb + mb)
    sign = rng.integers(0, 2, (rows, n)).astype(np.uint64) << np.uint64(eb + mb)
    ex = rng.integers(0, big + 1, (rows, n)).astype(np.uint64) << np.uint64(mb)
    u = (sign | ex | rng.integers(0, 1 << mb, (rows, n)).astype(np.uint64)).astype(dt)
    sub = u.reshape(rows, -1, 32)
    kinds = sub.shape[1]
    for s in range(kinds):
        block = sub[:, s]
        kind = s % 6
        if kind == 0:  # zeros, -0 and a few values
            block[:] = 0
            block[:, 1] = top
            block[:, 5] = (1 << mb) * 3
        elif kind == 1:  # non-finite among finite
            block[:, ::4] = (emax << mb) | rng.integers(0, 1 << mb, (rows, 8)).astype(dt)
            block[:, 1::8] = emax << mb
        elif kind == 2:  # subnormals only
            block[:] = rng.integers(0, 1 << mb, block.shape).astype(dt) | (rng.integers(0, 2, block.shape) * top).astype(dt)
        elif kind == 3:  # a large magnitude beside tiny ones
            block[:, 0] = (big << mb) | ((1 << mb) - 1)
            block[:, 1:] = rng.integers(0, 1 << (eb + mb - 2), (rows, 31)).astype(dt)
        elif kind == 4:  # exact halves: q on a rounding tie
            block[:] = ((7 << mb) + (rng.integers(0, 1 << mb, block.shape) & ~0x7).astype(dt)).astype(dt)
            block[:, 0] = (20 << mb)
    return u.view(np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_view_edges_bit_exact(pools, seed, qtype):
    """The float types' integer view formed from the raw bits (cpu_pool.blocks_float._float_view) against
    quants.floats.float_view through canonical.expert, on sub-blocks at the view's edges (special_floats)."""
    d_model, d_ff = 256, 352  # 352: down rows of 8 sub-blocks and a remainder of 3
    rng = np.random.default_rng([seed, 23, int(qtype)])
    types = (qtype,) * 3
    layer = tuple(np.stack([special_floats(rng, qtype, r, n) for _ in range(3)])
                  for r, n in ((d_ff, d_model), (d_ff, d_model), (d_model, d_ff)))
    qa, da = make_tokens(rng, 2, d_model)
    pairs = np.array([(0, 0), (1, 2), (0, 1), (1, 1)], np.int32)  # experts read by one token (in registers), by two
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    assert_bits(run_all(pools, jobs), reference(types, layer, pairs, qa, da))


def test_every_expert_type_reads_raw_blocks():
    import lane.cpu_pool.tables as cp

    assert set(cp._BLOCK_BYTES) == {int(t) for t in EXPERT_TYPES}


def test_quantize_edges_match_canonical():
    """The pool's quantisation of h at canonical.quantize_act's edges: a group whose d is subnormal with 1 / d = inf
    (q = 0 by definition), one whose d is subnormal with 1 / d finite, an all-zero group, exact .5 ties."""
    from lane.cpu_pool.layer_call import _quantize

    n = 128
    h = np.random.default_rng(1).standard_normal(2 * n).astype(F32)
    h[0:32] = 0
    h[0:3] = [1e-38, -5e-39, 3e-39]
    h[32:64] = 0
    h[32:34] = [1e-36, -5e-37]
    h[64:96] = 0
    h[96:128] = np.arange(-16, 16, dtype=F32) * F32(0.5)
    qh, dh, hsum = np.empty(2 * n, np.int8), np.empty(2 * n // 32, F32), np.empty(2 * n // 32, F32)
    _quantize(h, 0, 2, n, qh, dh, hsum)
    q, d = canonical.quantize_act(h.reshape(2, n))
    np.testing.assert_array_equal(qh, q.reshape(-1))
    assert_bits(dh, d.reshape(-1))
    assert_bits(hsum, q.reshape(-1, 32).sum(axis=1).astype(F32))


@pytest.mark.parametrize("qtype", [T.IQ3_S, T.Q4_K, T.Q8_0, T.Q5_K, T.Q2_K, T.IQ2_S], ids=lambda t: t.name)
def test_exp_clamp_large_inputs(pools, seed, qtype):
    """Gate values far beyond the exp clamp (|g| > 88) on both sides, and large h in the down projection."""
    d_model, d_ff = TINY
    rng = np.random.default_rng([seed, int(qtype), 7])
    types = (qtype,) * 3
    layer = make_layer(rng, types, 3, d_model, d_ff, rms=(2.0, 2.0, 0.5))
    x = (rng.standard_normal((2, d_model)) * 300).astype(F32)
    qa, da = canonical.quantize_act(x)
    g = canonical.qdot(decode_int(qtype, layer[0][0]), qa, da)
    assert (g > 88).any() and (g < -87).any()  # the test does reach the clamp
    pairs = np.array([(0, 0), (1, 0), (1, 2)], np.int32)
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    out = run_all(pools, jobs)
    assert np.isfinite(out).all()
    assert_bits(out, reference(types, layer, pairs, qa, da))


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL,
                                   T.IQ4_XS, T.MXFP4, T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M],
                         ids=lambda t: t.name)
def test_block_scales_of_every_f16_kind(pools, seed, qtype):
    """The in-register block kernels form d (and dmin, m) from the f16 bits themselves: blocks whose d / dmin / m
    are subnormal, signed zeros, the smallest and largest normals and negative, one token an expert and three
    sharing (MXFP4: exponent bytes 0 and 1, the subnormal scales, and normal ones; IQ1_M: d's nibbles in the top
    nibbles of its four scale words)."""
    d_model, d_ff = TINY
    rng = np.random.default_rng([seed, int(qtype), 11])
    types = (qtype,) * 3
    layer = make_layer(rng, types, 2, d_model, d_ff)
    edges = np.array([0x0001, 0x03FF, 0x8001, 0x0000, 0x8000, 0x0400, 0x7BFF, 0xBC00, 0x3555, 0x83FF], np.uint16)
    at = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q4_0: (0,),
          T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}.get(qtype, (0,))
    for m in layer:
        blocks = m.reshape(-1, fmt(qtype).block_bytes)
        if qtype == T.MXFP4:  # one exponent a row: the rows of subnormal scales give outputs of their own
            rows = m.reshape(*m.shape[:2], -1, fmt(qtype).block_bytes)
            rows[:, :, :, 0] = np.array([0, 1, 2, 100, 126, 127, 128, 131], np.uint8)[np.arange(m.shape[1]) % 8, None]
        if qtype == T.IQ1_M:
            words = blocks[:, 48:56].copy().view(np.uint16)
            d = edges[np.arange(len(blocks)) % len(edges), None]
            words[:] = (words & 0x0FFF) | (((d >> np.arange(0, 16, 4, dtype=np.uint16)) & 15) << 12)
            blocks[:, 48:56] = words.view(np.uint8)
        for k, off in enumerate(() if qtype in (T.MXFP4, T.IQ1_M) else at):
            blocks[:, off:off + 2] = np.roll(edges, k)[np.arange(len(blocks)) % len(edges)].view(np.uint8).reshape(
                -1, 1, 2)[:, 0]
    qa, da = make_tokens(rng, 3, d_model)
    pairs = np.array([(0, 0), (1, 1), (2, 1), (0, 1)], np.int32)
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    assert_bits(run_all(pools, jobs), reference(types, layer, pairs, qa, da))


def test_multi_token_multi_expert(pools, seed):
    """A layer's job list for several tokens with shared experts: grouping (each weight row read once for all its
    tokens) gives the same bits as each pair alone and as canonical.expert."""
    d_model, d_ff = A3B
    rng = np.random.default_rng([seed, 11])
    types = (T.IQ3_S,) * 3
    layer = make_layer(rng, types, 8, d_model, d_ff)
    qa, da = make_tokens(rng, 4, d_model)
    ids = np.array([[3, 1, 6, 0], [1, 3, 2, 7], [6, 1, 5, 3], [0, 2, 1, 4]])  # top-4 of 8, tokens share experts
    pairs = np.stack([np.repeat(np.arange(4), 4), ids.reshape(-1)], axis=1).astype(np.int32)
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    out = run_all(pools, jobs)
    assert_bits(out, reference(types, layer, pairs, qa, da))
    alone = np.concatenate([pools[2].run(LayerJobs(*layer, *map(int, types), pairs[i:i + 1], qa, da))
                            for i in range(len(pairs))])
    assert_bits(out, alone)
    assert not np.any(out[pairs[:, 0] == 3])  # the all-zero token


@pytest.mark.parametrize("types", [(T.Q4_K, T.IQ3_S, T.Q8_0), (T.Q8_0, T.Q8_0, T.Q4_K), (T.IQ3_S, T.Q8_0, T.IQ3_S),
                                   (T.Q5_K, T.Q3_K, T.Q6_K), (T.Q2_K, T.IQ4_XS, T.Q4_1), (T.IQ2_XS, T.IQ1_M, T.Q5_0),
                                   (T.IQ2_S, T.IQ3_XXS, T.IQ4_NL), (T.IQ1_S, T.IQ2_XXS, T.Q5_1),
                                   (T.Q4_0, T.Q5_K, T.Q2_K), (T.MXFP4, T.MXFP4, T.Q8_0)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_mixed_types_several_tokens(pools, seed, types):
    """Gate, up and down of different types (different row sizes and decoded kinds: int8, uint8 with a minimum,
    Q2_K's mweights, int16), with tokens sharing experts (the multi-token paths)."""
    d_model, d_ff = TINY
    rng = np.random.default_rng([seed, 13, *map(int, types)])
    layer = make_layer(rng, types, 4, d_model, d_ff)
    qa, da = make_tokens(rng, 3, d_model)
    pairs = np.array([(0, 2), (1, 2), (2, 2), (1, 0), (0, 3), (2, 0)], np.int32)
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    assert_bits(run_all(pools, jobs), reference(types, layer, pairs, qa, da))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.MXFP4, T.F16, T.BF16, T.F32],
                         ids=lambda t: t.name)
def test_rows_not_multiple_of_256(pools, seed, qtype):
    """32-value block types and the float types, rows of 288 values: 8 blocks in the vector path, the 9th on the
    scalar path; rows of 96 (down): the scalar path only."""
    d_model, d_ff = 288, 96
    rng = np.random.default_rng([seed, 17, int(qtype)])
    types = (qtype,) * 3
    layer = make_layer(rng, types, 3, d_model, d_ff)
    qa, da = make_tokens(rng, 2, d_model)
    pairs = np.array([(0, 1), (1, 1), (1, 2)], np.int32)
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    assert_bits(run_all(pools, jobs), reference(types, layer, pairs, qa, da))


def test_from_model_file(pools, tiny_model):
    """Straight from the model file's read-only mapping (the arena's bytes), every expert of a layer."""
    m, layer = tiny_model, 1
    rng = np.random.default_rng(5)
    qa, da = canonical.quantize_act(rng.standard_normal((2, m.config.d_model)).astype(F32))
    pairs = np.array([(t, e) for e in range(m.config.n_expert) for t in range(2)], np.int32)
    jobs = LayerJobs.from_model(m, layer, pairs, qa, da)
    assert not jobs.gate.flags.writeable
    types = tuple(m.expert_type(layer, k) for k in ("gate", "up", "down"))
    assert_bits(run_all(pools, jobs), reference(types, (jobs.gate, jobs.up, jobs.down), pairs, qa, da))


def test_empty_and_bad_jobs(pools):
    rng = np.random.default_rng(0)
    types = (T.Q8_0,) * 3
    layer = make_layer(rng, types, 2, 256, 256)
    qa, da = make_tokens(rng, 1, 256)
    out = pools[2].run(LayerJobs(*layer, *map(int, types), np.zeros((0, 2), np.int32), qa, da))
    assert out.shape == (0, 256)
    with pytest.raises(ValueError, match="out of range"):
        pools[1].run(LayerJobs(*layer, *map(int, types), np.array([[0, 2]], np.int32), qa, da))
    with pytest.raises(ValueError, match="down"):
        pools[1].run(LayerJobs(*layer, *map(int, types[:2]), int(T.IQ3_S), np.array([[0, 1]], np.int32), qa, da))
    with pytest.raises(ValueError, match="qa"):
        pools[1].run(LayerJobs(*layer, *map(int, types), np.array([[0, 1]], np.int32), qa[:, :4], da))


def test_concurrent_callers(pools, seed):
    """Several Python threads may call pools at once (calls are serialised on the pool lock), same bits."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng([seed, 19])
    types = (T.IQ3_S,) * 3
    layer = make_layer(rng, types, 4, *TINY)
    qa, da = make_tokens(rng, 2, TINY[0])
    pairs = np.array([(0, 1), (1, 3), (1, 1)], np.int32)
    jobs = LayerJobs(*layer, *map(int, types), pairs, qa, da)
    want = pools[1].run(jobs)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda k: pools[k].run(jobs), [2, 1, 2, 1, 2, 2] * 3))
    for o in outs:
        assert_bits(o, want)
