"""SIMD integer sub-block dots, as LLVM vector IR (numba intrinsics): loads, splats, the grid lookups of IQ3_S and
the exact int8 dot."""

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


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


