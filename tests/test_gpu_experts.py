"""GPU expert kernels (lane/kernels/experts.cu) against stratad.engine.canonical, bit for bit.

Run on the device machine: `python3 -m pytest -q -m gpu tests/test_gpu_experts.py`. Without CuPy or a CUDA device the
GPU tests skip. Every comparison is of the float32 bit patterns (so -0.0 != +0.0), on fresh random inputs; outputs
are poisoned with NaN first so an unwritten element cannot pass.
"""
from __future__ import annotations

import re
import zlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from stratad.bench.experts import VARIANTS, arena_layer
from stratad.engine import canonical
from stratad.model.quants import decode_int, random_rows

pytestmark = pytest.mark.gpu

F32 = np.float32
CU = Path(__file__).resolve().parents[1] / "lane" / "kernels" / "experts.cu"


def bits_equal(got: np.ndarray, want: np.ndarray) -> tuple[bool, str]:
    got, want = np.ascontiguousarray(got, F32), np.ascontiguousarray(want, F32)
    if got.shape != want.shape:
        return False, f"shape {got.shape} != {want.shape}"
    g, w = got.view(np.uint32), want.view(np.uint32)
    bad = g != w
    if not bad.any():
        return True, ""
    idx = np.argwhere(bad)[:5]
    ex = ", ".join(f"{tuple(i)}: {got[tuple(i)]!r} vs {want[tuple(i)]!r}" for i in idx)
    ulp = np.abs(g[bad].astype(np.int64) - w[bad].astype(np.int64)).max()
    return False, f"{int(bad.sum())} of {bad.size} differ (max {ulp} ulp): {ex}"


def assert_bits(got, want, what):
    ok, msg = bits_equal(got, want)
    assert ok, f"{what}: {msg}"


# ---- CPU-side checks (no GPU needed) ----------------------------------------------------------------------------


def test_cu_exp_constants_are_canonical():
    """experts.cu's built-in defaults of canonical.exp's constants are the same float32 values (experts.py also
    passes them as defines, so this guards standalone builds of the source)."""
    src = CU.read_text()
    vals = dict(re.findall(r"#define (EXP_\w+) (\S+)", src))
    want = {"EXP_LOG2E": canonical.LOG2E, "EXP_LN2_HI": canonical.LN2_HI, "EXP_LN2_LO": canonical.LN2_LO}
    want.update({f"EXP_C{i}": v for i, v in enumerate(canonical.EXP_POLY)})
    for name, v in want.items():
        assert F32(float.fromhex(vals[name].rstrip("f"))) == v, name


# ---- helpers ------------------------------------------------------------------------------------------------------


def make_slots(rng, n_slots, d_model, d_ff, qgu, qdn):
    """Random valid experts: [(gate_raw, up_raw, down_raw)], scaled so gate/up outputs are O(1) (silu sees both
    signs and large magnitudes) and so are the down outputs."""
    def rows(qt, r, n, rms):  # uint8 (rows, row_bytes) for the float types too
        return np.ascontiguousarray(random_rows(qt, rng, r, n, rms)).view(np.uint8).reshape(r, -1)

    slots = []
    for _ in range(n_slots):
        s = float(rng.uniform(0.5, 2.0))
        slots.append((rows(qgu, d_ff, d_model, s / np.sqrt(d_model)), rows(qgu, d_ff, d_model, s / np.sqrt(d_model)),
                      rows(qdn, d_model, d_ff, 1.0 / np.sqrt(d_ff))))
    return slots


def random_x(rng, T_, n):
    """Activations with per-group magnitudes over several decades, one all-zero group and one with exact ties."""
    x = rng.standard_normal((T_, n), dtype=F32)
    x *= np.exp(rng.uniform(-4, 2, size=(T_, n // 32, 1))).astype(F32).repeat(32, axis=2).reshape(T_, n)
    x[0, :32] = 0.0
    if T_ > 1:
        x[1, :32] = F32(0.5) * np.arange(-16, 16, dtype=F32)  # amax 8 -> q = rint(x * 127/8): several .5 ties
        x[1, 0] = F32(127.0)
        x[1, 1:8] = np.array([2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 4.5], F32)  # d = 1 exactly: ties to even
    return x


def reference(slots, qgu, qdn, pairs, qa, da):
    """canonical h (silu(gate) * up), qh, dh and expert outputs for every pair, grouped by slot."""
    n = len(pairs)
    d_ff = slots[0][0].shape[0]
    d_model = slots[0][2].shape[0]
    h = np.zeros((n, d_ff), F32)
    out = np.zeros((n, d_model), F32)
    for s in sorted(set(int(p[1]) for p in pairs)):
        idx = [i for i, p in enumerate(pairs) if int(p[1]) == s]
        toks = [int(pairs[i][0]) for i in idx]
        g, u, dn = (decode_int(q, m) for q, m in zip((qgu, qgu, qdn), slots[s]))
        hh = canonical.silu(canonical.qdot(g, qa[toks], da[toks])) * canonical.qdot(u, qa[toks], da[toks])
        h[idx] = hh
        out[idx] = canonical.expert(g, u, dn, qa[toks], da[toks])
    qh, dh = canonical.quantize_act(h)
    return h, qh.reshape(n, d_ff), dh, out


def run_case(cp, rng, qgu, qdn, d_model, d_ff, n_slots, n_tokens, n_pairs, max_pairs, sort_by_slot=False,
             tuning=None, check_intermediates=True, tiled=False, host=False, smem=None):
    from lane.kernels.experts import ExpertKernels

    k = ExpertKernels(d_model, d_ff, qgu, qdn, max_pairs, tuning=tuning, smem=smem)
    slots = make_slots(rng, n_slots, d_model, d_ff, qgu, qdn)
    pool = cp.asarray(np.stack([k.pack_slot(*m) for m in slots]))
    where = pool.data.ptr
    if host:  # the kernels read the weights from host memory over the bus, in the arena's layout
        mem, args = arena_layer(cp, slots, gap=3 * 4096)  # unrelated offsets
        where = k.layout(*args)
    x = random_x(rng, n_tokens, d_model)
    qa_ref, da_ref = canonical.quantize_act(x)
    qa_ref = qa_ref.reshape(n_tokens, d_model)

    xg = cp.asarray(x)
    qa = cp.empty((n_tokens, d_model), cp.int8)
    da = cp.full((n_tokens, d_model // 32), np.nan, cp.float32)
    k.quantize(xg, qa, da)
    np.testing.assert_array_equal(qa.get(), qa_ref)
    assert_bits(da.get(), da_ref, "quantize da")

    pairs_np = np.stack([rng.integers(0, n_tokens, n_pairs), rng.integers(0, n_slots, n_pairs)], 1).astype(np.int32)
    if sort_by_slot or tiled:
        pairs_np = pairs_np[np.argsort(pairs_np[:, 1], kind="stable")]
    pad = np.full((max_pairs, 2), -1, np.int32)  # rows past n_pairs hold garbage: the kernels must not read them
    pad[:n_pairs] = pairs_np
    pairs = cp.asarray(pad)
    n_dev = cp.asarray(np.array([n_pairs], np.int32))
    out = cp.full((max_pairs, d_model), np.nan, cp.float32)
    k.h.fill(np.nan)
    if tiled:
        from lane.kernels.experts import max_tiles, tiles_ref

        tp = k.tile_p
        tl, n_t = tiles_ref(pairs_np[:, 1], max_tiles(max_pairs, n_slots, tp), tp)
        k.run_tiled(where, pairs, cp.asarray(tl), cp.asarray(np.array([n_t], np.int32)), qa, da, out)
    else:
        k.run(where, pairs, n_dev, qa, da, out)
    cp.cuda.get_current_stream().synchronize()

    h_ref, qh_ref, dh_ref, out_ref = reference(slots, qgu, qdn, pairs_np, qa_ref.reshape(n_tokens, -1, 32), da_ref)
    if check_intermediates:
        assert_bits(k.h[:n_pairs].get(), h_ref, f"h {qgu}/{qdn}")
        if tiled or not k.h_in_down:  # else the down kernel quantises h where it reads it
            np.testing.assert_array_equal(k.qh[:n_pairs].get(), qh_ref)
            assert_bits(k.dh[:n_pairs].get(), dh_ref, "dh")
    o = out.get()
    assert_bits(o[:n_pairs], out_ref, f"expert output {qgu}/{qdn} d_model={d_model} d_ff={d_ff}")
    assert np.isnan(o[n_pairs:]).all(), "rows past n_pairs were written"
    return k


# ---- GPU tests ----------------------------------------------------------------------------------------------------

# every tuning the bench offers (stratad bench --scenario experts --variants), and two more shapes of the launch
VARIANT_TUNINGS = [t for t in VARIANTS.values() if t] + [
    {"gu_warps": 4, "gu_min_blocks": 4, "iq3_fast": 0},
    {"dn_rows": 2, "dn_min_blocks": 1},
]

SHAPES = [
    # (gate/up type, down type, d_model, d_ff, slots, tokens, pairs, max_pairs)
    ("IQ3_S", "IQ3_S", 2048, 768, 10, 4, 24, 32),   # the a3b shape
    ("Q4_K", "Q4_K", 2048, 768, 10, 4, 24, 32),
    ("Q8_0", "Q8_0", 2048, 768, 10, 4, 24, 32),
    ("IQ3_S", "Q4_K", 1280, 512, 6, 3, 17, 20),     # 40 sub-blocks per gate row: a partial second lane chunk
    ("Q8_0", "IQ3_S", 512, 1024, 6, 3, 17, 20),     # down rows of exactly 32 sub-blocks
    ("Q4_K", "Q8_0", 256, 96, 5, 3, 9, 9),          # tiny rows (8 and 3 sub-blocks), n_pairs == max_pairs
]


@pytest.mark.parametrize("qgu,qdn,d_model,d_ff,n_slots,n_tok,n_pairs,max_pairs", SHAPES,
                         ids=[f"{s[0]}-{s[1]}-{s[2]}x{s[3]}" for s in SHAPES])
def test_expert_bits(cp, qgu, qdn, d_model, d_ff, n_slots, n_tok, n_pairs, max_pairs):
    run_case(cp, np.random.default_rng(zlib.crc32(f"{qgu}{qdn}{d_model}".encode())), getattr(T, qgu), getattr(T, qdn),
             d_model, d_ff, n_slots, n_tok, n_pairs, max_pairs)


@pytest.mark.parametrize("sort_by_slot", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("qt", ["IQ3_S", "Q4_K", "Q8_0"])
def test_many_pairs_few_slots(cp, qt, sort_by_slot):
    """A prefill-sized batch: 1000 pairs over 5 slots and 16 tokens, so blocks loop over many items."""
    run_case(cp, np.random.default_rng(7), getattr(T, qt), getattr(T, qt), 256, 256, 5, 16, 1000, 1024,
             sort_by_slot=sort_by_slot, check_intermediates=(qt == "IQ3_S"))


@pytest.mark.parametrize("qgu,qdn,d_model,d_ff,n_slots,n_tok,n_pairs,max_pairs", SHAPES,
                         ids=[f"{s[0]}-{s[1]}-{s[2]}x{s[3]}" for s in SHAPES])
def test_tiled_expert_bits(cp, qgu, qdn, d_model, d_ff, n_slots, n_tok, n_pairs, max_pairs):
    """The tiled kernels (a weight sub-block decoded once per tile of pairs of one expert; on tensor cores where
    the shape allows) give canonical's bits, for tiles of every length."""
    run_case(cp, np.random.default_rng(zlib.crc32(f"tiled{qgu}{qdn}{d_model}".encode())), getattr(T, qgu),
             getattr(T, qdn), d_model, d_ff, n_slots, n_tok, n_pairs, max_pairs, tiled=True)


@pytest.mark.parametrize("tiled", [False, True], ids=["decode", "tiled"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[4], SHAPES[5]], ids=lambda s: f"{s[0]}-{s[1]}-{s[2]}x{s[3]}")
def test_experts_read_from_host_memory(cp, shape, tiled):
    """Weights in page-locked host memory, laid out as the arena's GGUF tensors (gate, up and down apart), read by
    the kernels over the bus: canonical's bits, as from a slot."""
    qgu, qdn, d_model, d_ff, n_slots, n_tok, n_pairs, max_pairs = shape
    run_case(cp, np.random.default_rng(zlib.crc32(f"host{qgu}{qdn}{d_model}{tiled}".encode())), getattr(T, qgu),
             getattr(T, qdn), d_model, d_ff, n_slots, n_tok, n_pairs, max_pairs, tiled=tiled, host=True)


@pytest.mark.parametrize("qgu,qdn", [("IQ3_S", "IQ3_S"), ("Q4_K", "Q8_0")])
def test_fetch_experts_is_fetch_ref(cp, qgu, qdn):
    """A decode step's arena experts fetched into staging slots on the card (fetch.cu) = fetch_ref's bytes, pairs
    past the slots left alone; then the expert kernels on the staging slots give canonical's bits, as in place."""
    from lane.kernels.experts import ExpertKernels, Layout
    from lane.kernels.fetch import fetch_experts, fetch_ref

    rng = np.random.default_rng(zlib.crc32(f"fetch{qgu}{qdn}".encode()))
    k = ExpertKernels(2048, 768, getattr(T, qgu), getattr(T, qdn), 32)
    slots = make_slots(rng, 12, 2048, 768, getattr(T, qgu), getattr(T, qdn))
    mem, args = arena_layer(cp, slots, gap=4096)
    src = k.layout(*args)
    n_slots = 8
    stage = cp.full((n_slots * k.slot_stride,), 0xA5, cp.uint8)
    staged = k.slots(stage.data.ptr)
    host = np.frombuffer(mem, np.uint8)
    off = lambda lay, at: Layout(lay.base - at, lay.stride, lay.up_off, lay.down - at, lay.down_stride)  # noqa: E731
    for n in (0, 3, 8, 11):  # 11 > n_slots: the first 8 only
        pairs_np = np.full((32, 2), -1, np.int32)
        pairs_np[:n] = np.stack([rng.integers(0, 4, n), rng.permutation(12)[:n]], 1)
        pairs_out = cp.full((32, 2), -7, cp.int32)
        before = stage.get()
        fetch_experts(cp.asarray(pairs_np), cp.asarray(np.array([n], np.int32)), src, staged, k.gate_bytes,
                      k.down_bytes, pairs_out, n_slots)
        want, want_pairs = fetch_ref(host, before, pairs_np, n, off(src, host.ctypes.data), off(staged, stage.data.ptr),
                                     k.gate_bytes, k.down_bytes, n_slots)
        np.testing.assert_array_equal(stage.get(), want)
        m = min(n, n_slots)
        np.testing.assert_array_equal(pairs_out.get()[:m], want_pairs)
        assert (pairs_out.get()[m:] == -7).all()
    # gate and up first, then down (a decode step's two launches): the same bytes, the pair list from the first
    split = cp.full_like(stage, 0x5A)
    split_pairs = cp.full((32, 2), -7, cp.int32)
    n_dev = cp.asarray(np.array([11], np.int32))
    for parts in ("gate_up", "down"):
        fetch_experts(cp.asarray(pairs_np), n_dev, src, k.slots(split.data.ptr), k.gate_bytes, k.down_bytes,
                      split_pairs, n_slots, parts)
        if parts == "gate_up":
            assert (split_pairs.get() == pairs_out.get()).all()
    used = 2 * k.gate_bytes + k.down_bytes  # of each slot (the rest of a slot is padding)
    np.testing.assert_array_equal(split.get().reshape(n_slots, -1)[:, :used],
                                  stage.get().reshape(n_slots, -1)[:, :used])
    # the staged experts computed where they are: the host-memory case's bits
    x = random_x(rng, 4, 2048)
    qa_ref, da_ref = canonical.quantize_act(x)
    qa, da = cp.empty((4, 2048), cp.int8), cp.empty((4, 64), cp.float32)
    k.quantize(cp.asarray(x), qa, da)
    n_dev = cp.asarray(np.array([n_slots], np.int32))
    out = cp.full((32, 2048), np.nan, cp.float32)
    k.run(staged, pairs_out, n_dev, qa, da, out)
    _, _, _, out_ref = reference(slots, getattr(T, qgu), getattr(T, qdn), pairs_np[:n_slots],
                                 qa_ref.reshape(4, -1, 32), da_ref)
    assert_bits(out.get()[:n_slots], out_ref, f"staged experts {qgu}/{qdn}")
    # a layer's guess fetched ahead into slots 0 .. 1 (a cap of 2 of its 3), then the layer's own pairs from slot 2
    # on, gate/up and down apart: a pair whose expert was fetched ahead takes that slot and is not copied again
    src0, dst0 = off(src, host.ctypes.data), off(staged, stage.data.ptr)
    guess_np = np.full((32, 2), -1, np.int32)
    guess_np[:3] = [[0, 5], [0, 2], [0, 4]]
    guess = (cp.asarray(guess_np), cp.asarray(np.array([3], np.int32)), 2)
    before = stage.get()
    fetch_experts(guess[0], guess[1], src, staged, k.gate_bytes, k.down_bytes, cp.zeros((32, 2), cp.int32), 2)
    own_np = np.full((32, 2), -1, np.int32)
    own_np[:4] = [[0, 2], [0, 1], [0, 4], [0, 5]]
    own_out = cp.full((32, 2), -7, cp.int32)
    for parts in ("gate_up", "down"):
        fetch_experts(cp.asarray(own_np), cp.asarray(np.array([4], np.int32)), src, staged, k.gate_bytes,
                      k.down_bytes, own_out, 4, parts, staged=guess, slot_base=2)
    want, _ = fetch_ref(host, before, guess_np, 3, src0, dst0, k.gate_bytes, k.down_bytes, 2)
    want, want_pairs = fetch_ref(host, want, own_np, 4, src0, dst0, k.gate_bytes, k.down_bytes, 4,
                                 staged=(guess_np, 3, 2), slot_base=2)
    np.testing.assert_array_equal(stage.get(), want)
    np.testing.assert_array_equal(own_out.get()[:4], want_pairs)
    assert want_pairs[:, 1].tolist() == [1, 3, 4, 0]


def test_layout_checks(cp):
    from lane.kernels.experts import ExpertKernels

    k = ExpertKernels(256, 96, T.Q4_K, T.Q8_0, 4)
    assert k.slots(4096) == k.layout(4096, k.slot_stride, 4096 + k.gate_bytes, 4096 + 2 * k.gate_bytes, k.slot_stride)
    with pytest.raises(ValueError, match="16-byte aligned"):
        k.layout(4096 + 8, k.gate_bytes, 8192, 16384, k.down_bytes)
    with pytest.raises(ValueError, match="shorter than an expert"):
        k.layout(4096, k.gate_bytes - 16, 8192, 16384, k.down_bytes)


@pytest.mark.parametrize("prompt", ["mma", "simt"])
@pytest.mark.parametrize("qt", ["IQ3_S", "Q4_K", "Q8_0"])
def test_tiled_prefill_batch(cp, qt, prompt):
    """A prompt chunk's shape: 1000 pairs over 5 slots and 16 tokens: long runs cut into full tiles."""
    from lane.kernels.experts import Tuning

    k = run_case(cp, np.random.default_rng(8), getattr(T, qt), getattr(T, qt), 256, 256, 5, 16, 1000, 1024,
                 tiled=True, check_intermediates=(qt == "IQ3_S"), tuning=Tuning(prompt=prompt))
    assert k.mma == (prompt == "mma")


@pytest.mark.parametrize("qgu,qdn,mt", [("IQ3_S", "IQ3_S", 4), ("Q4_K", "Q4_K", 4), ("IQ3_S", "Q8_0", 4),
                                       ("Q8_0", "Q8_0", 2)])
def test_mma_tiles_a3b_shape(cp, qgu, qdn, mt):
    """The a3b expert shape on tensor cores: 700 pairs of 300 tokens over 6 experts (full tiles, a short last tile
    each; several items of one tile in a block), every bit of h, qh, dh and the output; Q8_0's gate/up rows leave
    room for tiles of 32 pairs."""
    k = run_case(cp, np.random.default_rng(21), getattr(T, qgu), getattr(T, qdn), 2048, 768, 6, 300, 700, 768,
                 tiled=True)
    assert k.mma and k.mma_mt == mt and k.tile_p == 16 * mt


def test_variants(cp):
    """The other launch shapes the benchmark compares compute the same bits, per pair and tiled."""
    from lane.kernels.experts import Tuning

    rng = np.random.default_rng(11)
    for t in VARIANT_TUNINGS:
        run_case(cp, rng, T.IQ3_S, T.IQ3_S, 2048, 768, 6, 4, 20, 24, tuning=Tuning(**t))
        run_case(cp, rng, T.IQ3_S, T.IQ3_S, 2048, 768, 3, 20, 90, 96, tuning=Tuning(**t), tiled=True)
    run_case(cp, rng, T.Q8_0, T.Q4_K, 512, 256, 4, 8, 300, 320, tuning=Tuning(gu_warps=32, gu_min_blocks=1,
                                                                               gu_stages=2, dn_rows=1))


def test_quantize_edges(cp):
    """quantize_rows at canonical.quantize_act's edges: a group whose d is subnormal with 1 / d = inf (q = 0 by
    definition, not a cast of inf), one whose d is subnormal with 1 / d finite, an all-zero group, exact .5 ties."""
    from lane.kernels.experts import ExpertKernels

    k = ExpertKernels(256, 256, "IQ3_S", "IQ3_S", 8)
    x = np.random.default_rng(4).standard_normal((2, 256)).astype(F32)
    x[0, 0:32] = 0
    x[0, 0:3] = [1e-38, -5e-39, 3e-39]
    x[0, 32:64] = 0
    x[0, 32:34] = [1e-36, -5e-37]
    x[0, 64:96] = 0
    x[1, 0:32] = np.arange(-16, 16, dtype=F32) * F32(0.5)
    qa, da = cp.empty((2, 256), cp.int8), cp.empty((2, 8), cp.float32)
    k.quantize(cp.asarray(x), qa, da)
    q_ref, d_ref = canonical.quantize_act(x)
    np.testing.assert_array_equal(qa.get(), q_ref.reshape(2, 256))
    assert_bits(da.get(), d_ref, "d")


def test_down_kernel_combines_a_decode_step(cp):
    """run(combine=) for one token whose k experts are all in one pool: the residual gains exactly combine_rows'
    sum of the k rows in router order, and the rows are those of the launch without it; the tuned types and generic
    ones (Q6_K, IQ2_XS with its tables, F16's float view), h quantised by either kernel, 4 / 8 / 16 experts a token
    (block items of 4 / 2 / 1 chunks of each pair); a k the kernel's shape cannot fold is refused."""
    from lane.kernels.experts import ExpertKernels, Tuning, combine_rows_ref

    rng = np.random.default_rng(21)
    d_model, d_ff, n_slots, P = 2048, 768, 16, 32
    for qt, dn_rows, K, hd in ((T.IQ3_S, 4, 8, 1), (T.IQ3_S, 4, 8, 0), (T.Q4_K, 2, 8, 1), (T.Q4_K, 2, 8, 2),
                               (T.Q8_0, 8, 4, 1), (T.Q6_K, 4, 16, 1), (T.IQ2_XS, 2, 8, 1), (T.F16, 8, 8, 1)):
        k = ExpertKernels(d_model, d_ff, qt, qt, P, tuning=Tuning(dn_rows=dn_rows, h_in_down=hd))
        slots = make_slots(rng, n_slots, d_model, d_ff, qt, qt)
        pool = cp.asarray(np.stack([k.pack_slot(*m) for m in slots]))
        qa, da = cp.empty((1, d_model), cp.int8), cp.empty((1, d_model // 32), cp.float32)
        k.quantize(cp.asarray(random_x(rng, 1, d_model)), qa, da)
        for _ in range(2):
            chosen = rng.choice(n_slots, K, replace=False)  # router order
            order = np.argsort(chosen)  # the pair list groups by expert, as build_pairs does
            pad = np.full((P, 2), -1, np.int32)
            pad[:K] = np.stack([np.zeros(K, np.int32), chosen[order]], 1)
            rowmap = np.empty(K, np.int32)
            rowmap[order] = np.arange(K, dtype=np.int32)  # entry j's row
            w = rng.dirichlet(np.ones(K)).astype(F32)[None]
            x0 = rng.standard_normal((1, d_model), dtype=F32)
            out, x = cp.full((P, d_model), np.nan, cp.float32), cp.asarray(x0)
            pairs, n = cp.asarray(pad), cp.asarray(np.array([K], np.int32))
            k.run(pool.data.ptr, pairs, n, qa, da, out, combine=(cp.asarray(rowmap), cp.asarray(w), x))
            plain = cp.full((P, d_model), np.nan, cp.float32)
            k.run(pool.data.ptr, pairs, n, qa, da, plain)
            cp.cuda.get_current_stream().synchronize()
            rows = out.get()
            assert_bits(rows[:K], plain.get()[:K], f"rows with the combine folded {qt}")
            assert_bits(x.get(), combine_rows_ref(x0, w, [rows[r] for r in rowmap]), f"combine in down {qt}")
    with pytest.raises(ValueError, match="does not fold"):  # 16 warps: 12 experts a token is not a block item
        k.run(pool.data.ptr, pairs, n, qa, da, out, combine=(cp.asarray(np.arange(12, dtype=np.int32)),
                                                            cp.asarray(np.full((1, 12), 1 / 12, F32)), x))


def test_combine_bits(cp):
    from lane.kernels.experts import ExpertKernels

    rng = np.random.default_rng(3)
    k = ExpertKernels(256, 256, "IQ3_S", "IQ3_S", 8)
    for T_, K, D in ((5, 8, 2048), (3, 4, 256), (1, 1, 32)):
        y = (rng.standard_normal((T_, K, D), dtype=F32) * rng.uniform(0.01, 10, (T_, K, 1)).astype(F32)).astype(F32)
        w = rng.dirichlet(np.ones(K), T_).astype(F32)
        out = cp.full((T_, D), np.nan, cp.float32)
        k.combine(cp.asarray(y), cp.asarray(w), out)
        assert_bits(out.get(), canonical.combine(w, y), f"combine {T_}x{K}x{D}")


def test_graph_replay(cp):
    """quantize + run + combine captured once in a CUDA graph, replayed with new inputs, pair lists and counts."""
    from lane.kernels.experts import ExpertKernels

    rng = np.random.default_rng(5)
    d_model, d_ff, K, TT, P = 512, 256, 4, 6, 32
    qt = T.IQ3_S
    k = ExpertKernels(d_model, d_ff, qt, qt, P)
    slots = make_slots(rng, 9, d_model, d_ff, qt, qt)
    pool = cp.asarray(np.stack([k.pack_slot(*m) for m in slots]))
    x = cp.empty((TT, d_model), cp.float32)
    qa = cp.empty((TT, d_model), cp.int8)
    da = cp.empty((TT, d_model // 32), cp.float32)
    pairs = cp.zeros((P, 2), cp.int32)
    n_dev = cp.zeros((1,), cp.int32)
    out = cp.empty((P, d_model), cp.float32)
    w = cp.empty((TT, K), cp.float32)
    y = cp.empty((TT, d_model), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        k.quantize(x, qa, da, stream=stream)
        k.run(pool.data.ptr, pairs, n_dev, qa, da, out, stream=stream)
        k.combine(out[:TT * K].reshape(TT, K, d_model), w, y, stream=stream)
        graph = stream.end_capture()
    for n_tok in (6, 2):  # a full batch, then fewer tokens: same graph, smaller device-side count
        xs = random_x(rng, TT, d_model)
        experts = np.stack([rng.choice(len(slots), K, replace=False) for _ in range(TT)])
        pr = np.zeros((P, 2), np.int32)
        pr[:TT * K, 0] = np.repeat(np.arange(TT), K)
        pr[:TT * K, 1] = experts.reshape(-1)
        ww = rng.dirichlet(np.ones(K), TT).astype(F32)
        x.set(xs)
        pairs.set(pr)
        n_dev.set(np.array([n_tok * K], np.int32))
        w.set(ww)
        out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        qa_ref, da_ref = canonical.quantize_act(xs)
        _, _, _, out_ref = reference(slots, qt, qt, pr[:n_tok * K], qa_ref, da_ref)
        o = out.get()
        assert_bits(o[:n_tok * K], out_ref, f"graph replay outputs ({n_tok} tokens)")
        yr = canonical.combine(ww[:n_tok], out_ref.reshape(n_tok, K, d_model))
        assert_bits(y.get()[:n_tok], yr, "graph replay combine")


def check_pairs(ids, src, slot, got_pairs, got_n, rm, miss, n_miss, P, by_entry: bool = False):
    """build_pairs' contract: every routed entry's row (a source's pair or a CPU miss) holds (token, slot or
    expert); each source's pairs are grouped by expert, ascending (by_entry: in entry order)."""
    from lane.kernels.experts import build_pairs_ref

    n = ids.size
    assert int(got_n.sum()) + int(n_miss[0]) == n
    assert len(set(rm.tolist())) == n, "two entries share a row"
    flat = ids.reshape(-1)
    for i, (s, t, v) in enumerate(build_pairs_ref(ids, src, slot)):
        r = int(rm[i])
        if s >= 0:
            assert r // P == s and r % P < got_n[s] and tuple(got_pairs[s, r % P]) == (t, v), (i, r)
        else:
            assert 0 <= -1 - r < n_miss[0] and tuple(miss[-1 - r]) == (t, v), (i, r)
    for s in range(len(got_n)):  # each source's pairs grouped by expert, ascending (or by entry)
        key_of_row = {int(r) % P: i if by_entry else int(flat[i]) for i, r in enumerate(rm) if r >= 0 and r // P == s}
        seq = [key_of_row[p] for p in range(int(got_n[s]))]
        assert seq == sorted(seq)


def test_route_pairs_is_route_then_build_pairs(cp):
    """A decode step's fused router + pair lists: ids and weights with router.route's bits (the same logits), the
    pair lists with build_pairs' contract; experts on several sources and on none."""
    from lane.gpu_experts import pinned
    from lane.kernels import router
    from lane.kernels.experts import ExpertKernels

    rng = np.random.default_rng(17)
    n_expert, K, S = 128, 8, 3
    k = ExpertKernels(256, 256, "IQ3_S", "IQ3_S", 64)
    miss, n_miss = pinned((K, 2), np.int32), pinned((1,), np.int32)
    for trial in range(20):
        logits = cp.asarray((rng.standard_normal((1, n_expert)) * rng.uniform(0.5, 8)).astype(F32))
        want_ids, want_w = router.route(logits, K)
        src = rng.integers(-1, S, n_expert).astype(np.int32)
        slot = rng.integers(0, 1000, n_expert).astype(np.int32)
        ids, w = cp.full((1, K), -7, cp.int32), cp.full((1, K), np.nan, cp.float32)
        pairs, n_pairs = cp.full((S, 64, 2), -7, cp.int32), cp.full((S,), -7, cp.int32)
        rowmap = cp.full((64,), 1 << 30, cp.int32)
        miss[:] = -7
        n_miss[0] = -7
        k.route_pairs(logits, K, ids, w, cp.asarray(src), cp.asarray(slot), pairs, n_pairs, rowmap,
                      miss.ctypes.data, n_miss.ctypes.data, K)
        cp.cuda.get_current_stream().synchronize()
        np.testing.assert_array_equal(ids.get(), want_ids.get())
        np.testing.assert_array_equal(w.get().view(np.uint32), want_w.get().view(np.uint32))
        check_pairs(ids.get(), src, slot, pairs.get(), n_pairs.get(), rowmap.get()[:K], miss, n_miss, 64)
        # by weight (a guess fetched ahead under a cap): the same rows, each source's list in router order
        n_miss[0] = -7
        k.route_pairs(logits, K, ids, w, cp.asarray(src), cp.asarray(slot), pairs, n_pairs, rowmap,
                      miss.ctypes.data, n_miss.ctypes.data, K, by_weight=True)
        cp.cuda.get_current_stream().synchronize()
        np.testing.assert_array_equal(ids.get(), want_ids.get())
        check_pairs(ids.get(), src, slot, pairs.get(), n_pairs.get(), rowmap.get()[:K], miss, n_miss, 64,
                    by_entry=True)
        # every expert on some source and no host list (null pointers, as where no host serves misses)
        src = np.maximum(src, 0)
        n_miss[0] = -7
        k.route_pairs(logits, K, ids, w, cp.asarray(src), cp.asarray(slot), pairs, n_pairs, rowmap, 0, 0, 0)
        cp.cuda.get_current_stream().synchronize()
        assert n_miss[0] == -7
        check_pairs(ids.get(), src, slot, pairs.get(), n_pairs.get(), rowmap.get()[:K], miss, np.zeros(1, np.int32),
                    64)


def test_build_pairs_rowmap_and_combine_rows(cp):
    """Routed ids -> per-source pair lists (grouped by expert), row map and CPU miss list in mapped host memory;
    combine_rows through that map adds exactly canonical.combine to the residual; the doorbell counts up."""
    from lane.gpu_experts import pinned
    from lane.kernels.experts import ExpertKernels, combine_rows_ref, max_tiles

    rng = np.random.default_rng(13)
    d_model, K, n_expert, S = 256, 8, 64, 3
    P = 200 * K
    k = ExpertKernels(d_model, 256, "IQ3_S", "IQ3_S", P)
    miss, n_miss = pinned((P, 2), np.int32), pinned((1,), np.int32)
    host_rows = pinned((P, d_model), np.float32)
    for T_, tiled in ((1, True), (1, False), (4, False), (7, True), (7, False), (200, True)):
        ids = np.stack([rng.choice(n_expert, K, replace=False) for _ in range(T_)]).astype(np.int32)
        src = rng.integers(-1, S, n_expert).astype(np.int32)
        slot = rng.integers(0, 1000, n_expert).astype(np.int32)
        pairs = cp.full((S, P, 2), -7, cp.int32)
        n_pairs = cp.full((S,), -7, cp.int32)
        rowmap = cp.full((P,), 1 << 30, cp.int32)
        miss[:] = -7
        n_miss[0] = -7
        mt = max_tiles(P, n_expert)
        tiles = cp.full((S, mt, 2), -7, cp.int32)
        n_tiles = cp.full((S,), -7, cp.int32)
        k.build_pairs(cp.asarray(ids), cp.asarray(src), cp.asarray(slot), pairs, n_pairs, rowmap,
                      miss.ctypes.data, n_miss.ctypes.data, P, tiles if tiled else None, n_tiles if tiled else None)
        cp.cuda.get_current_stream().synchronize()  # (no tiles: one warp ranks the entries, a decode step's path)
        got_pairs, got_n, rm = pairs.get(), n_pairs.get(), rowmap.get()[:T_ * K]
        for s_ in range(S if tiled else 0):  # the tiles cover each source's pairs in order, one expert's pairs each
            tl = tiles.get()[s_, :int(n_tiles.get()[s_])]
            assert tl[:, 1].min(initial=1) >= 1 and tl[:, 1].max(initial=1) <= k.tile_p
            assert np.array_equal(np.concatenate([np.arange(a, a + c) for a, c in tl] or [np.zeros(0, int)]),
                                  np.arange(int(got_n[s_])))
            for a, c in tl:
                assert len(set(got_pairs[s_, a:a + c, 1].tolist())) == 1
        check_pairs(ids, src, slot, got_pairs, got_n, rm, miss, n_miss, P)
        no_miss = np.maximum(src, 0)  # every expert on some source, no host list (null pointers)
        n_miss[0] = -7
        k.build_pairs(cp.asarray(ids), cp.asarray(no_miss), cp.asarray(slot), pairs, n_pairs, rowmap, 0, 0, 0,
                      tiles if tiled else None, n_tiles if tiled else None)
        cp.cuda.get_current_stream().synchronize()
        assert n_miss[0] == -7
        check_pairs(ids, no_miss, slot, pairs.get(), n_pairs.get(), rowmap.get()[:T_ * K], miss,
                    np.zeros(1, np.int32), P)

        rows = rng.standard_normal((S * P, d_model), dtype=F32)
        host_rows[:] = rng.standard_normal((P, d_model), dtype=F32)
        x = rng.standard_normal((T_, d_model), dtype=F32)
        w = rng.dirichlet(np.ones(K), T_).astype(F32)
        xg = cp.asarray(x)
        k.combine_rows(cp.asarray(rows), host_rows.ctypes.data, cp.asarray(rm), cp.asarray(w), xg)
        gathered = [rows[r] if r >= 0 else host_rows[-1 - r] for r in rm]
        assert_bits(xg.get(), combine_rows_ref(x, w, gathered), f"combine_rows T={T_}")

    counter, bell = cp.zeros((1,), cp.uint32), pinned((1,), np.uint32)
    bell[0] = 0
    for j in (1, 2, 3):
        k.ring(counter, bell.ctypes.data)
        cp.cuda.get_current_stream().synchronize()
        assert int(bell[0]) == j
