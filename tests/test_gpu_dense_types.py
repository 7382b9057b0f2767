"""The GPU dense path on every tensor type (lane/kernels/decode.cuh through matvec.cu, gemm.cu, embedding.cu), and
the GPU card on llama.cpp mixes whose dense matrices are K- and I-quants.

Device only (marked `gpu`) except the first test: `python3 -m pytest -q -m gpu tests/test_gpu_dense_types.py`.
decode.cuh itself is checked bit for bit against stratad.model.quants on the host (tests/test_decode_cuh.py); here
the kernels that use it:
  mat-vec (rows packed at upload, and decode.cuh's per-type template): |y - y64| <= 1e-5 * (|W| @ |x|)
    elementwise, test_gpu_dense's bound; bits independent of the rows a warp takes (a row's sum order depends only
    on KS); Q4_K, Q5_K, Q6_K and IQ3_S rows read as the file holds them: the packed rows' bits on every plan, alone, with
    the norm folded in and as a pair of types in one launch;
  dequantised float16 copy (the prompt GEMM's operand): dequantize(...).astype(float16), bit for bit;
  embedding rows: dequantize(...), bit for bit; a bad id gives a NaN row.
Outputs are poisoned with NaN first; every test synchronises.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from lane.kernels.experts import check_model
from stratad.model import quants
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile

gpu = pytest.mark.gpu
F32 = np.float32
ALL = list(quants.FORMATS)
FAST = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ3_S)  # lane.kernels.device.FAST
PART_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.IQ3_S)  # read as the file holds them, decoded by decode.cuh's rq_part
# tiny: IQ3_S / IQ3_S / Q4_K / MXFP4 experts; dense IQ3_S, Q4_K, Q5_K, Q6_K, Q8_0
MIXES = ("iq3_s", "iq3_m", "q4_k_s", "mxfp4_moe")


def _ids(ts):
    return [t.name for t in ts]


@pytest.fixture(scope="module")
def mix_model(tmp_path_factory):
    models = {}

    def get(mix: str) -> ModelFile:
        if mix not in models:
            path = tmp_path_factory.mktemp("mix") / f"tiny-{mix}.gguf"
            make_model(path, "tiny", mix=mix, router_skew=1.0, seed=5)
            models[mix] = ModelFile(path)
        return models[mix]

    yield get
    for m in models.values():
        m.close()


@pytest.mark.parametrize("mix", MIXES)
def test_gpu_card_accepts_mixes_with_gpu_expert_types(mix_model, mix):
    """Host side: a mix whose experts the GPU expert kernels read passes the card's type check, its dense matrices
    of every type included (K- / I-quant dense matrices in each mix but mxfp4_moe, whose dense are Q8_0 and whose
    experts are MXFP4)."""
    m = mix_model(mix)
    dense = {ti.qtype for n, ti in m.tensors.items() if "_exps." not in n} - {T.F32}
    if mix == "mxfp4_moe":
        assert dense == {T.Q8_0} and {ti.qtype for n, ti in m.tensors.items() if "_exps." in n} == {T.MXFP4}
    else:
        assert dense - {T.F16, T.BF16, T.Q8_0}, f"{mix}: no K- or I-quant dense matrix"
    check_model(m)


# ---- kernels ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def D(cp):
    from lane.kernels import device

    for source in ("matvec.cu", "gemm.cu", "embedding.cu"):  # a compile error fails here, once
        device.module(source)
    return cp


def rand_raw(rng, qt, rows, cols):
    raw = quants.random_rows(qt, rng, rows, cols, 1 / np.sqrt(cols))
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)


def upload(cp, raw, qt, cols, aligned: bool):
    """A DenseWeight of host rows; aligned=False puts them 1 byte past a 16-byte boundary, so that the F32 / F16 /
    BF16 / Q8_0 fast paths decline them and decode.cuh's mat-vec runs."""
    from lane.kernels.weights import DenseWeight

    if aligned:
        return DenseWeight.upload(raw, qt, cols)
    buf = cp.zeros(raw.size + 16, cp.uint8)
    data = buf[1:1 + raw.size]
    data[...] = cp.asarray(raw.reshape(-1))
    W = DenseWeight(data, qt, cols, pack=False)  # the rows as the file holds them, not packed
    assert not W.fast
    return W


def bound_err(y, W64, x64, r=None):
    """max |y - y64| / (|W| @ |x|) elementwise (test_gpu_dense's measure)."""
    y64 = W64 @ x64 + (r.astype(np.float64) if r is not None else 0)
    b = np.abs(W64) @ np.abs(x64) + (np.abs(r) if r is not None else 0) + 1e-30
    return float(np.max(np.abs(y.astype(np.float64) - y64) / b))


def cols_for(qt, cols):
    return max(cols, quants.fmt(qt).block_values)


@gpu
@pytest.mark.parametrize("path", ["packed", "decode"])
@pytest.mark.parametrize("shape", [(130, 256), (512, 2048), (96, 768)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qt", ALL, ids=_ids(ALL))
def test_matvec_every_type(D, qt, shape, path):
    """packed: the quantised types off the fast paths (and Q4_K / Q5_K / Q6_K / IQ3_S rows the fast path declines) as the
    card reads them, rows packed at upload (weights.PackedRows) through the block ring, every plan of PLANS; decode:
    the rows as the file holds them through decode.cuh's mat-vec (pack=False, and the fast types 1 byte off
    alignment), every plan of DQ_PLANS."""
    from lane.kernels import matvec, weights
    from lane.kernels.weights import DenseWeight

    cp = D
    if path == "packed" and qt in FAST and quants.fmt(qt).row_bytes(shape[1]) % 16 == 0:
        pytest.skip("the fast paths read these rows as the file holds them (test_file_rows_are_the_packed_rows)")
    rng = np.random.default_rng([int(qt), *shape])
    rows, cols = shape
    raw = rand_raw(rng, qt, rows, cols)
    W64 = quants.dequantize(qt, raw).astype(np.float64)
    x = rng.standard_normal(cols, dtype=F32) * F32(2)
    r = rng.standard_normal(rows, dtype=F32)
    xd, rd = cp.asarray(x), cp.asarray(r)
    if path == "packed":
        W = DenseWeight.upload(raw, qt, cols)
        assert W.packed is not None and W.plan() in weights.PLANS
        packed = W.packed.data.get()
        assert np.array_equal(matvec.rq_values_ref(packed, W.packed.fmt), W64.astype(np.float32))
        plans = weights.PLANS
    elif qt in FAST:
        W = upload(cp, raw, qt, cols, aligned=False)
        plans = weights.DQ_PLANS
    else:
        W = DenseWeight.upload(raw, qt, cols, pack=False)
        assert not W.fast and W.packed is None and W.plan() in weights.DQ_PLANS
        plans = weights.DQ_PLANS
    by_ks: dict[int, np.ndarray] = {}
    for plan in (None,) + plans:
        y = cp.full(rows, np.nan, cp.float32)
        matvec.matvec(W, xd, y, plan=plan)
        yr = cp.full(rows, np.nan, cp.float32)
        matvec.matvec(W, xd, yr, residual=rd, plan=plan)
        yi = rd.copy()
        matvec.matvec(W, xd, yi, residual=yi, plan=plan)
        cp.cuda.Device().synchronize()
        got = y.get()
        assert np.isfinite(got).all(), plan
        assert bound_err(got, W64, x.astype(np.float64)) <= 1e-5, plan
        assert bound_err(yr.get(), W64, x.astype(np.float64), r) <= 1e-5, plan
        assert np.array_equal(yr.get(), yi.get()), plan
        again = cp.full(rows, np.nan, cp.float32)
        matvec.matvec(W, xd, again, plan=plan)
        assert np.array_equal(again.get(), got), f"{plan}: not deterministic"
        if plan is not None:
            ks = plan[1]
            if ks in by_ks:
                assert np.array_equal(by_ks[ks], got), f"{plan}: rows a warp changed a bit"
            by_ks[ks] = got


@gpu
@pytest.mark.parametrize("qt", ALL, ids=_ids(ALL))
def test_dequantized_every_type(D, qt):
    cp = D
    rng = np.random.default_rng([7, int(qt)])
    cols = cols_for(qt, 512)
    raw = rand_raw(rng, qt, 70, cols)
    W = upload(cp, raw, qt, cols, aligned=True)
    got = W.dequantized(cache=False).get()
    want = quants.dequantize(qt, raw).astype(np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"{np.sum(got != want)} values differ"


@gpu
@pytest.mark.parametrize("qt", ALL, ids=_ids(ALL))
def test_embed_every_type(D, qt):
    from lane.kernels import embedding

    cp = D
    rng = np.random.default_rng([8, int(qt)])
    vocab, d = 300, cols_for(qt, 768)
    raw = rand_raw(rng, qt, vocab, d)
    table = upload(cp, raw, qt, d, aligned=True)
    tokens = np.array([0, 299, 17, 17, 150, 300, -1], np.int32)
    out = cp.full((len(tokens), d), 7.0, cp.float32)
    embedding.embed(table, cp.asarray(tokens), out)
    got = out.get()
    want = embedding.embed_ref(raw, qt, tokens[:5])
    assert np.array_equal(got[:5].view(np.uint32), want.view(np.uint32))
    assert np.isnan(got[5:]).all()  # ids out of the table


@gpu
@pytest.mark.parametrize("qt", PART_TYPES, ids=_ids(PART_TYPES))
@pytest.mark.parametrize("shape", [(130, 2048), (2048, 4096), (96, 6144), (70, 1280)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_file_rows_are_the_packed_rows(D, qt, shape):
    """Q4_K / Q5_K / Q6_K / IQ3_S rows read as the file holds them (matvec.cuh FileBlk: a lane decodes its 8 values with
    decode.cuh's rq_part, tiles staged from the 16-byte boundary below them) give the packed rows' bits (the same
    terms on the same numbers), on every plan of PLANS, with a residual out of place and in place, and with the
    norm folded in on every plan norm_matvec takes; and stay within the dequantised product's bound. Shapes: tiles
    starting 8 bytes past a boundary (IQ3_S, Q6_K: 440 / 840 bytes a tile), a last tile of 8 sub-blocks (Q4_K at
    1280 columns, Q5_K too; the other two need cols % 2048 == 0 for 16-byte rows)."""
    from lane.kernels import matvec, weights
    from lane.kernels.weights import DenseWeight, PackedRows

    cp = D
    rows, cols = shape
    if quants.fmt(qt).row_bytes(cols) % 16:
        pytest.skip(f"{qt.name} rows of {cols} are not 16-byte rows: packed (test_matvec_every_type)")
    rng = np.random.default_rng([int(qt), *shape])
    raw = rand_raw(rng, qt, rows, cols)
    W = DenseWeight.upload(raw, qt, cols)
    assert W.fast and W.packed is None and W.plan() in weights.PLANS
    P = DenseWeight.upload(raw, qt, cols)
    P.packed = PackedRows.pack(P)  # the same rows through the packed path
    W64 = quants.dequantize(qt, raw).astype(np.float64)
    x = rng.standard_normal(cols, dtype=F32) * F32(2)
    r = rng.standard_normal(rows, dtype=F32)
    xd, rd = cp.asarray(x), cp.asarray(r)
    nw = cp.asarray(rng.uniform(0.5, 1.5, cols).astype(F32))

    def bits(a):
        return a.get().view(np.uint32)

    for plan in (None,) + weights.PLANS:  # None: the file rows' default plan (the packed rows' may differ)
        got, want = (matvec.matvec(M, xd, cp.full(rows, np.nan, cp.float32), residual=rd, plan=plan or W.plan())
                     for M in (W, P))
        inplace = rd.copy()
        matvec.matvec(W, xd, inplace, residual=inplace, plan=plan)
        cp.cuda.Device().synchronize()
        assert np.array_equal(bits(got), bits(want)), f"{plan}: file rows differ from packed rows"
        assert np.array_equal(bits(inplace), bits(got)), plan
        assert bound_err(got.get(), W64, x.astype(np.float64), r) <= 1e-5, plan
    if cols <= matvec.NORM_MV_MAX_N:
        for plan in (None,) + tuple(p for p in weights.PLANS if p[0] <= 2):
            got, want = (matvec.norm_matvec(M, xd, nw, 1e-6, cp.full(rows, np.nan, cp.float32), plan=plan or W.plan())
                         for M in (W, P))
            cp.cuda.Device().synchronize()
            assert np.array_equal(bits(got), bits(want)), f"norm {plan}: file rows differ from packed rows"


@gpu
@pytest.mark.parametrize("qt", PART_TYPES, ids=_ids(PART_TYPES))
@pytest.mark.parametrize("shape", [(4096, 2048), (2048, 4096), (512, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_to_packed_keeps_the_bits(D, qt, shape):
    """A layer's file rows packed later (DenseWeight.to_packed, what a card does where it has the memory) give the
    bits they gave before on their default plan: the plain mat-vec with a residual, the norm folded in and, for
    IQ3_S (the o projection's type in llama.cpp's IQ3 mixes), x on 8 bits."""
    from lane.kernels import matvec
    from lane.kernels.weights import DenseWeight

    cp = D
    rows, cols = shape
    rng = np.random.default_rng([int(qt), *shape, 5])
    raw = rand_raw(rng, qt, rows, cols)
    W = DenseWeight.upload(raw, qt, cols)
    x = cp.asarray(rng.standard_normal(cols, dtype=F32))
    r = cp.asarray(rng.standard_normal(rows, dtype=F32))
    nw = cp.asarray(rng.uniform(0.5, 1.5, cols).astype(F32))
    xq = cp.asarray(matvec.quantize_row(rng.standard_normal(cols, dtype=F32)))

    def run():
        out = [matvec.matvec(W, x, residual=r), matvec.norm_matvec(W, x, nw, 1e-6, residual=r)]
        if W.takes_qx:
            out.append(matvec.matvec(W, xq, residual=r, qx=True))
        cp.cuda.Device().synchronize()
        return [o.get().view(np.uint32) for o in out]

    assert W.fast and W.packed is None and (qt == T.IQ3_S) == W.takes_qx
    before = run()
    added = W.to_packed()
    assert added == W.packed.nbytes and not W.fast and W.to_packed() == 0 and (qt == T.IQ3_S) == W.takes_qx
    for i, (a, b) in enumerate(zip(before, run())):
        assert np.array_equal(a, b), ("plain", "norm", "qx")[i]


@gpu
@pytest.mark.parametrize("types", [(T.IQ3_S, T.Q4_K), (T.Q4_K, T.Q6_K), (T.Q5_K, T.Q6_K)],
                         ids=["iq3_s-q4_k", "q4_k-q6_k", "q5_k-q6_k"])
def test_pair_of_file_types_in_one_launch(D, types):
    """A llama.cpp mix's q and k of one type with attn_v of another (iq3_s: IQ3_S + Q4_K; q4_k_m: Q4_K + Q6_K) at
    the a3b shape: concat stacks q and k into one part and the pair runs in one norm_matvec launch (the first
    matrix's blocks, then the second's), the same bits as each part's own norm_matvec, on every plan of PAIR_PLANS,
    with a residual; the plain mat-vec runs a launch a part."""
    from lane.kernels import matvec, weights
    from lane.kernels.weights import DenseWeight, StackedWeight

    cp = D
    rng = np.random.default_rng(19)
    cols = 2048
    parts = [(types[0], 4096), (types[0], 512), (types[1], 512)]
    raws = [rand_raw(rng, qt, rows, cols) for qt, rows in parts]
    W = DenseWeight.concat([DenseWeight.upload(raw, qt, cols) for raw, (qt, _) in zip(raws, parts)])
    assert isinstance(W, StackedWeight) and W.pair and W.packed is None and len(W.parts) == 2
    assert [p.rows for p in W.parts] == [4608, 512] and all(p.fast for p in W.parts)
    assert matvec.norm_matvec_ok(W) and W.plan() in weights.PAIR_PLANS
    x = cp.asarray(rng.standard_normal(cols, dtype=F32))
    nw = cp.asarray(rng.uniform(0.5, 1.5, cols).astype(F32))
    r = cp.asarray(rng.standard_normal(W.rows, dtype=F32))
    for plan in (None,) + weights.PAIR_PLANS:
        y = matvec.norm_matvec(W, x, nw, 1e-6, cp.full(W.rows, np.nan, cp.float32), residual=r, plan=plan)
        want = cp.concatenate([matvec.norm_matvec(p, x, nw, 1e-6, residual=r[r0:r0 + p.rows], plan=plan or W.plan())
                               for p, r0 in W.row_slices()])
        cp.cuda.Device().synchronize()
        assert np.array_equal(y.get().view(np.uint32), want.get().view(np.uint32)), plan
    y = matvec.matvec(W, x)
    want = cp.concatenate([matvec.matvec(p, x) for p, _ in W.row_slices()])
    assert np.array_equal(y.get().view(np.uint32), want.get().view(np.uint32))
    W64 = np.concatenate([quants.dequantize(qt, raw) for raw, (qt, _) in zip(raws, parts)]).astype(np.float64)
    assert bound_err(y.get(), W64, x.get().astype(np.float64)) <= 1e-5
    # packed later (StackedWeight.to_packed): alike, one launch on the packed rows, the pair's bits on its plan
    before = matvec.norm_matvec(W, x, nw, 1e-6, residual=r)
    assert W.to_packed() == W.packed.nbytes and not W.pair and W.to_packed() == 0
    after = matvec.norm_matvec(W, x, nw, 1e-6, residual=r)
    cp.cuda.Device().synchronize()
    assert np.array_equal(before.get().view(np.uint32), after.get().view(np.uint32))


@gpu
def test_stacked_qkv_of_mixed_types(D):
    """q, k, v of different types off the file paths (iq3_xs's IQ3_XXS q and k with a Q4_K attn_v): concat stacks
    them, packed alike (the widest format of the parts, one launch); the mat-vec's rows are the parts' own packed
    the same way, bit for bit, and the float16 copy is the parts' copies one after the other."""
    from lane.kernels import gemm, matvec
    from lane.kernels import weights
    from lane.kernels.weights import DenseWeight, PackedRows, StackedWeight

    cp = D
    rng = np.random.default_rng(9)
    cols = 512
    parts = [(T.IQ3_XXS, 256), (T.IQ3_XXS, 128), (T.Q4_K, 128)]
    raws = [rand_raw(rng, qt, rows, cols) for qt, rows in parts]
    ws = [DenseWeight.upload(raw, qt, cols) for raw, (qt, _) in zip(raws, parts)]
    W = DenseWeight.concat(ws)
    assert isinstance(W, StackedWeight) and W.rows == 512 and not W.fast and not W.pair
    assert W.packed is not None and W.packed.fmt == (1, 1)  # IQ3_XXS's (1, 0) widened to Q4_K's minimum
    assert all(p.packed is None for p in W.parts)
    assert weights.rq_widest([(1, 1), (2, 0)]) == (2, 2)  # q4_k_m's Q4_K q / k and Q6_K v
    x = cp.asarray(rng.standard_normal(cols, dtype=F32))
    r = cp.asarray(rng.standard_normal(W.rows, dtype=F32))
    y = matvec.matvec(W, x, residual=r)
    for p in W.parts:  # q and k stacked as one part
        p.packed = PackedRows.pack(p, W.packed.fmt)
    want = cp.concatenate([matvec.matvec(p, x, residual=r[r0:r0 + p.rows]) for p, r0 in W.row_slices()])
    assert np.array_equal(y.get(), want.get())
    W64 = np.concatenate([quants.dequantize(qt, raw) for raw, (qt, _) in zip(raws, parts)]).astype(np.float64)
    assert bound_err(y.get(), W64, x.get().astype(np.float64), r.get()) <= 1e-5
    Wd = W.dequantized(cache=False).get()
    assert np.array_equal(Wd, np.concatenate([p.dequantized(cache=False).get() for p in ws]))
    X = rng.standard_normal((9, cols), dtype=F32)
    Y = gemm.dense_batched(W, cp.asarray(X), cache=True).get()
    ref = X.astype(np.float64) @ np.concatenate([quants.dequantize(qt, raw) for raw, (qt, _) in
                                                 zip(raws, parts)]).astype(np.float64).T
    assert np.linalg.norm(Y - ref) / np.linalg.norm(ref) <= 3e-3  # test_gpu_dense's fp16 GEMM bound


# ---- the GPU card on the mixes ----------------------------------------------------------------------------------

PROMPT = "The first chat talks about caches and slots, and the second one about routing."


@gpu
def test_gpu_card_packs_its_layers_with_the_same_bits(cp, tmp_path):
    """A card on an iq3_s mix of a3b-width layers (q and k IQ3_S with a Q4_K attn_v: a pair of file types; o IQ3_S
    on 8-bit x; a Q6_K head of more rows than a layer's plan covers) with [gpu] pack_layers on and off: packed, its
    layers and its head read packed rows (o still on 8-bit x), and a prompt's last logits and 8 greedy steps' are
    the file rows' bit for bit."""
    from lane.cupy_card import CupyCard
    from stratad.config import GpuOptions
    from stratad.model.config import ModelConfig

    c = ModelConfig(n_layer=2, d_model=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=8, n_expert_used=2,
                    d_ff_expert=768, vocab_size=17408, context_length=4096)
    path = tmp_path / "wide-iq3_s.gguf"
    make_model(path, c, mix="iq3_s", seed=3)
    m = ModelFile(path)
    prompt = list(range(3, 60))
    out = {}
    for pack in (False, True):
        card = CupyCard(m, 0, c.n_layer * c.n_expert, 1024, options=GpuOptions(pack_layers=pack))
        try:
            card.pool.fill([(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)])
            L = card.net.layers[0]
            head = card.net.out_w
            assert (L["o"].packed is not None) == (L["qkv"].packed is not None) == (head.packed is not None) == pack
            assert card.net.o_qx and head.qtype == T.Q6_K and head.rows >= 16384 and head.fast != pack
            kv = card.new_kv()
            rows = [card.forward(prompt, kv)[0]]
            for _ in range(8):
                rows.append(card.forward([int(rows[-1].argmax())], kv)[0])
            out[pack] = np.stack(rows)
        finally:
            card.close()
    assert np.array_equal(out[False].view(np.uint32), out[True].view(np.uint32))


@gpu
@pytest.mark.parametrize("mix", MIXES)
def test_gpu_card_on_a_mix(cp, mix_model, mix):
    """The card builds on the mix (K- / I-quant dense matrices, q/k/v of two types for iq3_m and q4_k_s), its
    greedy stream does not depend on where the experts are (exactness), and it follows the numpy card's: logits
    within test_gpu_card's bound of the canonical reference, the same argmax at >= 90 % of the prompt's positions
    (teacher-forced), and the greedy tokens printed side by side with the numpy card's."""
    from lane.cupy_card import CupyCard
    from lane.numpy_card import NumpyCard
    from lane.slot_pool import SlotPool
    from stratad.engine.generation import Generation
    from stratad.engine.reference import ReferenceEngine
    from stratad.engine.sampling import SamplingParams
    from stratad.model.slot_layout import slot_bytes

    m = mix_model(mix)
    c = m.config
    total = c.n_layer * c.n_expert
    order = [(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)]
    prompt = m.tokenizer.encode(PROMPT)

    def greedy(card, n=24):
        g = Generation(card, m.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True), c.context_length,
                       digest=True)
        return [t for t, _ in g if t is not None], g.digest.hexdigest()

    streams = {}
    for frac in (1.0, 0.5):
        card = CupyCard(m, 0, int(frac * total), 4096)
        card.pool.fill(order[:int(frac * total)])
        streams[frac] = greedy(card)
        if frac == 1.0:
            ours = card.forward(prompt, card.new_kv(), logits="all")
        card.close()
    assert streams[1.0][1] == streams[0.5][1], "placement changed a bit"
    ref = ReferenceEngine(m, "canonical")
    theirs = ref.forward(prompt, ref.new_kv(), logits="all")
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    agree = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    numpy_toks, _ = greedy(NumpyCard(m, SlotPool(m, np.zeros(slot_bytes(m), np.uint8), 0)))
    same = next((i for i, (a, b) in enumerate(zip(streams[1.0][0], numpy_toks)) if a != b), len(numpy_toks))
    print(f"{mix}: max |dlogit| / max |logit| {err:.2e}, prompt argmax agreement {agree:.3f}; greedy tokens equal "
          f"for {same} of {len(numpy_toks)}\n  gpu   {streams[1.0][0]}\n  numpy {numpy_toks}")
    assert err < 0.12
    assert agree >= 0.9
