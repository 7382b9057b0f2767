"""Block kernels: 8 sub-blocks (256 values) of one weight row against one activation row, decoded and summed in
vector registers, one kernel per expert type (`_blk_*`), with the float types' one view decoder (`_float_view`)."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from stratad.model.quants.iquants import IQ4_VALUES
from stratad.model.quants.mx import MXFP4_VALUES

from lane.cpu_pool.byte_ops import _lut16
from lane.cpu_pool.simd import (
    VNNI, _I32, _I64, _I8, _const, _grid_words, _i64, _iq3s_parts, _is_1d_bytes, _ksigns, _negatives, _splat,
    _vload, _vptr)
from lane.cpu_pool.tables import (
    BF16_T, F16_T, F32_T, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_XXS, IQ4_NL, IQ4_XS, MXFP4, _T_IQ1M, _T_IQ1S, _T_IQ2S,
    _T_IQ2XS, _T_IQ2XXS, _T_IQ3XXS)

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
            neg = builder.icmp_unsigned("!=", builder.and_(qh, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 0))
            w8.append(builder.add(builder.shl(g, _bytes(3)), builder.select(neg, _bytes(255), _bytes(1))))
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
            neg = builder.icmp_unsigned("!=", builder.and_(nib, _const(_I8, [8] * 4)), _const(_I8, [0] * 4))
            neg = builder.shuffle_vector(neg, neg, _const(_I32, [v // 8 for v in range(32)]))
            v8 = builder.add(builder.shl(g, _bytes(3)), builder.select(neg, _bytes(255), _bytes(1)))
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
