"""Byte-field ops for the decoders: 16 values an op in vector registers (numba's loops over arrays it cannot prove
apart stay scalar), 16-entry table lookups, grid gathers; integer operations only, so exact on any host."""

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from lane.cpu_pool.vector_ir import _I32, _I64, _I8, _const, _i64, _iq3s_weights, _is_1d_bytes, _splat, _vload, _vptr


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


