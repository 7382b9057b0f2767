"""Block kernels of the legacy 32-value types (Q4_0..Q5_1), the 16-entry table types (IQ4_NL, IQ4_XS, MXFP4),
IQ3_XXS / IQ2_XXS, IQ2_XS / IQ2_S and IQ1_S / IQ1_M: each type's block formed in registers, then the same
canonical accumulation (blocks.py)."""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from stratad.model.quants.iquants import IQ4_VALUES
from stratad.model.quants.mx import MXFP4_VALUES
from lane.cpu_pool.tables import (
    IQ2_S, IQ2_XS, IQ2_XXS, IQ3_XXS, IQ4_NL, IQ4_XS, MXFP4, _T_IQ1M, _T_IQ1S, _T_IQ2S, _T_IQ2XS, _T_IQ2XXS, _T_IQ3XXS
)
from lane.cpu_pool.vector_ir import (
    _I32, _I64, _I8, _const, _grid_words, _i64, _is_1d_bytes, _ksigns, _negatives, _splat, _vload
)
from lane.cpu_pool.blocks import _accumulate8, _blk_ok, _bytes, _bytes_at, _d8, _field, _half, _half_at
from lane.cpu_pool.byte_ops import _lut16


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
            hi3 = builder.zext(builder.and_(nib, _const(_I8, [7] * 4)), v4)
            ix = builder.or_(builder.zext(_bytes_at(context, builder, sig, args, 4 * j, 4), v4),
                             builder.shl(hi3, _const(_I32, [8] * 4)))
            g = _grid_words(builder, t.data, _T_IQ1M, ix, 8)
            neg = builder.sext(builder.icmp_unsigned("!=", builder.and_(nib, _const(_I8, [8] * 4)),
                                                     _const(_I8, [0] * 4)), ir.VectorType(_I8, 4))
            neg = builder.shuffle_vector(neg, neg, _const(_I32, [v // 8 for v in range(32)]))
            v8 = _iq1_values(builder, g, neg)
            f = builder.extract_element(sc, ir.Constant(_I32, j >> 1))
            shifts = _const(_I32, [6 * (j & 1) + 3 * (v >> 4) for v in range(32)])
            f = builder.and_(builder.lshr(_splat(builder, f, 32), shifts), _const(_I32, [7] * 32))
            f = builder.add(builder.shl(f, _const(_I32, [1] * 32)), _const(_I32, [1] * 32))
            w8.append(builder.mul(builder.sext(v8, ir.VectorType(i16, 32)), builder.trunc(f, ir.VectorType(i16, 32))))
        return _accumulate8(context, builder, sig, args, 3, w8, signed=True, scales=(d8, None))
    return types.none(w, wo, tab, sbuf, mbuf, a, ao, da, asum, dao, acc, acco), codegen


