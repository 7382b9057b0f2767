"""The CPU pool: threads that compute the experts no card holds, straight from the arena's raw GGUF bytes.

Every output bit equals `stratad.engine.canonical.expert` on `decode_int` of the same rows (docs/design.md, exactness),
for every expert type. Every type has a kernel reading its raw GGUF blocks (gate / up / down may each be any type:
llama.cpp's mixes): IQ3_S / Q4_K / Q8_0 decode in vector registers; every other type, the float ones (F32 / F16 /
BF16) included, goes through one mechanism, a per-type decoder filling a block's integer view in small buffers and
one row loop over them (`_rows_dec`), where a block that one token reads is decoded in registers instead (a block
kernel per type: `_blk_*`). The kernels form exact integer sub-block dots, scale each term as
`(scale_b * d_b) * isum_b [- (minimum_b * d_b) * msum_b]` in float32 (every op rounded on its own: no fastmath, so
LLVM never contracts to FMA or reassociates), sum terms in the canonical warp order (virtual lane l adds terms
l, l+32, ... to 0.0, then folds 16, 8, 4, 2, 1), apply SwiGLU with the canonical float32 `exp`, quantise h
canonically and run the down dot the same way. Each output element is computed by one sequential piece of code
whatever the partitioning, so the bits do not depend on the thread count.

One `CpuPool.run(LayerJobs)` call computes a whole layer's CPU share for one or a few tokens as one numba parallel
call (gate/up + SwiGLU, quantise h, down), with no per-expert Python: the inputs are the layer's three expert
tensors as uint8 (n_expert, rows, row_bytes) views (file mapping or arena), an int32 (n_pairs, 2) array of
(token, expert) pairs and the tokens' quantised activations; the output is float32 (n_pairs, d_model). Pairs that
share an expert are grouped so that each weight row is read once for all of its tokens.

The integer parts (IQ3_S decode, sub-block dots, 8 sub-blocks' scaling at once) are LLVM vector IR emitted through
numba intrinsics; the float parts are plain IEEE float32 operations in the canonical order.
Its throughput (GB/s of expert bytes read) is measured by `stratad.bench.cpu_pool`; figures in docs/perf-notes.md.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from gguf import GGMLQuantizationType as T

from stratad.model.quants import EXPERT_TYPES, SUB, fmt, iq3s_grid
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


# ---- SIMD integer sub-block dots, as LLVM vector IR (numba intrinsics) -----------------------------------------
# Integer arithmetic only (exact in any order): LLVM lowers these to whatever the host has (AVX-512 / AVX2 /
# NEON / scalar). They take 1-D uint8/int8 arrays and element offsets; the caller guarantees the bounds.

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)

# IQ3_S grid lookups: a hardware gather is faster on the Intel Xeon of the H200 host (1.5x single-thread), 8 scalar
# loads on AMD Zen (gathers are microcoded there: Zen 5 here was 12 % slower with them). Same bits either way; the
# choice is a function of the host CPU model, which is part of numba's cache key, so cached code stays consistent.
IQ3S_GATHER = not llvm_binding.get_host_cpu_name().startswith("znver")
# Integer sub-block dots: with AVX-512 VNNI one vpdpbusd multiplies 64 unsigned by 64 signed bytes and adds each four
# products into an int32 (two sub-blocks an instruction), else pmaddwd on bytes widened to 16 bits. Exact either way.
VNNI = "+avx512vnni" in llvm_binding.get_host_cpu_features().flatten().split(",")


def _i64(builder, v):
    """An integer offset as i64 (numba passes intp, but literals and narrower ints may come in)."""
    w = v.type.width
    return v if w == 64 else builder.sext(v, _I64) if w < 64 else builder.trunc(v, _I64)


def _vptr(context, builder, aryty, ary, off, vt):
    a = context.make_array(aryty)(context, builder, ary)
    p = cgutils.get_item_pointer(context, builder, aryty, a, [_i64(builder, off)])
    return builder.bitcast(p, vt.as_pointer())


def _vload(context, builder, aryty, ary, off, n, et=_I8):
    vt = ir.VectorType(et, n) if n > 1 else et
    return builder.load(_vptr(context, builder, aryty, ary, off, vt), align=1)


def _const(ty, vals):
    return ir.Constant(ir.VectorType(ty, len(vals)), list(vals))


def _splat(builder, val, n):
    vt = ir.VectorType(val.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), _const(_I32, [0] * n))


def _dot32(builder, w_i32, a_i8):
    """reduce_add(w * sext(a)) over 32 lanes -> i32."""
    v32 = ir.VectorType(_I32, 32)
    p = builder.mul(w_i32, builder.sext(a_i8, v32))
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [v32]), "llvm.vector.reduce.add.v32i32")
    return builder.call(fn, [p])


def _iq3s_weights(context, builder, rowty, row, o, j, gty, grid):
    """<32 x i8> signed weights of IQ3_S sub-block j of the block at byte o of row."""
    mag, neg = _iq3s_parts(context, builder, rowty, row, o, j, gty, grid)
    return builder.select(neg, builder.sub(_const(_I8, [0] * 32), mag), mag)


def _negatives(builder, sg):
    """<32 x i1>: value v negative where bit v % 8 of sign byte v // 8 of sg (<4 x i8> or longer) is set."""
    s32 = builder.shuffle_vector(sg, sg, _const(_I32, [v // 8 for v in range(32)]))
    return builder.icmp_unsigned("!=", builder.and_(s32, _const(_I8, [1 << (v % 8) for v in range(32)])),
                                 _const(_I8, [0] * 32))


def _ksigns(builder, k7):
    """ggml's ksigns of 7-bit sign indices (<n x i32>): the 7 bits and their parity as bit 7, as <n x i8>."""
    n = len(k7.type)
    vt = ir.VectorType(_I32, n)
    popc = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt]), f"llvm.ctpop.v{n}i32")
    par = builder.and_(builder.call(popc, [k7]), _const(_I32, [1] * n))
    return builder.trunc(builder.or_(k7, builder.shl(par, _const(_I32, [7] * n))), ir.VectorType(_I8, n))


def _grid_words(builder, data, off, ix, size=4):
    """<32 x i8>: the grid entries ix (<8 x i32> of 4-byte entries, or <4 x i32> of 8-byte ones) of the table at byte
    off (a multiple of the entry size) of the array data points to: one vector gather (IQ3S_GATHER) or scalar loads."""
    n, et = 32 // size, ir.IntType(8 * size)
    vt = ir.VectorType(et, n)
    if IQ3S_GATHER:
        base = _splat(builder, builder.add(builder.ptrtoint(data, _I64), ir.Constant(_I64, off)), n)
        addr = builder.add(base, builder.mul(builder.zext(ix, ir.VectorType(_I64, n)), _const(_I64, [size] * n)))
        ptrs = builder.inttoptr(addr, ir.VectorType(ir.PointerType(), n))
        mask = ir.VectorType(ir.IntType(1), n)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [ptrs.type, _I32, mask, vt]),
                                            f"llvm.masked.gather.v{n}i{8 * size}.v{n}p0")
        mag = builder.call(fn, [ptrs, ir.Constant(_I32, size), ir.Constant(mask, [1] * n),
                                ir.Constant(vt, ir.Undefined)])
    else:
        mag = ir.Constant(vt, ir.Undefined)
        for k in range(n):
            kk = builder.add(builder.mul(builder.zext(builder.extract_element(ix, ir.Constant(_I32, k)), _I64),
                                         ir.Constant(_I64, size)), ir.Constant(_I64, off))
            p = builder.gep(data, [kk], source_etype=_I8)
            mag = builder.insert_element(mag, builder.load(p, typ=et, align=size), ir.Constant(_I32, k))
    return builder.bitcast(mag, ir.VectorType(_I8, 32))


def _iq3s_parts(context, builder, rowty, row, o, j, gty, grid):
    """IQ3_S sub-block j of the block at byte o of row: <32 x i8> magnitudes (grid values, 1..15) and the <32 x i1>
    mask of the negative weights."""
    v8i32 = ir.VectorType(_I32, 8)
    j, o = _i64(builder, j), _i64(builder, o)
    qo = builder.add(builder.add(o, ir.Constant(_I64, 2)), builder.mul(j, ir.Constant(_I64, 8)))
    ho = builder.add(builder.add(o, ir.Constant(_I64, 66)), j)
    so = builder.add(builder.add(o, ir.Constant(_I64, 74)), builder.mul(j, ir.Constant(_I64, 4)))
    # grid index of each group of 4: qs byte | (bit g of the qh byte) << 8
    ix = builder.zext(_vload(context, builder, rowty, row, qo, 8), v8i32)
    qh = _splat(builder, builder.zext(_vload(context, builder, rowty, row, ho, 1), _I32), 8)
    hi = builder.shl(builder.and_(builder.lshr(qh, _const(_I32, range(8))), _const(_I32, [1] * 8)),
                     _const(_I32, [8] * 8))
    ix = builder.or_(ix, hi)
    g = context.make_array(gty)(context, builder, grid)
    mag = _grid_words(builder, g.data, 0, ix)
    # sign of value v: bit v % 8 of sign byte v // 8
    return mag, _negatives(builder, _vload(context, builder, rowty, row, so, 4))


def _is_1d_bytes(*tys):
    return all(isinstance(t, types.Array) and t.ndim == 1 and t.dtype in (types.uint8, types.int8) for t in tys)


@intrinsic
def _idot_i8(typingctx, w, wo, a, ao):
    """sum_{v<32} int8(w[wo + v]) * int8(a[ao + v]) (Q8_0 weights, or decoded IQ3_S weights)."""
    if not _is_1d_bytes(w, a):
        return None

    def codegen(context, builder, sig, args):
        wv = builder.sext(_vload(context, builder, sig.args[0], args[0], args[1], 32), ir.VectorType(_I32, 32))
        return _dot32(builder, wv, _vload(context, builder, sig.args[2], args[2], args[3], 32))
    return types.int32(w, wo, a, ao), codegen


# ---- block kernels: 8 sub-blocks (256 values) of one row against one activation row, all in vector registers ----
# isum_j for the 8 sub-blocks (integer products, pairwise sums, a fixed shuffle tree: exact), then per sub-block j
# t_j = (scale_j * da_j) * isum_j [- (min_j * da_j) * asum_j] and acc[acco + j] = acc[acco + j] + t_j as IEEE
# float32 vector ops with no fast-math flags: lane for lane the same operations, in the same order, as the scalar
# canonical code (8 consecutive sub-blocks land on 8 consecutive virtual lanes).


def _isum8(builder, w8, a8, signed: bool, neg=None):
    """<8 x i32>: sum_v w[j][v] * a[j][v] for j < 8, from <32 x i8> weights w8 (int8 if signed, else uint8; or
    <32 x i16>, signed) and activations a8. neg: masks of negative weights when w8 holds magnitudes; the signs move
    onto the activations (the same products)."""
    if neg is not None:
        zero = _const(_I8, [0] * 32)
        a8 = [builder.select(n, builder.sub(zero, a), a) for n, a in zip(neg, a8)]  # |a| <= 127: no overflow
    if VNNI and w8[0].type.element.width == 8:
        return _tree8(builder, _partials_vnni(builder, w8, a8, signed), 8)
    v32 = ir.VectorType(_I32, 32)
    widen = builder.sext if signed else builder.zext
    qs = []
    for w, a in zip(w8, a8):
        p = builder.mul(widen(w, v32), builder.sext(a, v32))  # compiled to pmaddwd with the pair sums below
        qs.append(builder.add(builder.shuffle_vector(p, p, _const(_I32, range(0, 32, 2))),
                              builder.shuffle_vector(p, p, _const(_I32, range(1, 32, 2)))))
    return _tree8(builder, qs, 16)


def _partials_vnni(builder, w8, a8, signed):
    """4 x <16 x i32>: sub-blocks 2m and 2m + 1 as 8 partial sums (of 4 products) each, by vpdpbusd (unsigned x
    signed bytes). Signed weights are biased by 128 into unsigned and 128 * (sums of 4 activations) taken off."""
    v16, v64 = ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16, v16]),
                                        "llvm.x86.avx512.vpdpbusd.512")
    zero = ir.Constant(v16, [0] * 16)
    both = _const(_I32, range(64))
    out = []
    for m in range(4):
        w = builder.shuffle_vector(w8[2 * m], w8[2 * m + 1], both)
        a = builder.bitcast(builder.shuffle_vector(a8[2 * m], a8[2 * m + 1], both), v16)
        if signed:
            w = builder.xor(w, ir.Constant(v64, [0x80] * 64))
        p = builder.call(fn, [zero, builder.bitcast(w, v16), a])
        if signed:
            p = builder.sub(p, builder.call(fn, [zero, ir.Constant(v16, [0x80808080 - (1 << 32)] * 16), a]))
        out.append(p)
    return out


def _tree8(builder, qs, width, op=None):
    """<8 x iN> of 8 sub-blocks' reductions (op: add by default) from vectors of n partials, each vector holding n //
    width sub-blocks' `width` partials (in sub-block order): ops on pairs of shuffles along a fixed tree."""
    op = op or builder.add
    n = qs[0].type.count
    while len(qs) > 1:
        half = width // 2
        first = [g * width + i for g in range(n // width) for i in range(half)]
        first = first + [n + x for x in first]
        second = [x + half for x in first]
        qs = [op(builder.shuffle_vector(x, y, _const(_I32, first)), builder.shuffle_vector(x, y, _const(_I32, second)))
              for x, y in zip(qs[0::2], qs[1::2])]
        width = half
    v = qs[0]
    while width > 1:
        half = width // 2
        first = [g * width + i for g in range(8) for i in range(half)]
        v = op(builder.shuffle_vector(v, v, _const(_I32, first)),
               builder.shuffle_vector(v, v, _const(_I32, [x + half for x in first])))
        width = half
    return v


def _fload8(context, builder, aryty, ary, off):
    return builder.load(_vptr(context, builder, aryty, ary, off, ir.VectorType(ir.FloatType(), 8)), align=4)


def _accumulate8(context, builder, sig, args, first, w8, signed: bool, neg=None, mw8=None, scales=None):
    """Shared tail: args[first:] = (sbuf, mbuf, a, ao, da, asum, dao, acc, acco); mbuf is None-typed for no min.
    w8, signed, neg: the 8 sub-blocks' <32 x i8> weights as for _isum8. mw8: <32 x i8> unsigned mweights, whose
    sums with the activations replace asum's in the minimum term. scales: the sub-blocks' (scale, minimum) as
    <8 x float> formed in registers, read instead of sbuf and mbuf."""
    sty, mty, aty, _, daty, asty, _, accty, _ = sig.args[first:]
    sbuf, mbuf, a, ao, da, asum, dao, acc, acco = args[first:]
    a8 = [_vload(context, builder, aty, a, builder.add(_i64(builder, ao), ir.Constant(_I64, 32 * j)), 32)
          for j in range(8)]
    isf = builder.sitofp(_isum8(builder, w8, a8, signed, neg), ir.VectorType(ir.FloatType(), 8))
    dav = _fload8(context, builder, daty, da, dao)
    sv, mv = scales if scales is not None else (_fload8(context, builder, sty, sbuf, ir.Constant(_I64, 0)), None)
    t = builder.fmul(builder.fmul(sv, dav), isf)
    if not isinstance(mty, types.NoneType):
        m = builder.fmul(mv if scales is not None else _fload8(context, builder, mty, mbuf, ir.Constant(_I64, 0)), dav)
        if mw8 is None:
            msum = _fload8(context, builder, asty, asum, dao)
        else:
            msum = builder.sitofp(_isum8(builder, mw8, a8, False), ir.VectorType(ir.FloatType(), 8))
        t = builder.fsub(t, builder.fmul(m, msum))
    p = _vptr(context, builder, accty, acc, acco, ir.VectorType(ir.FloatType(), 8))
    builder.store(builder.fadd(builder.load(p, align=4), t), p, align=4)
    return context.get_dummy_value()


def _f32_1d(*tys):
    return all(isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32 for t in tys)


def _blk_ok(w, sbuf, mbuf, a, da, asum, acc):
    return (_is_1d_bytes(w, a) and _f32_1d(sbuf, da, asum, acc)
            and (isinstance(mbuf, types.NoneType) or _f32_1d(mbuf)))


@intrinsic
def _blk_i8(typingctx, w, wo, stride, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """8 sub-blocks of int8 weights at w[wo + j * stride:][:32] (Q8_0 in place: stride 34; decoded: stride 32)."""
    if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc):
        return None

    def codegen(context, builder, sig, args):
        wo, st = _i64(builder, args[1]), _i64(builder, args[2])
        w8 = [_vload(context, builder, sig.args[0], args[0], builder.add(wo, builder.mul(st, ir.Constant(_I64, j))),
                     32) for j in range(8)]
        return _accumulate8(context, builder, sig, args, 3, w8, signed=True)
    return types.none(w, wo, stride, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


def _bytes_at(context, builder, sig, args, off, n=32):
    """<n x i8> of the block kernel's weights at w[wo + off] (args[0], args[1])."""
    return _vload(context, builder, sig.args[0], args[0], builder.add(_i64(builder, args[1]), ir.Constant(_I64, off)),
                  n)


def _bytes(v):
    return _const(_I8, [v] * 32)


def _k4_codes(context, builder, sig, args, qs, qh=None):
    """The 8 sub-blocks' 4-bit codes of a Q4_K / Q5_K block (the 128 quant bytes at w[wo + qs]; sub-block j: bytes
    32 (j // 2), low nibbles for even j, high for odd), Q5_K's fifth bit (bit j of the 32 bytes at w[wo + qh]) << 4."""
    high = None if qh is None else _bytes_at(context, builder, sig, args, qh)
    w8 = []
    for j in range(8):
        q = _bytes_at(context, builder, sig, args, qs + 32 * (j >> 1))
        code = builder.lshr(q, _bytes(4)) if j & 1 else builder.and_(q, _bytes(15))
        if high is not None:
            code = builder.or_(code, builder.shl(builder.and_(builder.lshr(high, _bytes(j)), _bytes(1)), _bytes(4)))
        w8.append(code)
    return w8


def _half_at(context, builder, sig, args, off):
    """The f16 at w[wo + off] as float32 (_half)."""
    return _half(builder, builder.zext(_vload(context, builder, sig.args[0], args[0],
                                              builder.add(_i64(builder, args[1]), ir.Constant(_I64, off)), 1,
                                              ir.IntType(16)), _I32))


def _half(builder, h):
    """The f16s of bits h (i32, or a vector of them) as float32, their bits formed in integers (exact; no F16C or
    libcall needed): a normal f16's exponent rebased by 112, inf / NaN's to 255, a subnormal's mantissa times 2^-24."""
    n = h.type.count if isinstance(h.type, ir.VectorType) else 0
    ft = ir.VectorType(ir.FloatType(), n) if n else ir.FloatType()

    def c(v, ty=h.type):
        return ir.Constant(ty, [v] * n if n else v)
    mag, sign = builder.and_(h, c(0x7FFF)), builder.shl(builder.and_(h, c(0x8000)), c(16))
    normal = builder.add(builder.shl(mag, c(13)), c(112 << 23))
    special = builder.add(normal, c(112 << 23))
    sub = builder.bitcast(builder.fmul(builder.uitofp(mag, ft), c(2.0 ** -24, ft)), h.type)
    bits = builder.select(builder.icmp_unsigned("<", mag, c(0x400)), sub,
                          builder.select(builder.icmp_unsigned(">=", mag, c(0x7C00)), special, normal))
    return builder.bitcast(builder.or_(bits, sign), ft)


def _k4_scales8(context, builder, sig, args):
    """(d sc_j, dmin m_j) of the Q4_K / Q5_K block at w[wo] as <8 x float>, what _k4_scales writes: the 6-bit sc / m
    of sub-block j < 4 are the low 6 bits of bytes 4 + j / 8 + j; for j >= 4, the nibbles of byte 8 + j with the top
    2 bits of bytes j / j + 4 as bits 4, 5."""
    q = _bytes_at(context, builder, sig, args, 4, 16)  # the 12 scale bytes (and 4 of the codes, unused)

    def pick(idx, mask, shift=0):
        x = builder.shuffle_vector(q, q, _const(_I32, idx))
        return builder.and_(builder.lshr(x, _const(_I8, [shift] * 8)) if shift else x, _const(_I8, [mask] * 8))
    low = _const(ir.IntType(1), [1] * 4 + [0] * 4)
    sc = builder.select(low, pick([0, 1, 2, 3, 8, 9, 10, 11], 63),
                        builder.or_(pick([0, 1, 2, 3, 8, 9, 10, 11], 15), pick([0, 1, 2, 3, 0, 1, 2, 3], 0x30, 2)))
    mn = builder.select(low, pick([4, 5, 6, 7, 8, 9, 10, 11], 63),
                        builder.or_(pick([4, 5, 6, 7, 8, 9, 10, 11], 15, 4), pick([4, 5, 6, 7, 4, 5, 6, 7], 0x30, 2)))
    f8 = ir.VectorType(ir.FloatType(), 8)
    return tuple(builder.fmul(_splat(builder, _half_at(context, builder, sig, args, off), 8), builder.uitofp(v, f8))
                 for off, v in ((0, sc), (2, mn)))


@intrinsic
def _blk_q4k(typingctx, w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """The 8 sub-blocks of the Q4_K block at w[wo] (the 128 quant bytes at byte 16), its scales and minimums formed
    in registers (sbuf and mbuf unread)."""
    if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc):
        return None

    def codegen(context, builder, sig, args):
        return _accumulate8(context, builder, sig, args, 2, _k4_codes(context, builder, sig, args, 16), signed=False,
                            scales=_k4_scales8(context, builder, sig, args))
    return types.none(w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


@intrinsic
def _blk_q5k(typingctx, w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """The 8 sub-blocks of the Q5_K block at w[wo] (qh at byte 16, the nibbles at 48), decoded in registers, as
    _blk_q4k."""
    if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc):
        return None

    def codegen(context, builder, sig, args):
        return _accumulate8(context, builder, sig, args, 2, _k4_codes(context, builder, sig, args, 48, 16),
                            signed=False, scales=_k4_scales8(context, builder, sig, args))
    return types.none(w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


def _field(builder, x, shift, mask):
    """(x >> shift) & mask, bytewise (shift: one count, or a vector of them)."""
    sh = _const(_I8, [shift] * len(x.type)) if isinstance(shift, int) else shift
    return builder.and_(builder.lshr(x, sh), _const(_I8, [mask] * len(x.type)))


def _scaled16(builder, codes, sc16):
    """Sub-block j's int8 codes (codes[j], <32 x i8>) times the 16-value integer scales sc16 (<16 x i16>: values
    16 k .. 16 k + 15 take sc16[k]) as <32 x i16>: a view's q where it folds the scales in (exact in int16)."""
    v16 = ir.VectorType(ir.IntType(16), 32)
    return [builder.mul(builder.sext(c, v16), builder.shuffle_vector(sc16, sc16, _const(_I32, [2 * j] * 16 +
                                                                                          [2 * j + 1] * 16)))
            for j, c in enumerate(codes)]


def _d8(context, builder, sig, args, off):
    """<8 x float> of the block's f16 at w[wo + off] (the 8 sub-blocks' common scale or minimum)."""
    return _splat(builder, _half_at(context, builder, sig, args, off), 8)


@intrinsic
def _blk_q6k(typingctx, w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """The 8 sub-blocks of the Q6_K block at w[wo], decoded in registers: sub-block j = 4 h + p, code = nibble p // 2
    of ql[64 h + 32 (p % 2) + v] | bits 2 p of qh[32 h + v] << 4, q = sc_k (code - 32) (sc_k the int8 scale of
    values 16 k .. 16 k + 15, at byte 192 + k), scale d (at 208)."""
    if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc):
        return None

    def codegen(context, builder, sig, args):
        codes = []
        for j in range(8):
            h, p = j >> 2, j & 3
            lo = _field(builder, _bytes_at(context, builder, sig, args, 64 * h + 32 * (p & 1)), 4 * (p >> 1), 15)
            hi = _field(builder, _bytes_at(context, builder, sig, args, 128 + 32 * h), 2 * p, 3)
            codes.append(builder.sub(builder.or_(lo, builder.shl(hi, _bytes(4))), _bytes(32)))
        sc = builder.sext(_bytes_at(context, builder, sig, args, 192, 16), ir.VectorType(ir.IntType(16), 16))
        return _accumulate8(context, builder, sig, args, 2, _scaled16(builder, codes, sc), signed=True,
                            scales=(_d8(context, builder, sig, args, 208), None))
    return types.none(w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


@intrinsic
def _blk_q3k(typingctx, w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """The 8 sub-blocks of the Q3_K block at w[wo], decoded in registers: code = 2 low bits (bits 2 (j % 4) of
    qs[32 (j // 4) + v], qs at byte 32) - 4 where bit j of hmask[v] (byte v) is clear; q = (sc_k - 32) code, sc_k of
    6 bits: the nibble k // 8 of byte 96 + k % 8 and bits 2 (k // 4) of byte 104 + k % 4 as bits 4, 5; scale d (at
    108)."""
    if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc):
        return None

    def codegen(context, builder, sig, args):
        hmask = _bytes_at(context, builder, sig, args, 0)
        codes = []
        for j in range(8):
            lo = _field(builder, _bytes_at(context, builder, sig, args, 32 + 32 * (j >> 2)), 2 * (j & 3), 3)
            hi = builder.shl(_field(builder, hmask, j, 1), _bytes(2))
            codes.append(builder.sub(builder.or_(lo, hi), _bytes(4)))
        s8 = _bytes_at(context, builder, sig, args, 96, 8)  # exactly the block's 12 scale bytes: 8 here, 4 below
        s4 = _bytes_at(context, builder, sig, args, 104, 4)
        lo4 = builder.shuffle_vector(s8, s8, _const(_I32, list(range(8)) * 2))
        lo4 = builder.and_(builder.lshr(lo4, _const(_I8, [0] * 8 + [4] * 8)), _const(_I8, [15] * 16))
        hi2 = builder.shuffle_vector(s4, s4, _const(_I32, list(range(4)) * 4))
        hi2 = builder.and_(builder.lshr(hi2, _const(_I8, [0] * 4 + [2] * 4 + [4] * 4 + [6] * 4)), _const(_I8, [3] * 16))
        sc = builder.sub(builder.or_(lo4, builder.shl(hi2, _const(_I8, [4] * 16))), _const(_I8, [32] * 16))
        sc = builder.sext(sc, ir.VectorType(ir.IntType(16), 16))
        return _accumulate8(context, builder, sig, args, 2, _scaled16(builder, codes, sc), signed=True,
                            scales=(_d8(context, builder, sig, args, 108), None))
    return types.none(w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


@intrinsic
def _blk_q2k(typingctx, w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """The 8 sub-blocks of the Q2_K block at w[wo], decoded in registers: code = bits 2 (j % 4) of qs[32 (j // 4) +
    v] (qs at byte 16), q = sc_k code and mweight m_k (sc_k / m_k: the low / high nibble of byte k), scale d and
    minimum dmin (at 80, 82). mbuf must be an array (the minimum term is there); it is not read."""
    if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc) or isinstance(mbuf, types.NoneType):
        return None

    def codegen(context, builder, sig, args):
        sc = _bytes_at(context, builder, sig, args, 0, 16)
        w8, mw8 = [], []
        for j in range(8):
            code = _field(builder, _bytes_at(context, builder, sig, args, 16 + 32 * (j >> 2)), 2 * (j & 3), 3)
            per = _const(_I32, [2 * j] * 16 + [2 * j + 1] * 16)
            w8.append(builder.mul(code, builder.shuffle_vector(_field(builder, sc, 0, 15), sc, per)))  # <= 45
            mw8.append(builder.shuffle_vector(_field(builder, sc, 4, 15), sc, per))
        return _accumulate8(context, builder, sig, args, 2, w8, signed=False, mw8=mw8,
                            scales=(_d8(context, builder, sig, args, 80), _d8(context, builder, sig, args, 82)))
    return types.none(w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


@intrinsic
def _blk_iq3s(typingctx, w, wo, grid, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """The 8 sub-blocks of the IQ3_S block at w[wo], decoded in registers."""
    if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc):
        return None

    def codegen(context, builder, sig, args):
        parts = [_iq3s_parts(context, builder, sig.args[0], args[0], args[1], ir.Constant(_I64, j), sig.args[2],
                             args[2]) for j in range(8)]
        return _accumulate8(context, builder, sig, args, 3, [m for m, _ in parts], signed=False,
                            neg=[n for _, n in parts])
    return types.none(w, wo, grid, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


@intrinsic
def _blk_dec(typingctx, wbuf, mwbuf, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """The 8 decoded sub-blocks wbuf[0:256] (q as int8, uint8 or int16) against a[ao:ao + 256]; mwbuf: uint8
    mweights (Q2_K) or None (weight 1: the minimum term takes asum)."""
    wok = isinstance(wbuf, types.Array) and wbuf.ndim == 1 and wbuf.dtype in (types.int8, types.uint8, types.int16)
    if not (wok and (isinstance(mwbuf, types.NoneType) or _is_1d_bytes(mwbuf)) and _blk_ok(a, sbuf, mbuf, a, da, asum,
                                                                                            acc)):
        return None

    def codegen(context, builder, sig, args):
        dt = sig.args[0].dtype
        w8 = [_vload(context, builder, sig.args[0], args[0], ir.Constant(_I64, 32 * j), 32, ir.IntType(dt.bitwidth))
              for j in range(8)]
        mw8 = None if isinstance(sig.args[1], types.NoneType) else [
            _vload(context, builder, sig.args[1], args[1], ir.Constant(_I64, 32 * j), 32) for j in range(8)]
        return _accumulate8(context, builder, sig, args, 2, w8, signed=dt.signed, mw8=mw8)
    return types.none(wbuf, mwbuf, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


def _legacy_kernel(has_m: bool, five: bool):
    """The block kernel of 8 consecutive 32-value blocks of Q4_0 (neither), Q4_1 (has_m), Q5_0 (five) or Q5_1
    (both) from w[wo], decoded in registers: per block f16 d [, f16 m] [, 32 fifth bits], 16 nibble bytes (value v
    < 16 the low nibble of byte v, else the high nibble of byte v - 16); q = code - 8 / - 16 (int8) without a
    minimum, else q = code (uint8) and minimum -m."""
    bb = 18 + 2 * has_m + 4 * five

    @intrinsic
    def kernel(typingctx, w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
        if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc) or isinstance(mbuf, types.NoneType) == has_m:
            return None

        def codegen(context, builder, sig, args):
            f8 = ir.VectorType(ir.FloatType(), 8)
            dv = mv = ir.Constant(f8, ir.Undefined)
            w8 = []
            for j in range(8):
                b = bb * j
                dv = builder.insert_element(dv, _half_at(context, builder, sig, args, b), ir.Constant(_I32, j))
                if has_m:
                    m = builder.fsub(ir.Constant(ir.FloatType(), -0.0), _half_at(context, builder, sig, args, b + 2))
                    mv = builder.insert_element(mv, m, ir.Constant(_I32, j))
                x = _bytes_at(context, builder, sig, args, b + 2 + 2 * has_m + 4 * five, 16)
                code = builder.shuffle_vector(_field(builder, x, 0, 15), _field(builder, x, 4, 15),
                                              _const(_I32, range(32)))
                if five:
                    qh = _bytes_at(context, builder, sig, args, b + 2 + 2 * has_m, 4)
                    bit = builder.shuffle_vector(qh, qh, _const(_I32, [v // 8 for v in range(32)]))
                    bit = _field(builder, bit, _const(_I8, [v % 8 for v in range(32)]), 1)
                    code = builder.or_(code, builder.shl(bit, _bytes(4)))
                w8.append(code if has_m else builder.sub(code, _bytes(16 if five else 8)))
            return _accumulate8(context, builder, sig, args, 2, w8, signed=not has_m,
                                scales=(dv, mv if has_m else None))
        return types.none(w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen
    return kernel


_blk_q40, _blk_q41, _blk_q50, _blk_q51 = (_legacy_kernel(m, f) for f in (False, True) for m in (False, True))


def _lut_codes(builder, x, values):
    """The 32 values of a sub-block whose 16 bytes x hold their indices in `values` (16 int8), low nibbles first."""
    t = _const(_I8, [int(v) & 255 for v in values])
    return builder.shuffle_vector(_lut16(builder, t, _field(builder, x, 0, 15)),
                                  _lut16(builder, t, _field(builder, x, 4, 15)), _const(_I32, range(32)))


def _lut_kernel(qtype: int):
    """The block kernel of IQ4_NL / MXFP4 (8 consecutive 32-value blocks from w[wo]: f16 d or an E8M0 exponent
    byte, 16 index bytes) or IQ4_XS (one 256-value block: f16 d, 2 + 4 bytes of 6-bit scales, 8 x 16 index bytes),
    decoded in registers: q = the table value of each 4-bit index (kvalues, or MXFP4's doubled E2M1 values)."""
    values = MXFP4_VALUES if qtype == MXFP4 else IQ4_VALUES

    @intrinsic
    def kernel(typingctx, w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
        if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc):
            return None

        def codegen(context, builder, sig, args):
            f8 = ir.VectorType(ir.FloatType(), 8)
            if qtype == IQ4_XS:
                w8 = [_lut_codes(builder, _bytes_at(context, builder, sig, args, 8 + 16 * j, 16), values)
                      for j in range(8)]
                sl = _bytes_at(context, builder, sig, args, 4, 4)
                lo = _field(builder, builder.shuffle_vector(sl, sl, _const(_I32, [j >> 1 for j in range(8)])),
                            _const(_I8, [4 * (j & 1) for j in range(8)]), 15)
                sh = _vload(context, builder, sig.args[0], args[0], builder.add(_i64(builder, args[1]),
                                                                                 ir.Constant(_I64, 2)), 1,
                            ir.IntType(16))
                v16 = ir.VectorType(ir.IntType(16), 8)
                hi = builder.and_(builder.lshr(_splat(builder, sh, 8), ir.Constant(v16, [2 * j for j in range(8)])),
                                  ir.Constant(v16, [3] * 8))
                ls = builder.or_(lo, builder.shl(builder.trunc(hi, ir.VectorType(_I8, 8)), _const(_I8, [4] * 8)))
                ls = builder.sitofp(builder.sub(ls, _const(_I8, [32] * 8)), f8)
                return _accumulate8(context, builder, sig, args, 2, w8, signed=True,
                                    scales=(builder.fmul(_d8(context, builder, sig, args, 0), ls), None))
            bb = 17 if qtype == MXFP4 else 18
            dv = ir.Constant(f8, ir.Undefined)
            w8 = []
            for j in range(8):
                if qtype == MXFP4:  # 2^(e - 128) from its bits: e < 2 a subnormal
                    e = builder.zext(_bytes_at(context, builder, sig, args, bb * j, 1), _I32)
                    small = builder.icmp_unsigned("<", e, ir.Constant(_I32, 2))
                    bits = builder.select(small, builder.shl(ir.Constant(_I32, 0x00200000), e),
                                          builder.shl(builder.sub(e, ir.Constant(_I32, 1)), ir.Constant(_I32, 23)))
                    d = builder.bitcast(bits, ir.FloatType())
                else:
                    d = _half_at(context, builder, sig, args, bb * j)
                dv = builder.insert_element(dv, d, ir.Constant(_I32, j))
                off = bb * j + (1 if qtype == MXFP4 else 2)
                w8.append(_lut_codes(builder, _bytes_at(context, builder, sig, args, off, 16), values))
            return _accumulate8(context, builder, sig, args, 2, w8, signed=True, scales=(dv, None))
        return types.none(w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen
    return kernel


_blk_iq4nl, _blk_iq4xs, _blk_mxfp4 = (_lut_kernel(t) for t in (IQ4_NL, IQ4_XS, MXFP4))


def _xxs_kernel(qtype: int):
    """The block kernel of IQ3_XXS or IQ2_XXS, decoded in registers: sub-block j's grid indices (IQ3_XXS: 8 bytes at
    2 + 8 j, entries of 4 values; IQ2_XXS: 4 bytes at 2 + 8 j, entries of 8) and its word (IQ3_XXS: at 66 + 4 j;
    IQ2_XXS: at 6 + 8 j): 4 x 7 sign bits (ggml's ksigns: the 8th is their parity by popcount), then the 4-bit ls;
    scale (d (0.5 + ls)) 0.5 (IQ3_XXS) or 0.25. tab: the decode tables (the grids at _T_IQ3XXS / _T_IQ2XXS)."""
    three = qtype == IQ3_XXS
    size, toff, last = (4, _T_IQ3XXS, 0.5) if three else (8, _T_IQ2XXS, 0.25)

    @intrinsic
    def kernel(typingctx, w, wo, tab, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
        if not (_blk_ok(w, sbuf, mbuf, a, da, asum, acc) and _is_1d_bytes(tab)):
            return None

        def codegen(context, builder, sig, args):
            v8i32, f8 = ir.VectorType(_I32, 8), ir.VectorType(ir.FloatType(), 8)
            t = context.make_array(sig.args[2])(context, builder, args[2])
            if three:
                words = builder.bitcast(_bytes_at(context, builder, sig, args, 66, 32), v8i32)
            else:
                both = builder.bitcast(_bytes_at(context, builder, sig, args, 2, 64), ir.VectorType(_I32, 16))
                words = builder.shuffle_vector(both, both, _const(_I32, range(1, 16, 2)))
            mags, negs = [], []
            for j in range(8):
                n = 32 // size
                ix = builder.zext(_bytes_at(context, builder, sig, args, 2 + 8 * j, n), ir.VectorType(_I32, n))
                mags.append(_grid_words(builder, t.data, toff, ix, size))
                wj = _splat(builder, builder.extract_element(words, ir.Constant(_I32, j)), 8)
                k7 = builder.and_(builder.lshr(wj, _const(_I32, [7 * (k % 4) for k in range(8)])),
                                  _const(_I32, [127] * 8))
                negs.append(_negatives(builder, _ksigns(builder, k7)))
            ls = builder.sitofp(builder.lshr(words, _const(_I32, [28] * 8)), f8)
            d = _d8(context, builder, sig, args, 0)
            scale = builder.fmul(builder.fmul(d, builder.fadd(ir.Constant(f8, [0.5] * 8), ls)),
                                 ir.Constant(f8, [last] * 8))
            return _accumulate8(context, builder, sig, args, 3, mags, signed=False, neg=negs, scales=(scale, None))
        return types.none(w, wo, tab, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen
    return kernel


_blk_iq3xxs, _blk_iq2xxs = _xxs_kernel(IQ3_XXS), _xxs_kernel(IQ2_XXS)


def _iq2_kernel(qtype: int):
    """The block kernel of IQ2_XS (a u16 an 8-value entry at 2 + 2 n: 9-bit grid index, 7 ksign bits) or IQ2_S (index
    byte n at 2 + n with 2 high bits from byte 66 + n // 4, a plain sign byte at 34 + n), decoded in registers: q =
    (2 ls_k + 1) * signed grid value as int16 (ls_k nibble k of the scale bytes at 66 / 74, per 16 values), scale
    d / 8. tab: the decode tables (the grids at _T_IQ2XS / _T_IQ2S)."""
    xs = qtype == IQ2_XS
    toff, so = (_T_IQ2XS, 66) if xs else (_T_IQ2S, 74)

    @intrinsic
    def kernel(typingctx, w, wo, tab, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
        if not (_blk_ok(w, sbuf, mbuf, a, da, asum, acc) and _is_1d_bytes(tab)):
            return None

        def codegen(context, builder, sig, args):
            v4i32, v32i16 = ir.VectorType(_I32, 4), ir.VectorType(ir.IntType(16), 32)
            t = context.make_array(sig.args[2])(context, builder, args[2])
            sc = _bytes_at(context, builder, sig, args, so, 8)
            folds = _field(builder, builder.shuffle_vector(sc, sc, _const(_I32, [k >> 1 for k in range(16)])),
                           _const(_I8, [4 * (k & 1) for k in range(16)]), 15)
            folds = builder.add(builder.shl(builder.zext(folds, ir.VectorType(ir.IntType(16), 16)),
                                            ir.Constant(ir.VectorType(ir.IntType(16), 16), [1] * 16)),
                                ir.Constant(ir.VectorType(ir.IntType(16), 16), [1] * 16))
            w16, negs = [], []
            for j in range(8):
                if xs:
                    q = builder.zext(_vload(context, builder, sig.args[0], args[0],
                                            builder.add(_i64(builder, args[1]), ir.Constant(_I64, 2 + 8 * j)), 4,
                                            ir.IntType(16)), v4i32)
                    ix = builder.and_(q, _const(_I32, [511] * 4))
                    sg = _ksigns(builder, builder.lshr(q, _const(_I32, [9] * 4)))
                else:
                    hb = _splat(builder, builder.zext(_bytes_at(context, builder, sig, args, 66 + j, 1), _I32), 4)
                    hb = builder.and_(builder.lshr(hb, _const(_I32, [0, 2, 4, 6])), _const(_I32, [3] * 4))
                    ix = builder.or_(builder.zext(_bytes_at(context, builder, sig, args, 2 + 4 * j, 4), v4i32),
                                     builder.shl(hb, _const(_I32, [8] * 4)))
                    sg = _bytes_at(context, builder, sig, args, 34 + 4 * j, 4)
                mag = builder.zext(_grid_words(builder, t.data, toff, ix, 8), v32i16)
                w16.append(builder.mul(mag, builder.shuffle_vector(folds, folds, _const(_I32, [2 * j] * 16 +
                                                                                           [2 * j + 1] * 16))))
                negs.append(_negatives(builder, sg))
            scale = builder.fmul(_d8(context, builder, sig, args, 0), ir.Constant(ir.VectorType(ir.FloatType(), 8),
                                                                                  [0.125] * 8))
            return _accumulate8(context, builder, sig, args, 3, w16, signed=True, neg=negs, scales=(scale, None))
        return types.none(w, wo, tab, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen
    return kernel


_blk_iq2xs, _blk_iq2s = _iq2_kernel(IQ2_XS), _iq2_kernel(IQ2_S)


def _iq1_values(builder, g, neg):
    """IQ1's <32 x i8> 8 g + 1, or 8 g - 1 where neg (the grid's g in -1..1 a byte; neg: 0 or -1 a byte, so that
    the delta is 1 | neg without a select)."""
    return builder.add(builder.shl(g, _bytes(3)), builder.or_(neg, _bytes(1)))


@intrinsic
def _blk_iq1s(typingctx, w, wo, tab, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """The 8 sub-blocks of the IQ1_S block at w[wo], decoded in registers: sub-block j's 4 index bytes at 2 + 4 j and
    its u16 at 34 + 2 j (4 x 3 high index bits, the 3-bit ls, the delta's sign); q = 8 g +- 1 (g: the grid's -1, 0,
    1), scale (d (2 ls + 1)) / 8. tab: the decode tables (the grid at _T_IQ1S)."""
    if not (_blk_ok(w, sbuf, mbuf, a, da, asum, acc) and _is_1d_bytes(tab)):
        return None

    def codegen(context, builder, sig, args):
        v4i32, v8i32, f8 = ir.VectorType(_I32, 4), ir.VectorType(_I32, 8), ir.VectorType(ir.FloatType(), 8)
        t = context.make_array(sig.args[2])(context, builder, args[2])
        qhs = builder.zext(_vload(context, builder, sig.args[0], args[0],
                                  builder.add(_i64(builder, args[1]), ir.Constant(_I64, 34)), 8, ir.IntType(16)),
                           v8i32)
        w8 = []
        for j in range(8):
            qh = builder.extract_element(qhs, ir.Constant(_I32, j))
            hi = builder.and_(builder.lshr(_splat(builder, qh, 4), _const(_I32, [0, 3, 6, 9])), _const(_I32, [7] * 4))
            ix = builder.or_(builder.zext(_bytes_at(context, builder, sig, args, 2 + 4 * j, 4), v4i32),
                             builder.shl(hi, _const(_I32, [8] * 4)))
            g = _grid_words(builder, t.data, _T_IQ1S, ix, 8)
            # the delta's sign as a byte mask (a select on the scalar bit became a branch, mispredicted half the time)
            sign = builder.lshr(qh, ir.Constant(_I32, 15))
            neg = _splat(builder, builder.trunc(builder.sub(ir.Constant(_I32, 0), sign), _I8), 32)
            w8.append(_iq1_values(builder, g, neg))
        ls = builder.and_(builder.lshr(qhs, _const(_I32, [12] * 8)), _const(_I32, [7] * 8))
        f = builder.sitofp(builder.add(builder.shl(ls, _const(_I32, [1] * 8)), _const(_I32, [1] * 8)), f8)
        scale = builder.fmul(builder.fmul(_d8(context, builder, sig, args, 0), f), ir.Constant(f8, [0.125] * 8))
        return _accumulate8(context, builder, sig, args, 3, w8, signed=True, scales=(scale, None))
    return types.none(w, wo, tab, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


@intrinsic
def _blk_iq1m(typingctx, w, wo, tab, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
    """The IQ1_M block at w[wo], decoded in registers: group n's (8 values) index byte at n and nibble n of the 16
    bytes at 32 (3 high index bits, the delta's sign); q = (2 s_k + 1) (8 g +- 1) as int16, s_k the 3-bit scale of
    16 values k (bits 3 (k % 4) of the u16 at 48 + 2 (k // 4)), scale d / 8 (d's f16 in those words' top nibbles).
    tab: the decode tables (the grid at _T_IQ1M)."""
    if not (_blk_ok(w, sbuf, mbuf, a, da, asum, acc) and _is_1d_bytes(tab)):
        return None

    def codegen(context, builder, sig, args):
        v4, i16 = ir.VectorType(_I32, 4), ir.IntType(16)
        t = context.make_array(sig.args[2])(context, builder, args[2])
        sc = builder.zext(_vload(context, builder, sig.args[0], args[0],
                                 builder.add(_i64(builder, args[1]), ir.Constant(_I64, 48)), 4, i16), v4)
        top = builder.and_(sc, _const(_I32, [0xF000] * 4))  # d's nibble h in word h's bits 12..15
        d = builder.lshr(top, _const(_I32, [12, 8, 4, 0]))
        d = builder.or_(builder.or_(builder.extract_element(d, ir.Constant(_I32, 0)),
                                    builder.extract_element(d, ir.Constant(_I32, 1))),
                        builder.or_(builder.extract_element(d, ir.Constant(_I32, 2)),
                                    builder.extract_element(d, ir.Constant(_I32, 3))))
        d8 = _splat(builder, builder.fmul(_half(builder, d), ir.Constant(ir.FloatType(), 0.125)), 8)
        w8 = []
        for j in range(8):
            qh = _bytes_at(context, builder, sig, args, 32 + 2 * j, 2)
            nib = builder.and_(builder.lshr(builder.shuffle_vector(qh, qh, _const(_I32, [0, 0, 1, 1])),
                                            _const(_I8, [0, 4, 0, 4])), _const(_I8, [15] * 4))
            ix = builder.or_(builder.zext(_bytes_at(context, builder, sig, args, 4 * j, 4), v4),
                             builder.shl(builder.zext(builder.and_(nib, _const(_I8, [7] * 4)), v4), _const(_I32, [8] * 4)))
            g = _grid_words(builder, t.data, _T_IQ1M, ix, 8)
            neg = builder.sext(builder.icmp_unsigned("!=", builder.and_(nib, _const(_I8, [8] * 4)),
                                                     _const(_I8, [0] * 4)), ir.VectorType(_I8, 4))
            neg = builder.shuffle_vector(neg, neg, _const(_I32, [v // 8 for v in range(32)]))
            v8 = _iq1_values(builder, g, neg)
            f = builder.extract_element(sc, ir.Constant(_I32, j >> 1))
            f = builder.and_(builder.lshr(_splat(builder, f, 32), _const(_I32, [6 * (j & 1) + 3 * (v >> 4) for v in range(32)])),
                             _const(_I32, [7] * 32))
            f = builder.add(builder.shl(f, _const(_I32, [1] * 32)), _const(_I32, [1] * 32))
            w8.append(builder.mul(builder.sext(v8, ir.VectorType(i16, 32)), builder.trunc(f, ir.VectorType(i16, 32))))
        return _accumulate8(context, builder, sig, args, 3, w8, signed=True, scales=(d8, None))
    return types.none(w, wo, tab, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


_FLOAT_BITS = {F32_T: (32, 8, 23), F16_T: (16, 5, 10), BF16_T: (16, 8, 7)}  # width, exponent and mantissa bits


def _float_view(builder, qtype, raw):
    """(8 x <32 x i16> q, <8 x float> scale_b) of 8 sub-blocks of F32 / F16 / BF16, raw(j) giving sub-block j's
    <32 x iW> bits as stored: the float view (stratad.model.quants.floats). The sub-block's largest finite magnitude
    (in integers, a max tree over the 8 sub-blocks) gives e and k = max(e - 12, -126), scale_b 2^k, and q = rint(w
    2^-k), w the value as float32 (an F16's formed from its bits by _half; 0 where not finite): the product is exact
    wherever q can be nonzero (|q| <= 2^12 for every finite value), and rint is the add and subtract of 1.5 2^23
    (round half to even in float32 for |x| < 2^22), read back as bits."""
    width, eb, mb = _FLOAT_BITS[qtype]
    bias = (1 << (eb - 1)) - 1 + mb  # a value is mant 2^(max(E, 1) - bias)
    v32, v8 = ir.VectorType(_I32, 32), ir.VectorType(_I32, 8)
    f32, f8 = ir.VectorType(ir.FloatType(), 32), ir.VectorType(ir.FloatType(), 8)

    def c(n, x):
        return ir.Constant(ir.VectorType(_I32, n), [x] * n)

    def magnitude(b):  # the magnitudes' bits, and which are finite
        m = builder.and_(b, ir.Constant(b.type, [(1 << (eb + mb)) - 1] * 32))
        return m, builder.icmp_unsigned("<", m, ir.Constant(b.type, [((1 << eb) - 1) << mb] * 32))

    tops = []
    for j in range(8):  # in the stored width (16-bit types: twice the lanes an op)
        m, f = magnitude(raw(j))
        tops.append(builder.select(f, m, ir.Constant(m.type, [0] * 32)))
    tops = _tree8(builder, tops, 32, lambda x, y: builder.select(builder.icmp_unsigned(">", x, y), x, y))
    tops = tops if width == 32 else builder.zext(tops, v8)
    # the largest magnitude f 2^e (1/2 <= f < 1): e from its exponent field, or a subnormal's length
    ctlz = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, ir.IntType(1)]), "llvm.ctlz.v8i32")
    te = builder.lshr(tops, c(8, mb))
    length = builder.sub(c(8, 32), builder.call(ctlz, [builder.and_(tops, c(8, (1 << mb) - 1)),
                                                       ir.Constant(ir.IntType(1), 0)]))
    e = builder.select(builder.icmp_unsigned(">", te, c(8, 0)), builder.add(te, c(8, mb + 1 - bias)),
                       builder.add(length, c(8, 1 - bias)))
    e = builder.select(builder.icmp_unsigned("==", tops, c(8, 0)), c(8, 0), e)
    k = builder.sub(e, c(8, 12))
    k = builder.select(builder.icmp_signed("<", k, c(8, -126)), c(8, -126), k)
    scale = builder.bitcast(builder.shl(builder.add(k, c(8, 127)), c(8, 23)), f8)
    inverse = builder.bitcast(builder.shl(builder.sub(c(8, 127), k), c(8, 23)), f8)  # 2^-k
    w8 = []
    for j in range(8):
        b = raw(j) if width == 32 else builder.zext(raw(j), v32)
        m, f = magnitude(b)
        if qtype == F16_T:
            x = _half(builder, b)
        else:
            x = builder.bitcast(b if width == 32 else builder.shl(b, c(32, 16)), f32)
        x = builder.fmul(x, builder.shuffle_vector(inverse, inverse, _const(_I32, [j] * 32)))
        x = builder.fadd(builder.select(f, x, ir.Constant(f32, [0.0] * 32)), ir.Constant(f32, [1.5 * 2 ** 23] * 32))
        q = builder.sub(builder.bitcast(x, v32), c(32, 0x4B400000))
        w8.append(builder.trunc(q, ir.VectorType(ir.IntType(16), 32)))
    return w8, scale


def _float_kernels(qtype: int):
    """F32 / F16 / BF16's (block kernel, decoder), both on _float_view: the kernel takes the 8 sub-blocks from w[wo]
    into _accumulate8; decoder(w, wo, g, wb16, sbuf) writes sub-blocks j < g (g <= 8) into wb16[32 j:] and sbuf[j]
    (the slots from g on get sub-block 0's view, never read: no byte past the g sub-blocks is loaded)."""
    width = _FLOAT_BITS[qtype][0]

    def loader(context, builder, aryty, ary, wo, g=None):
        def raw(j):
            jj = ir.Constant(_I64, j) if g is None else builder.select(
                builder.icmp_signed("<", ir.Constant(_I64, j), g), ir.Constant(_I64, j), ir.Constant(_I64, 0))
            off = builder.add(_i64(builder, wo), builder.mul(jj, ir.Constant(_I64, 4 * width)))
            return _vload(context, builder, aryty, ary, off, 32, ir.IntType(width))
        return raw

    @intrinsic
    def kernel(typingctx, w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco):
        if not _blk_ok(w, sbuf, mbuf, a, da, asum, acc):
            return None

        def codegen(context, builder, sig, args):
            w8, scale = _float_view(builder, qtype, loader(context, builder, sig.args[0], args[0], args[1]))
            return _accumulate8(context, builder, sig, args, 2, w8, signed=True, scales=(scale, None))
        return types.none(w, wo, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen

    @intrinsic
    def decoder(typingctx, w, wo, g, wb16, sbuf):
        if not (_is_1d_bytes(w) and _f32_1d(sbuf) and isinstance(wb16, types.Array) and wb16.ndim == 1
                and wb16.dtype == types.int16):
            return None

        def codegen(context, builder, sig, args):
            w8, scale = _float_view(builder, qtype, loader(context, builder, sig.args[0], args[0], args[1],
                                                           _i64(builder, args[2])))
            for j, q in enumerate(w8):
                builder.store(q, _vptr(context, builder, sig.args[3], args[3], ir.Constant(_I64, 32 * j), q.type),
                              align=2)
            builder.store(scale, _vptr(context, builder, sig.args[4], args[4], ir.Constant(_I64, 0), scale.type),
                          align=4)
            return context.get_dummy_value()
        return types.none(w, wo, g, wb16, sbuf), codegen
    return kernel, decoder


(_blk_f32, _dec_f32), (_blk_f16, _dec_f16), (_blk_bf16, _dec_bf16) = (_float_kernels(t) for t in (F32_T, F16_T, BF16_T))


# Byte-field ops for the decoders (16 values an op, in vector registers; numba's loops over arrays it cannot prove
# apart stay scalar): integer operations only, so exact on any host.


def _splat_int(builder, v, n, ty=_I8):
    """<n x ty> of the integer scalar v (truncated to ty)."""
    return _splat(builder, builder.trunc(_i64(builder, v), ty), n)


@intrinsic
def _vfield(typingctx, dst, do, src, so, shift, mask, lshift, keep, sub):
    """dst[do:do + 16] = ((((src[so:][:16] >> shift) & mask) << lshift) | (dst[do:][:16] & keep)) - sub, bytewise."""
    if not _is_1d_bytes(dst, src):
        return None

    def codegen(context, builder, sig, args):
        ds, do_, sr, so_, sh, mk, ls, kp, sb = args
        x = _vload(context, builder, sig.args[2], sr, so_, 16)
        x = builder.shl(builder.and_(builder.lshr(x, _splat_int(builder, sh, 16)), _splat_int(builder, mk, 16)),
                        _splat_int(builder, ls, 16))
        p = _vptr(context, builder, sig.args[0], ds, do_, ir.VectorType(_I8, 16))
        x = builder.or_(x, builder.and_(builder.load(p, align=1), _splat_int(builder, kp, 16)))
        builder.store(builder.sub(x, _splat_int(builder, sb, 16)), p, align=1)
        return context.get_dummy_value()
    return types.none(dst, do, src, so, shift, mask, lshift, keep, sub), codegen


@intrinsic
def _vbit4(typingctx, dst, do, src, so):
    """dst[do + v] |= bit v % 8 of src[so + v // 8], << 4, for v < 16 (Q5_0 / Q5_1's fifth bits)."""
    if not _is_1d_bytes(dst, src):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        b = _vload(context, builder, sig.args[2], args[2], args[3], 2)
        x = builder.shuffle_vector(b, b, _const(_I32, [v // 8 for v in range(16)]))
        x = builder.shl(builder.and_(builder.lshr(x, _const(_I8, [v % 8 for v in range(16)])), _const(_I8, [1] * 16)),
                        _const(_I8, [4] * 16))
        p = _vptr(context, builder, sig.args[0], args[0], args[1], v16)
        builder.store(builder.or_(builder.load(p, align=1), x), p, align=1)
        return context.get_dummy_value()
    return types.none(dst, do, src, so), codegen


# 16-entry byte table lookups: x86's pshufb where the host has it, else a chain of selects (same bytes).
PSHUFB = "+ssse3" in llvm_binding.get_host_cpu_features().flatten().split(",")


def _lut16(builder, t, ix):
    """<16 x i8>: t[ix] bytewise (t: <16 x i8>, ix: indices 0..15)."""
    v16 = ir.VectorType(_I8, 16)
    if PSHUFB:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, v16]),
                                            "llvm.x86.ssse3.pshuf.b.128")
        return builder.call(fn, [t, ix])
    y = _splat(builder, builder.extract_element(t, ir.Constant(_I32, 0)), 16)
    for e in range(1, 16):
        y = builder.select(builder.icmp_unsigned("==", ix, _const(_I8, [e] * 16)),
                           _splat(builder, builder.extract_element(t, ir.Constant(_I32, e)), 16), y)
    return y


@intrinsic
def _vlut16(typingctx, dst, do, src, so, shift, tab, to):
    """dst[do:do + 16] = tab[to + ((src[so:][:16] >> shift) & 15)], bytewise (IQ4's kvalues)."""
    if not _is_1d_bytes(dst, src, tab):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        x = _vload(context, builder, sig.args[2], args[2], args[3], 16)
        ix = builder.and_(builder.lshr(x, _splat_int(builder, args[4], 16)), _const(_I8, [15] * 16))
        y = _lut16(builder, _vload(context, builder, sig.args[5], args[5], args[6], 16), ix)
        builder.store(y, _vptr(context, builder, sig.args[0], args[0], args[1], v16), align=1)
        return context.get_dummy_value()
    return types.none(dst, do, src, so, shift, tab, to), codegen


@intrinsic
def _vgrid(typingctx, n, dst, do, tab, gi, si, add, f):
    """dst[do:do + n] = f * (tab[gi:][:n] * tab[si:][:n] + add) (n a literal): an IQ grid entry times its signs (or,
    IQ1, its values times 8 plus the delta), times the 16-value scale; in int16 for an int16 dst."""
    if not (isinstance(n, types.IntegerLiteral) and _is_1d_bytes(tab) and isinstance(dst, types.Array)
            and dst.ndim == 1 and dst.dtype in (types.int8, types.int16)):
        return None
    width = n.literal_value

    def codegen(context, builder, sig, args):
        args, sig_args = args[1:], sig.args[1:]
        et = ir.IntType(sig_args[0].dtype.bitwidth)
        vt = ir.VectorType(et, width)

        def load(off):
            x = _vload(context, builder, sig_args[2], args[2], off, width)
            return builder.sext(x, vt) if et.width > 8 else x
        x = builder.add(builder.mul(load(args[3]), load(args[4])), _splat_int(builder, args[5], width, et))
        builder.store(builder.mul(x, _splat_int(builder, args[6], width, et)),
                      _vptr(context, builder, sig_args[0], args[0], args[1], vt), align=1)
        return context.get_dummy_value()
    return types.none(n, dst, do, tab, gi, si, add, f), codegen


@intrinsic
def _vmul16(typingctx, dst, do, src, so, f):
    """dst[do:do + 16] = src[so:][:16] * f (int8 / uint8 sources widened by their sign; dst int16 or bytes)."""
    if not (_is_1d_bytes(src) and isinstance(dst, types.Array) and dst.ndim == 1
            and dst.dtype in (types.int8, types.uint8, types.int16)):
        return None

    def codegen(context, builder, sig, args):
        et = ir.IntType(sig.args[0].dtype.bitwidth)
        x = _vload(context, builder, sig.args[2], args[2], args[3], 16)
        if et.width > 8:
            x = (builder.sext if sig.args[2].dtype.signed else builder.zext)(x, ir.VectorType(et, 16))
        p = _vptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(et, 16))
        builder.store(builder.mul(x, _splat_int(builder, args[4], 16, et)), p, align=1)
        return context.get_dummy_value()
    return types.none(dst, do, src, so, f), codegen


@intrinsic
def _dec_iq3s(typingctx, w, wo, grid, wbuf):
    """wbuf[0:256] = the signed int8 weights of the IQ3_S block at w[wo] (decoded once for several tokens)."""
    if not _is_1d_bytes(w, wbuf):
        return None

    def codegen(context, builder, sig, args):
        for j in range(8):
            v = _iq3s_weights(context, builder, sig.args[0], args[0], args[1], ir.Constant(_I64, j), sig.args[2],
                              args[2])
            builder.store(v, _vptr(context, builder, sig.args[3], args[3], ir.Constant(_I64, 32 * j), v.type),
                          align=1)
        return context.get_dummy_value()
    return types.none(w, wo, grid, wbuf), codegen


# ---- scalar helpers -------------------------------------------------------------------------------------------


@njit(nogil=True, cache=True, inline="always")
def _f16(lo, hi, f16e):
    h = np.int64(lo) | (np.int64(hi) << 8)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = np.float32(m) * f16e[0]
    elif e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m | 0x400) * f16e[e]
    if h & 0x8000:
        v = -v
    return v


@njit(nogil=True, cache=True, inline="always")
def _exp(x, pow2):
    """canonical.exp: clamp, n = rint(x log2 e), Cody-Waite reduction, degree-7 Horner, times 2^n."""
    if x < _EXP_LO:
        x = _EXP_LO
    if x > _EXP_HI:
        x = _EXP_HI
    n = np.rint(x * _LOG2E)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _P0
    p = p * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * r + _P6
    p = p * r + _P7
    k = np.int64(n) + 126  # in 0..253 for every finite or infinite x; a NaN x gives NaN either way,
    k = min(max(k, 0), 253)  # but must not index outside the table
    return p * pow2[k]


@intrinsic
def _fold32(typingctx, acc, o):
    """Canonical fold of the 32 lane sums acc[o:o + 32] (float32, 1-D): lane l += lane l + off for
    off = 16, 8, 4, 2, 1 (plain IEEE adds, no fast-math flags: the exact tree of canonical.lane_sum) -> lane 0."""
    if not (isinstance(acc, types.Array) and acc.ndim == 1 and acc.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        v = builder.load(_vptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(f32, 32)), align=4)
        n = 32
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(v, v, _const(_I32, range(n)))
            hi = builder.shuffle_vector(v, v, _const(_I32, range(n, 2 * n)))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(acc, o), codegen


# ---- row dots -------------------------------------------------------------------------------------------------
# Weight rows i = 0..nrows-1 (bytes w[ro + i * rb:]) against n activation rows: res[k * nrows + i] = canonical dot
# of row i with activation row idx[k] (a: int8, flat, nsub * 32 per row; da, asum: float32, flat, nsub per row).
# Every array is 1-D, no view is made in the loops and the loop over rows is inside these functions, so numba's
# reference counting (atomic increments on the shared arrays, which would bounce cache lines between the pool's
# threads) happens once per call, not per row. acc holds n x 32 virtual lanes.


@njit(nogil=True, cache=True, inline="always")
def _rows_iq3s(w, ro, rb, nrows, nsub, a, da, asum, idx, n, acc, wbuf, sbuf, res, f16e, grid):
    for i in range(nrows):
        for l in range(n * LANES):
            acc[l] = _ZERO
        for bi in range(nsub // 8):
            o = ro + i * rb + bi * 110
            d = _f16(w[o], w[o + 1], f16e)
            for j in range(8):
                nib = (np.int64(w[o + 106 + (j >> 1)]) >> (4 * (j & 1))) & 0xF
                sbuf[j] = d * np.float32(1 + 2 * nib)
            lane0 = (bi * 8) & 31
            if n == 1:
                t = idx[0] * nsub + bi * 8
                _blk_iq3s(w, o, grid, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
            else:
                _dec_iq3s(w, o, grid, wbuf)
                for k in range(n):
                    t = idx[k] * nsub + bi * 8
                    _blk_i8(wbuf, 0, SUB, sbuf, None, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
        for k in range(n):
            res[k * nrows + i] = _fold32(acc, k * LANES)


@njit(nogil=True, cache=True, inline="always")
def _rows_q4k(w, ro, rb, nrows, nsub, a, da, asum, idx, n, acc, sbuf, mbuf, res):
    for i in range(nrows):
        for l in range(n * LANES):
            acc[l] = _ZERO
        for bi in range(nsub // 8):
            o = ro + i * rb + bi * 144
            lane0 = (bi * 8) & 31
            for k in range(n):
                t = idx[k] * nsub + bi * 8
                _blk_q4k(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
        for k in range(n):
            res[k * nrows + i] = _fold32(acc, k * LANES)


@njit(nogil=True, cache=True, inline="always")
def _rows_q80(w, ro, rb, nrows, nsub, a, da, asum, idx, n, acc, sbuf, res, f16e):
    for i in range(nrows):
        for l in range(n * LANES):
            acc[l] = _ZERO
        for bg in range(nsub // 8):  # 8 blocks of 32 at a time
            o = ro + i * rb + bg * 8 * 34
            for j in range(8):
                sbuf[j] = _f16(w[o + 34 * j], w[o + 34 * j + 1], f16e)
            lane0 = (bg * 8) & 31
            for k in range(n):
                t = idx[k] * nsub + bg * 8
                _blk_i8(w, o + 2, 34, sbuf, None, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
        for b in range(nsub // 8 * 8, nsub):  # rows of a length that is not a multiple of 256
            o = ro + i * rb + b * 34
            d = _f16(w[o], w[o + 1], f16e)
            for k in range(n):
                t = idx[k] * nsub + b
                s = _idot_i8(w, o + 2, a, t * SUB)
                acc[k * LANES + (b & 31)] += (d * da[t]) * np.float32(s)
        for k in range(n):
            res[k * nrows + i] = _fold32(acc, k * LANES)


# ---- decoded-block kernels: every other quantised type ----------------------------------------------------------
# One mechanism: a type's decoder turns one 256-value block (or up to 8 consecutive 32-value blocks) into its
# canonical integer view (docs/quant-types.md) in small buffers: q (int8, uint8 or int16: _DECODED says which), the
# sub-blocks' scale and minimum, Q2_K's mweights; _rows_dec then forms the 8 sub-blocks' exact integer sums and
# canonical terms for every token sharing the expert (_blk_dec), so a block is decoded once however many tokens
# read it. Every factor is formed exactly as the view forms it (same float32 operations, same order). The decoders
# are plain njit functions, not inlined into the row loop: inlined, the a3b layer ran 15-35 % faster for Q4_0 / Q5_K
# / Q6_K, but numba's first compile of the pool took 64 s instead of 20 s on the 2-core box (every CPU card's lane
# and every fresh install pays it once).


@njit(nogil=True, cache=True, inline="always")
def _u16(w, o):
    return np.int64(w[o]) | (np.int64(w[o + 1]) << 8)


@njit(nogil=True, cache=True, inline="always")
def _u32(w, o):
    return _u16(w, o) | (_u16(w, o + 2) << 16)


@njit(nogil=True, cache=True, inline="always")
def _k4_scales(w, o, sbuf, mbuf, f16e):
    """Q4_K / Q5_K block at w[o]: scale_j = d * sc_j, minimum_j = dmin * m_j (6-bit sc / m packed in 12 bytes)."""
    d = _f16(w[o], w[o + 1], f16e)
    dmin = _f16(w[o + 2], w[o + 3], f16e)
    for j in range(4):
        sbuf[j] = d * np.float32(np.int64(w[o + 4 + j]) & 0x3F)
        mbuf[j] = dmin * np.float32(np.int64(w[o + 8 + j]) & 0x3F)
        md = np.int64(w[o + 12 + j])
        sbuf[j + 4] = d * np.float32((md & 0x0F) | ((np.int64(w[o + 4 + j]) >> 2) & 0x30))
        mbuf[j + 4] = dmin * np.float32((md >> 4) | ((np.int64(w[o + 8 + j]) >> 2) & 0x30))


@njit(nogil=True, cache=True, inline="always")
def _nib_sub(w, p, wb, wo, bias):
    """A 32-value sub-block of 4-bit codes - bias: 16 bytes at w[p], low nibbles then high."""
    _vfield(wb, wo, w, p, 0, 15, 0, 0, bias)
    _vfield(wb, wo + 16, w, p, 4, 15, 0, 0, bias)


@njit(nogil=True, cache=True, inline="always")
def _q5_sub(w, p, wb, wo):
    """Q5_0 / Q5_1 codes: 32 high bits (bit v for value v) at w[p], then the 16 nibble bytes."""
    _nib_sub(w, p + 4, wb, wo, 0)
    _vbit4(wb, wo, w, p)
    _vbit4(wb, wo + 16, w, p + 2)


@njit(nogil=True, cache=True, inline="always")
def _lut_sub(w, p, wb8, wo, tab, t):
    """IQ4 / MXFP4 sub-block: 16 bytes at w[p], low nibbles then high, each the index of its value in tab[t:]."""
    _vlut16(wb8, wo, w, p, 0, tab, t)
    _vlut16(wb8, wo + 16, w, p, 4, tab, t)


@njit(nogil=True, cache=True, inline="always")
def _scale16(wb8, f, k, wb16):
    """Values 16 k .. 16 k + 15 of the codes in wb8 times their 16-value integer scale f, into wb16."""
    _vmul16(wb16, 16 * k, wb8, 16 * k, f)


@njit(nogil=True, cache=True, inline="always")
def _ksign(tab, i):
    """ggml's ksigns[i]: 7 sign bits and their parity."""
    return np.int64(tab[_T_KSIGNS + i]) & 0xFF


@njit(nogil=True, cache=True)
def _dec_legacy(qtype, w, o, g, wb8, wbu, sbuf, mbuf, f16e, tab):
    """g consecutive 32-value blocks from w[o]: Q4_0 / Q5_0 (int8 q = code - 8 / - 16), Q4_1 / Q5_1 (uint8 q = code,
    minimum = -m), IQ4_NL (q = kvalues[code]). Layout: f16 d [, f16 m] [, 32 high bits (Q5)], 16 nibble bytes. And
    MXFP4: an exponent byte e (scale 2^(e - 128)), then 16 nibble bytes (q = the doubled E2M1 value)."""
    bb = _BB[qtype]
    has_m = qtype == Q4_1 or qtype == Q5_1
    five = qtype == Q5_0 or qtype == Q5_1
    for j in range(g):
        b = o + j * bb
        if qtype == MXFP4:
            e = np.int64(w[b])
            sbuf[j] = POW2[e - 2] if e >= 2 else POW2[0] * (F32(0.5) if e == 1 else F32(0.25))
            _lut_sub(w, b + 1, wb8, SUB * j, tab, _T_MXFP4)
            continue
        sbuf[j] = _f16(w[b], w[b + 1], f16e)
        if qtype == IQ4_NL:
            _lut_sub(w, b + 2, wb8, SUB * j, tab, _T_IQ4)
            continue
        p = b + 2
        if has_m:
            mbuf[j] = -_f16(w[b + 2], w[b + 3], f16e)
            p += 2
        if five:
            _q5_sub(w, p, wbu, SUB * j)
            if not has_m:  # Q5_0's q: code - 16, as int8
                _vfield(wb8, SUB * j, wbu, SUB * j, 0, 255, 0, 0, 16)
                _vfield(wb8, SUB * j + 16, wbu, SUB * j + 16, 0, 255, 0, 0, 16)
        elif has_m:
            _nib_sub(w, p, wbu, SUB * j, 0)
        else:  # Q4_0's q: code - 8, as int8
            _nib_sub(w, p, wb8, SUB * j, 8)


@njit(nogil=True, cache=True)
def _dec_q5k(w, o, wbu, sbuf, mbuf, f16e):
    """Q5_K: q = 4-bit code (bytes 48 + 32 (j // 2), low nibbles for even j) | bit j of qh[v] << 4."""
    _k4_scales(w, o, sbuf, mbuf, f16e)
    for j in range(8):
        for hh in range(2):
            _vfield(wbu, SUB * j + 16 * hh, w, o + 48 + 32 * (j >> 1) + 16 * hh, 4 * (j & 1), 15, 0, 0, 0)
            _vfield(wbu, SUB * j + 16 * hh, w, o + 16 + 16 * hh, j, 1, 4, 255, 0)


@njit(nogil=True, cache=True)
def _dec_q2k(w, o, wbu, mwu, sbuf, mbuf, f16e, tab):
    """Q2_K: scale d, q = sc_k * code, minimum dmin, mweight m_k (sc_k / m_k: the low / high nibble of byte k, per
    16 values; the 2-bit codes: bits 2 (j % 4) of qs[32 (j // 4) + v])."""
    d = _f16(w[o + 80], w[o + 81], f16e)
    dmin = _f16(w[o + 82], w[o + 83], f16e)
    for j in range(8):
        sbuf[j] = d
        mbuf[j] = dmin
        for hh in range(2):
            _vfield(wbu, SUB * j + 16 * hh, w, o + 16 + 32 * (j >> 2) + 16 * hh, 2 * (j & 3), 3, 0, 0, 0)
    for k in range(16):
        sc = np.int64(w[o + k])
        _vmul16(wbu, 16 * k, wbu, 16 * k, sc & 15)
        _vmul16(mwu, 16 * k, tab, _T_ONES, sc >> 4)


@njit(nogil=True, cache=True)
def _dec_q3k(w, o, wb8, wb16, sbuf, f16e):
    """Q3_K: scale d, q = (sc_k - 32) * code, code = 2 low bits (bits 2 (j % 4) of qs[32 (j // 4) + v]) - 4 where
    bit j of hmask[v] is clear."""
    d = _f16(w[o + 108], w[o + 109], f16e)
    for j in range(8):
        sbuf[j] = d
        for hh in range(2):
            _vfield(wb8, SUB * j + 16 * hh, w, o + 32 + 32 * (j >> 2) + 16 * hh, 2 * (j & 3), 3, 0, 0, 0)
            _vfield(wb8, SUB * j + 16 * hh, w, o + 16 * hh, j, 1, 2, 255, 4)
    for k in range(16):
        sc = (((np.int64(w[o + 96 + (k & 7)]) >> (4 * (k >> 3))) & 15)
              | (((np.int64(w[o + 104 + (k & 3)]) >> (2 * (k >> 2))) & 3) << 4)) - 32
        _scale16(wb8, sc, k, wb16)


@njit(nogil=True, cache=True)
def _dec_q6k(w, o, wb8, wb16, sbuf, f16e):
    """Q6_K: scale d, q = sc_k * (code - 32); sub-block j = 4 h + p: code = nibble p // 2 of ql[64 h + 32 (p % 2)
    + v] | bits 2 p of qh[32 h + v] << 4; sc_k an int8."""
    d = _f16(w[o + 208], w[o + 209], f16e)
    for j in range(8):
        sbuf[j] = d
        h, p = j >> 2, j & 3
        for hh in range(2):
            _vfield(wb8, SUB * j + 16 * hh, w, o + 64 * h + 32 * (p & 1) + 16 * hh, 4 * (p >> 1), 15, 0, 0, 0)
            _vfield(wb8, SUB * j + 16 * hh, w, o + 128 + 32 * h + 16 * hh, 2 * p, 3, 4, 255, 32)
    for k in range(16):
        _scale16(wb8, np.int64(np.int8(w[o + 192 + k])), k, wb16)


@njit(nogil=True, cache=True)
def _dec_iq4xs(w, o, wb8, sbuf, f16e, tab):
    """IQ4_XS: scale d * (ls_j - 32), ls_j = nibble of scales_l | 2 bits of scales_h << 4; q = kvalues[code]."""
    d = _f16(w[o], w[o + 1], f16e)
    sh = _u16(w, o + 2)
    for j in range(8):
        ls = ((np.int64(w[o + 4 + (j >> 1)]) >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4)
        sbuf[j] = d * np.float32(ls - 32)
        _lut_sub(w, o + 8 + 16 * j, wb8, SUB * j, tab, _T_IQ4)


@njit(nogil=True, cache=True)
def _dec_iq3xxs(w, o, wb8, sbuf, f16e, tab):
    """IQ3_XXS: sub-block j has 8 grid indices (4 values each) and a word of 4 x 7 ksign bits and a 4-bit ls;
    scale (d * (0.5 + ls)) * 0.5."""
    d = _f16(w[o], w[o + 1], f16e)
    for j in range(8):
        wd = _u32(w, o + 66 + 4 * j)
        sbuf[j] = (d * (_HALF + np.float32(wd >> 28))) * _HALF
        for g in range(4):
            mask = _ksign(tab, (wd >> (7 * g)) & 127)
            for e in range(2):
                gi = _T_IQ3XXS + 4 * np.int64(w[o + 2 + 8 * j + 2 * g + e])
                _vgrid(4, wb8, SUB * j + 8 * g + 4 * e, tab, gi, _T_SIGN8 + 8 * mask + 4 * e, 0, 1)


@njit(nogil=True, cache=True)
def _dec_iq2xxs(w, o, wb8, sbuf, f16e, tab):
    """IQ2_XXS: sub-block j = 4 grid index bytes, then a word of 4 x 7 ksign bits and a 4-bit ls; scale
    (d * (0.5 + ls)) * 0.25."""
    d = _f16(w[o], w[o + 1], f16e)
    for j in range(8):
        p = o + 2 + 8 * j
        w1 = _u32(w, p + 4)
        sbuf[j] = (d * (_HALF + np.float32(w1 >> 28))) * _QUARTER
        for g in range(4):
            _vgrid(8, wb8, SUB * j + 8 * g, tab, _T_IQ2XXS + 8 * np.int64(w[p + g]),
                    _T_SIGN8 + 8 * _ksign(tab, (w1 >> (7 * g)) & 127), 0, 1)


@njit(nogil=True, cache=True)
def _dec_iq2(qtype, w, o, wb16, sbuf, f16e, tab):
    """IQ2_XS (9-bit index and 7 ksign bits per u16) / IQ2_S (8 + 2 high bits of index, a sign byte per 8 values):
    scale d / 8, q = (2 ls_k + 1) * signed grid value, ls_k the nibble k of the scale bytes."""
    d8 = _f16(w[o], w[o + 1], f16e) * _EIGHTH
    so = o + 66 if qtype == IQ2_XS else o + 74
    for j in range(8):
        sbuf[j] = d8
    for k in range(16):
        f = 2 * ((np.int64(w[so + (k >> 1)]) >> (4 * (k & 1))) & 15) + 1
        for e in range(2):
            n = 2 * k + e
            if qtype == IQ2_XS:
                qs = _u16(w, o + 2 + 2 * n)
                gi = _T_IQ2XS + 8 * (qs & 511)
                mask = _ksign(tab, qs >> 9)
            else:
                gi = _T_IQ2S + 8 * (np.int64(w[o + 2 + n]) | (((np.int64(w[o + 66 + (n >> 2)]) >> (2 * (n & 3))) & 3)
                                                              << 8))
                mask = np.int64(w[o + 34 + n])
            _vgrid(8, wb16, 8 * n, tab, gi, _T_SIGN8 + 8 * mask, 0, f)


@njit(nogil=True, cache=True)
def _dec_iq1s(w, o, wb8, sbuf, f16e, tab):
    """IQ1_S: sub-block j = 4 index bytes and a u16 of 4 x 3 high index bits, ls and the delta's sign; scale
    (d * (2 ls + 1)) / 8, q = 8 g +- 1."""
    d = _f16(w[o], w[o + 1], f16e)
    for j in range(8):
        qh = _u16(w, o + 34 + 2 * j)
        sbuf[j] = (d * np.float32(2 * ((qh >> 12) & 7) + 1)) * _EIGHTH
        delta = -1 if qh & 0x8000 else 1
        for g in range(4):
            gi = _T_IQ1S + 8 * (np.int64(w[o + 2 + 4 * j + g]) | (((qh >> (3 * g)) & 7) << 8))
            _vgrid(8, wb8, SUB * j + 8 * g, tab, gi, _T_EIGHTS, delta, 1)


@njit(nogil=True, cache=True)
def _dec_iq1m(w, o, wb16, sbuf, f16e, tab):
    """IQ1_M: scale d / 8 (d's f16 in the top nibbles of the 4 scale words), q = (2 s_k + 1) * (8 g +- 1); per 8
    values a nibble of 3 high index bits and the delta's sign."""
    s0, s1, s2, s3 = _u16(w, o + 48), _u16(w, o + 50), _u16(w, o + 52), _u16(w, o + 54)
    dh = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000)
    d8 = _f16(dh & 0xFF, dh >> 8, f16e) * _EIGHTH
    for j in range(8):
        sbuf[j] = d8
    for k in range(16):
        f = 2 * ((_u16(w, o + 48 + 2 * (k >> 2)) >> (3 * (k & 3))) & 7) + 1
        for e in range(2):
            n = 2 * k + e
            nib = (np.int64(w[o + 32 + (n >> 1)]) >> (4 * (n & 1))) & 15
            gi = _T_IQ1M + 8 * (np.int64(w[o + n]) | ((nib & 7) << 8))
            _vgrid(8, wb16, 8 * n, tab, gi, _T_EIGHTS, -1 if nib & 8 else 1, f)


@njit(nogil=True, cache=True, inline="always")
def _decode(qtype, w, o, g, s, f16e, tab):
    """The decoded view of the block at w[o] (32-value types: g blocks from w[o]) into the scratch buffers s."""
    _, wb8, wbu, mwu, wb16, sbuf, mbuf = s
    if qtype == Q5_K:
        _dec_q5k(w, o, wbu, sbuf, mbuf, f16e)
    elif qtype == Q6_K:
        _dec_q6k(w, o, wb8, wb16, sbuf, f16e)
    elif qtype == Q3_K:
        _dec_q3k(w, o, wb8, wb16, sbuf, f16e)
    elif qtype == Q2_K:
        _dec_q2k(w, o, wbu, mwu, sbuf, mbuf, f16e, tab)
    elif qtype == IQ4_XS:
        _dec_iq4xs(w, o, wb8, sbuf, f16e, tab)
    elif qtype == IQ3_XXS:
        _dec_iq3xxs(w, o, wb8, sbuf, f16e, tab)
    elif qtype == IQ2_XXS:
        _dec_iq2xxs(w, o, wb8, sbuf, f16e, tab)
    elif qtype == IQ2_XS or qtype == IQ2_S:
        _dec_iq2(qtype, w, o, wb16, sbuf, f16e, tab)
    elif qtype == IQ1_S:
        _dec_iq1s(w, o, wb8, sbuf, f16e, tab)
    elif qtype == IQ1_M:
        _dec_iq1m(w, o, wb16, sbuf, f16e, tab)
    elif qtype == F32_T:
        _dec_f32(w, o, g, wb16, sbuf)
    elif qtype == F16_T:
        _dec_f16(w, o, g, wb16, sbuf)
    elif qtype == BF16_T:
        _dec_bf16(w, o, g, wb16, sbuf)
    else:
        _dec_legacy(qtype, w, o, g, wb8, wbu, sbuf, mbuf, f16e, tab)


@njit(nogil=True, cache=True, inline="always")
def _sub_terms(r, wb, sbuf, mbuf, has_min, a, da, asum, t0, acc, acco, lane0):
    """The canonical terms of the first r decoded sub-blocks (a row's last 32-value blocks short of 8), one by one."""
    for j in range(r):
        t = t0 + j
        isum = 0
        for v in range(SUB):
            isum += np.int32(wb[SUB * j + v]) * np.int32(a[t * SUB + v])
        term = (sbuf[j] * da[t]) * np.float32(isum)
        if has_min:
            term = term - (mbuf[j] * da[t]) * asum[t]
        acc[acco + ((lane0 + j) & 31)] += term


@njit(nogil=True, cache=True, inline="always")
def _rows_dec(qtype, w, ro, rb, nrows, a, da, asum, idx, n, s, res, f16e, tab):
    """Any type of _DECODED: per row, each block (32-value types: 8 blocks) decoded once, then its 8 sub-blocks'
    terms for each of the n tokens; a block that one token reads is decoded in registers instead (the _blk_*
    kernels: no buffer written and read back)."""
    acc, wb8, wbu, mwu, wb16, sbuf, mbuf = s
    kind = _KIND[qtype]
    bb = _BB[qtype]
    step = bb * 256 // _BV[qtype]  # bytes of 8 sub-blocks
    nsub = rb // bb * _BV[qtype] // SUB
    ng = nsub // 8
    r = nsub - ng * 8
    for i in range(nrows):
        for l in range(n * LANES):
            acc[l] = _ZERO
        for bg in range(ng):
            o = ro + i * rb + bg * step
            lane0 = (bg * 8) & 31
            # one token: the block (8 blocks of 32) decoded in registers instead. The chain stays in this loop: as a
            # helper function it ran 2.5x slower (measured in session 33, not looked into)
            if n == 1:
                t = idx[0] * nsub + bg * 8
                if qtype == Q4_0:
                    _blk_q40(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q4_1:
                    _blk_q41(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q5_0:
                    _blk_q50(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q5_1:
                    _blk_q51(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ4_NL:
                    _blk_iq4nl(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ4_XS:
                    _blk_iq4xs(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == MXFP4:
                    _blk_mxfp4(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ3_XXS:
                    _blk_iq3xxs(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ2_XXS:
                    _blk_iq2xxs(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ2_XS:
                    _blk_iq2xs(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ2_S:
                    _blk_iq2s(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ1_S:
                    _blk_iq1s(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == IQ1_M:
                    _blk_iq1m(w, o, tab, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == F16_T:
                    _blk_f16(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == BF16_T:
                    _blk_bf16(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == F32_T:
                    _blk_f32(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q5_K:
                    _blk_q5k(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q6_K:
                    _blk_q6k(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                elif qtype == Q3_K:
                    _blk_q3k(w, o, sbuf, None, a, t * SUB, da, asum, t, acc, lane0)
                else:
                    _blk_q2k(w, o, sbuf, mbuf, a, t * SUB, da, asum, t, acc, lane0)
                continue
            _decode(qtype, w, o, 8, s, f16e, tab)
            for k in range(n):
                t = idx[k] * nsub + bg * 8
                if kind == _K_I8:
                    _blk_dec(wb8, None, sbuf, None, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
                elif kind == _K_U8_MIN:
                    _blk_dec(wbu, None, sbuf, mbuf, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
                elif kind == _K_U8_MW:
                    _blk_dec(wbu, mwu, sbuf, mbuf, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
                else:
                    _blk_dec(wb16, None, sbuf, None, a, t * SUB, da, asum, t, acc, k * LANES + lane0)
        if r:  # only 32-value types (kinds _K_I8, _K_U8_MIN) and the float types (_K_I16) have rows whose length is
            # not a multiple of 256
            _decode(qtype, w, ro + i * rb + ng * step, r, s, f16e, tab)
            for k in range(n):
                t = idx[k] * nsub + ng * 8
                if kind == _K_I8:
                    _sub_terms(r, wb8, sbuf, mbuf, False, a, da, asum, t, acc, k * LANES, (ng * 8) & 31)
                elif kind == _K_I16:
                    _sub_terms(r, wb16, sbuf, mbuf, False, a, da, asum, t, acc, k * LANES, (ng * 8) & 31)
                else:
                    _sub_terms(r, wbu, sbuf, mbuf, True, a, da, asum, t, acc, k * LANES, (ng * 8) & 31)
        for k in range(n):
            res[k * nrows + i] = _fold32(acc, k * LANES)


@njit(nogil=True, cache=True, inline="always")
def _scratch(maxg):
    """A phase's work buffers for _rows: (lane sums for maxg tokens, decoded q as int8 / uint8, uint8 mweights,
    int16 q, per sub-block scales, minimums), and the group's token indices."""
    return ((np.empty(maxg * LANES, np.float32), np.empty(256, np.int8), np.empty(256, np.uint8),
             np.empty(256, np.uint8), np.empty(256, np.int16), np.empty(8, np.float32), np.empty(8, np.float32)),
            np.empty(maxg, np.int64))


@njit(nogil=True, cache=True)
def _rows(qtype, w, ro, rb, nrows, a, da, asum, idx, n, s, res, f16e, grid, tab):
    """res[k * nrows + i] = canonical dot of raw weight row i (w[ro + i * rb:], rb bytes) with activation idx[k]
    (s: the _scratch buffers)."""
    acc, wbuf, _, _, _, sbuf, mbuf = s
    if qtype == IQ3_S:
        _rows_iq3s(w, ro, rb, nrows, rb // 110 * 8, a, da, asum, idx, n, acc, wbuf, sbuf, res, f16e, grid)
    elif qtype == Q4_K:
        _rows_q4k(w, ro, rb, nrows, rb // 144 * 8, a, da, asum, idx, n, acc, sbuf, mbuf, res)
    elif qtype == Q8_0:
        _rows_q80(w, ro, rb, nrows, rb // 34, a, da, asum, idx, n, acc, sbuf, res, f16e)
    else:
        _rows_dec(qtype, w, ro, rb, nrows, a, da, asum, idx, n, s, res, f16e, tab)


# ---- the two phases, each over a range [lo, hi) of the flattened (group, row) space ----------------------------
# a pair group = the pairs that share one expert; flattened row i = group * rows + r. Weights come as flat uint8
# arrays (a layer tensor's bytes: n_expert * rows * row_bytes).


@njit(nogil=True, cache=True)
def _act_sums(qa, asum):
    """asum[b] = float32(sum(qa[32 b:32 b + 32])) (flat arrays), the Q4_K minimum's integer factor."""
    for b in range(asum.shape[0]):
        s = 0
        for v in range(SUB):
            s += qa[b * SUB + v]
        asum[b] = np.float32(s)


@njit(nogil=True, cache=True)
def _group(pairs, n_expert, n_tokens, gpairs, gstart, gexp):
    """Pairs grouped by expert, in expert order and, within an expert, in pair order (a counting sort):
    gpairs = pair indices, group g = gpairs[gstart[g]:gstart[g + 1]] of expert gexp[g]. Returns (groups,
    largest group), or (-1, 0) if a token or expert index is out of range."""
    start = np.zeros(n_expert + 1, np.int64)
    for i in range(pairs.shape[0]):
        t, e = pairs[i, 0], pairs[i, 1]
        if t < 0 or t >= n_tokens or e < 0 or e >= n_expert:
            return -1, 0
        start[e + 1] += 1
    ngrp = 0
    maxg = 0
    for e in range(n_expert):
        size = start[e + 1]
        if size:
            gstart[ngrp] = start[e]
            gexp[ngrp] = e
            ngrp += 1
            maxg = max(maxg, size)
        start[e + 1] += start[e]
    gstart[ngrp] = pairs.shape[0]
    for i in range(pairs.shape[0]):
        e = pairs[i, 1]
        gpairs[start[e]] = i
        start[e] += 1
    return ngrp, maxg


CHUNK = 64  # rows per _rows call


@njit(nogil=True, cache=True, inline="always")
def _span(i, hi, rows, gstart):
    """The piece of flattened row i's group that a phase computes next: (group, first row, rows, the group's first
    pair, its pairs), at most CHUNK rows and none past hi."""
    grp = i // rows
    r0 = i - grp * rows
    p0 = gstart[grp]
    return grp, r0, min(rows - r0, CHUNK, hi - i), p0, gstart[grp + 1] - p0


@njit(nogil=True, cache=True)
def _gate_up(lo, hi, tg, tu, gate, up, d_ff, rb_g, rb_u, a, da, asum, pair_tok, gstart, gpairs, gexp, maxg, h, f16e,
             pow2, grid, tab):
    """h[p * d_ff + r] = silu(gate_e[r] . x_t) * (up_e[r] . x_t) for the flattened rows [lo, hi)."""
    s, idx = _scratch(maxg)
    gv = np.empty(maxg * CHUNK, np.float32)
    uv = np.empty(maxg * CHUNK, np.float32)
    i = lo
    while i < hi:
        grp, r0, m, p0, n = _span(i, hi, d_ff, gstart)
        for k in range(n):
            idx[k] = pair_tok[gpairs[p0 + k]]
        e = gexp[grp]
        _rows(tg, gate, (e * d_ff + r0) * rb_g, rb_g, m, a, da, asum, idx, n, s, gv, f16e, grid, tab)
        _rows(tu, up, (e * d_ff + r0) * rb_u, rb_u, m, a, da, asum, idx, n, s, uv, f16e, grid, tab)
        for k in range(n):
            ho = gpairs[p0 + k] * d_ff + r0
            for r in range(m):
                g = gv[k * m + r]
                h[ho + r] = (g / (_ONE + _exp(-g, pow2))) * uv[k * m + r]
        i += m


@njit(nogil=True, cache=True)
def _quantize(h, lo, hi, n, qh, dh, hsum):
    """canonical.quantize_act of rows [lo, hi) of h (flat, n values a row) into qh (flat int8), dh and hsum (flat,
    n / 32 a row; hsum = the sub-blocks' integer sums, for a Q4_K down)."""
    for b in range(lo * (n // SUB), hi * (n // SUB)):
        o = b * SUB
        amax = _ZERO
        for v in range(SUB):
            x = abs(h[o + v])
            if x > amax:
                amax = x
        d = amax / _127
        inv = _ONE / d if d > _ZERO else _ZERO
        if np.isinf(inv):  # a subnormal d whose 1 / d overflows: q = 0 by definition, not a cast of inf
            inv = _ZERO
        s = 0
        for v in range(SUB):
            q = np.int64(np.rint(h[o + v] * inv))
            qh[o + v] = q
            s += q
        dh[b] = d
        hsum[b] = np.float32(s)


@njit(nogil=True, cache=True)
def _down(lo, hi, td, down, d_model, rb_d, a, dh, hsum, gstart, gpairs, gexp, maxg, out, f16e, grid, tab):
    """out[p * d_model + r] = down_e[r] . h_p for the flattened rows [lo, hi) (a: the pairs' quantised h)."""
    s, idx = _scratch(maxg)
    res = np.empty(maxg * CHUNK, np.float32)
    i = lo
    while i < hi:
        grp, r0, m, p0, n = _span(i, hi, d_model, gstart)
        for k in range(n):
            idx[k] = gpairs[p0 + k]
        e = gexp[grp]
        _rows(td, down, (e * d_model + r0) * rb_d, rb_d, m, a, dh, hsum, idx, n, s, res, f16e, grid, tab)
        for k in range(n):
            oo = idx[k] * d_model + r0
            for r in range(m):
                out[oo + r] = res[k * m + r]
        i += m


# ---- work sharing: threads take CHUNK-row units from an atomic ticket counter (a busy core just takes fewer) ------


@intrinsic
def _ticket(typingctx, counter):
    """Atomic counter[0] += 1 (int64 array), returning the old value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and counter.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        p = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [ir.Constant(_I64, 0)])
        return builder.atomic_rmw("add", p, ir.Constant(_I64, 1), "monotonic")
    return types.int64(counter), codegen


@njit(nogil=True, cache=True)
def _gate_up_worker(ticket, n, tg, tu, gate, up, d_ff, rb_g, rb_u, a, da, asum, pair_tok, gstart, gpairs, gexp, maxg,
                    h, f16e, pow2, grid, tab):
    while True:
        lo = _ticket(ticket) * CHUNK
        if lo >= n:
            return
        _gate_up(lo, min(n, lo + CHUNK), tg, tu, gate, up, d_ff, rb_g, rb_u, a, da, asum, pair_tok, gstart, gpairs,
                 gexp, maxg, h, f16e, pow2, grid, tab)


@njit(nogil=True, cache=True)
def _down_worker(ticket, n, td, down, d_model, rb_d, a, dh, hsum, gstart, gpairs, gexp, maxg, out, f16e, grid, tab):
    while True:
        lo = _ticket(ticket) * CHUNK
        if lo >= n:
            return
        _down(lo, min(n, lo + CHUNK), td, down, d_model, rb_d, a, dh, hsum, gstart, gpairs, gexp, maxg, out, f16e,
              grid, tab)


@njit(nogil=True, cache=True, inline="always")
def _part(c, n, parts):
    """[lo, hi) of part c of [0, n) cut into `parts` near-equal ranges (a prange worker's share)."""
    return c * n // parts, (c + 1) * n // parts


@njit(nogil=True, cache=True, parallel=True)
def _layer_parallel(nthreads, tickets, tg, tu, td, gate, up, down, d_ff, d_model, rb_g, rb_u, rb_d, a, da, asum,
                    pair_tok, gstart, gpairs, gexp, maxg, h, qh, dh, hsum, out, f16e, pow2, grid, tab):
    """The whole layer in one call on numba's own threads (prange over nthreads workers sharing the tickets)."""
    ngrp = gstart.shape[0] - 1
    t1 = tickets[0:1]
    t2 = tickets[8:9]
    for w in prange(nthreads):
        _gate_up_worker(t1, ngrp * d_ff, tg, tu, gate, up, d_ff, rb_g, rb_u, a, da, asum, pair_tok, gstart, gpairs,
                        gexp, maxg, h, f16e, pow2, grid, tab)
    npair = gpairs.shape[0]
    for c in prange(nthreads):
        lo, hi = _part(c, npair, nthreads)
        _quantize(h, lo, hi, d_ff, qh, dh, hsum)
    for w in prange(nthreads):
        _down_worker(t2, ngrp * d_model, td, down, d_model, rb_d, qh, dh, hsum, gstart, gpairs, gexp, maxg, out, f16e,
                     grid, tab)


@dataclass
class LayerJobs:
    """One layer's CPU share: the layer's expert tensors and the (token, expert) pairs to compute.

    gate, up: uint8 (n_expert, d_ff, row_bytes); down: uint8 (n_expert, d_model, row_bytes) — the GGUF bytes as
    they are (ModelFile.raw(f"blk.{layer}.ffn_gate_exps.weight"), or the arena's view of the same bytes).
    gate_type / up_type / down_type: GGML type codes (any of quants.EXPERT_TYPES; each may differ).
    pairs: int32 (n_pairs, 2) of (token, expert); qa int8 (n_tok, d_model / 32, 32), da float32 (n_tok,
    d_model / 32): the tokens' activations quantised by canonical.quantize_act.
    """

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    gate_type: int
    up_type: int
    down_type: int
    pairs: np.ndarray
    qa: np.ndarray
    da: np.ndarray

    @classmethod
    def from_model(cls, model, layer: int, pairs, qa, da) -> "LayerJobs":
        return cls(*_layer_tensors(model, layer), np.asarray(pairs, np.int32).reshape(-1, 2), qa, da)


_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> layer -> its expert tensors


def _layer_tensors(model, layer: int) -> tuple:
    """(gate, up, down, their type codes) of a layer, made once per model: plain ndarray views of the mapping (a
    np.memmap slice costs tens of microseconds, and the same objects let CpuPool reuse its checks)."""
    per_model = _LAYERS.setdefault(model, {})
    t = per_model.get(layer)
    if t is None:
        kinds = ("gate", "up", "down")
        t = per_model[layer] = (*(model.raw(f"blk.{layer}.ffn_{k}_exps.weight").view(np.ndarray) for k in kinds),
                                *(int(model.expert_type(layer, k)) for k in kinds))
    return t


def _check_tensors(jobs: LayerJobs) -> None:
    """Shapes and types of the weights: the kernels do no bounds checks, so everything they touch is verified."""
    for name in ("gate", "up", "down"):
        if getattr(jobs, name).ndim != 3:
            raise ValueError(f"{name}: expected (n_expert, rows, row_bytes), got shape {getattr(jobs, name).shape}")
    ne, d_ff, _ = jobs.gate.shape
    _, d_model, _ = jobs.down.shape
    for name, arr, rows, n, t in (("gate", jobs.gate, d_ff, d_model, jobs.gate_type),
                                  ("up", jobs.up, d_ff, d_model, jobs.up_type),
                                  ("down", jobs.down, d_model, d_ff, jobs.down_type)):
        if t not in _SUPPORTED:
            raise ValueError(f"{name}: unsupported expert type {t}")
        if not fmt(t).quantised and arr.dtype != np.uint8 and arr.flags.c_contiguous:
            arr = arr.view(np.uint8)  # float experts as the reader gives them (float / bf16 as uint16): their bytes
        if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[0] != ne or arr.shape[1] != rows:
            raise ValueError(f"{name}: expected uint8 ({ne}, {rows}, row_bytes), got {arr.dtype} {arr.shape}")
        if arr.shape[2] != fmt(t).row_bytes(n):
            raise ValueError(f"{name}: row of {arr.shape[2]} bytes is not {n} values of type {t}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous")


def _check_inputs(jobs: LayerJobs, d_model: int) -> None:
    """The activations and the pair list (token and expert indices are checked while grouping, in _group)."""
    if jobs.qa.dtype != np.int8 or jobs.qa.shape[1:] != (d_model // SUB, SUB):
        raise ValueError(f"qa: expected int8 (n_tok, {d_model // SUB}, {SUB}), got {jobs.qa.dtype} {jobs.qa.shape}")
    if jobs.da.dtype != np.float32 or jobs.da.shape != jobs.qa.shape[:2]:
        raise ValueError(f"da: expected float32 {jobs.qa.shape[:2]}, got {jobs.da.dtype} {jobs.da.shape}")
    p = np.asarray(jobs.pairs)
    if p.ndim != 2 or p.shape[1] != 2 or p.dtype.kind not in "iu":
        raise ValueError(f"pairs: expected integer (n_pairs, 2), got {p.dtype} {p.shape}")


_PRANGE_LOCK = threading.Lock()


def _flat_readonly(x: np.ndarray) -> np.ndarray:
    """A flat read-only ndarray view of weight bytes (np.asarray turns a np.memmap into a plain ndarray; float
    experts come as their floats), so that the kernels see one array type (one compiled specialisation) for file
    mappings, arenas and test arrays."""
    v = np.asarray(x).reshape(-1).view(np.uint8)
    v.setflags(write=False)
    return v


class CpuPool:
    """Computes experts on `threads` OS threads: one numba parallel call per layer on numba's own thread pool;
    inside it `threads` workers take units of CHUNK rows from a shared atomic ticket counter, for gate/up + SwiGLU,
    then quantise h, then down (so a core that is busy elsewhere just takes fewer units). numba's default threading
    layer must not be entered from two Python threads at once, so calls are serialised on a module-wide lock.
    Every output element is computed by the same sequential code whichever worker computes it."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError("threads must be >= 1")
        import numba

        self.threads = min(threads, numba.config.NUMBA_NUM_THREADS)
        self._checked: dict[tuple, tuple] = {}

    def close(self) -> None:
        self._checked.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _weights(self, jobs: LayerJobs) -> tuple:
        """The layer's weights checked and flattened, once per set of tensor objects (LayerJobs.from_model hands
        out the same ones every call): (gate, up, down flat read-only, d_ff, d_model)."""
        key = (id(jobs.gate), id(jobs.up), id(jobs.down), jobs.gate_type, jobs.up_type, jobs.down_type)
        hit = self._checked.get(key)
        if hit is None:
            _check_tensors(jobs)
            if len(self._checked) >= 1024:  # callers that pass new arrays each time
                self._checked.clear()
            hit = self._checked[key] = ((jobs.gate, jobs.up, jobs.down),  # kept alive: the ids stay theirs
                                        tuple(_flat_readonly(x) for x in (jobs.gate, jobs.up, jobs.down)),
                                        jobs.gate.shape[1], jobs.down.shape[1])
        return (*hit[1], hit[2], hit[3])

    def run(self, jobs: LayerJobs, out: np.ndarray | None = None) -> np.ndarray:
        """float32 (n_pairs, d_model): canonical.expert of each (token, expert) pair, in the pairs' order (into
        out, a C-contiguous float32 (n_pairs, d_model) array, when given: e.g. pinned memory a GPU reads)."""
        gate, up, down, d_ff, d_model = self._weights(jobs)
        _check_inputs(jobs, d_model)
        pairs = np.ascontiguousarray(jobs.pairs, np.int32)
        n_pairs = pairs.shape[0]
        if out is None:
            out = np.empty((n_pairs, d_model), F32)
        elif out.dtype != F32 or out.shape != (n_pairs, d_model) or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32 ({n_pairs}, {d_model})")
        if n_pairs == 0:
            return out
        # group the pairs by expert (each weight row is then read once for all its tokens)
        qa = np.ascontiguousarray(jobs.qa).reshape(-1)
        da = np.ascontiguousarray(jobs.da).reshape(-1)
        asum = np.empty(da.shape, F32)
        _act_sums(qa, asum)
        import numba

        gpairs, gstart, gexp = np.empty(n_pairs, np.int64), np.empty(n_pairs + 1, np.int64), np.empty(n_pairs, np.int64)
        ngrp, maxg = _group(pairs, jobs.gate.shape[0], jobs.qa.shape[0], gpairs, gstart, gexp)
        if ngrp < 0:
            raise ValueError("pairs: token or expert index out of range")
        gstart, gexp = gstart[:ngrp + 1], gexp[:ngrp]
        pair_tok = pairs[:, 0].astype(np.int64)
        h = np.empty(n_pairs * d_ff, F32)
        qh = np.empty(n_pairs * d_ff, np.int8)
        dh = np.empty(n_pairs * d_ff // SUB, F32)
        hsum = np.empty(n_pairs * d_ff // SUB, F32)
        tg, tu, td = int(jobs.gate_type), int(jobs.up_type), int(jobs.down_type)
        rb_g, rb_u, rb_d = fmt(tg).row_bytes(d_model), fmt(tu).row_bytes(d_model), fmt(td).row_bytes(d_ff)
        flat = out.reshape(-1)
        with _PRANGE_LOCK:
            numba.set_num_threads(self.threads)
            _layer_parallel(self.threads, np.zeros(16, np.int64), tg, tu, td, gate, up, down, d_ff, d_model,
                            rb_g, rb_u, rb_d, qa, da, asum, pair_tok, gstart, gpairs, gexp, maxg, h, qh, dh, hsum,
                            flat, F16E, POW2, GRID, TAB)
        return out
