"""The float expert types (F32, F16, BF16): each one's canonical integer view (docs/quant-types.md) formed from its
bits in integers, as a block kernel and as a decoder into the buffers."""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from lane.cpu_pool.tables import BF16_T, F16_T, F32_T
from lane.cpu_pool.vector_ir import _I32, _I64, _const, _i64, _is_1d_bytes, _vload, _vptr
from lane.cpu_pool.blocks import _accumulate8, _blk_ok, _f32_1d, _half, _tree8


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


