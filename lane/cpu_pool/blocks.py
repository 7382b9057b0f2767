"""Block kernels: 8 sub-blocks (256 values) of one row against one activation row, all in vector registers, for
Q8_0, the K-quants and IQ3_S, and for a block decoded into the buffers (every other type when tokens share it)."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from lane.cpu_pool.vector_ir import (
    VNNI, _I32, _I64, _I8, _const, _i64, _iq3s_parts, _is_1d_bytes, _splat, _vload, _vptr
)


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


