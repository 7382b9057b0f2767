// The generic expert path's arithmetic on one canonical sub-block (stratad/engine/canonical.py), for every expert
// type: the weight's integer view (dq_sub's codes, four a word, for the quantised types: xt_words; floats.float_view
// for F32 / F16 / BF16), the exact integer sums with an int8 activation sub-block, and the canonical term
// (scale * d) * isum [- (minimum * d) * msum]. Written once as __host__ __device__ code: experts.cu calls these
// for every type without a tuned decoder of its own (IQ3_S, Q4_K and Q8_0 keep theirs, but for rows read in place:
// UNTUNED), and
// tests/test_expert_term_host.py compiles them with g++ and compares a row's dot, summed over 32 virtual lanes in
// the canonical order, with canonical.qdot bit for bit. Only the lanes' fold differs (shuffles on the device).
// experts.cu inlines decode.cuh before this file (compile.py expands the .cu's own includes only).
#ifndef STRATAD_EXPERT_TERM_CUH
#define STRATAD_EXPERT_TERM_CUH
#ifndef STRATAD_DECODE_CUH
#include "decode.cuh"
#endif

// fully unrolled on the device (a loop left rolled would put its indexed registers in local memory)
#ifdef __CUDA_ARCH__
#define XT_UNROLL _Pragma("unroll")
#else
#define XT_UNROLL
#endif

// A type as the expert kernels see it: blocks of BV values in BB bytes, NSUB sub-blocks of 32 a block, the
// minimum's kind, WORDS 32-bit words holding a decoded sub-block's codes (8: every quantised type's codes fit int8;
// 16: a float type's view, |q| <= 4096, as int16 pairs) and whether its decode reads decode.cuh's table blob.
template <int QT, bool Q = DqTraits<QT>::QUANT> struct XtTraits;
template <int QT> struct XtTraits<QT, true> {
    static constexpr int BV = DqTraits<QT>::BV, BB = DqTraits<QT>::BB, NSUB = DqTraits<QT>::NSUB;
    static constexpr int MIN = DqTraits<QT>::MIN, WORDS = 8;
    static constexpr bool TABLE = QT == 16 || QT == 17 || QT == 18 || QT == 19 || QT == 20 || QT == 21 ||
                                  QT == 22 || QT == 23 || QT == 29 || QT == 39;
    static constexpr bool IQ1 = QT == 19 || QT == 29;  // code 8 g + delta: words hold g, XtW::delta the signs
};
template <int QT> struct XtTraits<QT, false> {  // F32 / F16 / BF16: a "block" is one sub-block of 32 values
    static constexpr int BV = 32, BB = 32 * DqTraits<QT>::BB, NSUB = 1, MIN = DQ_NO_MIN, WORDS = 16;
    static constexpr bool TABLE = false, IQ1 = false;
};

// ---- integer dot products: dp4a / dp2a on the device, the same sums in a loop on the host ---------------------
DQ_FN int xt_s8(dq_u32 w, int k) { return (int)(signed char)(dq_u8)(w >> (8 * k)); }
DQ_FN int xt_dp4a(dq_u32 a, dq_u32 b, int c) {  // c + sum of the four int8 products
#ifdef __CUDA_ARCH__
    return __dp4a((int)a, (int)b, c);
#else
    for (int k = 0; k < 4; ++k) c += xt_s8(a, k) * xt_s8(b, k);
    return c;
#endif
}
// c + the two int16 of a times bytes 2 hi, 2 hi + 1 of b (int8)
template <bool HI> DQ_FN int xt_dp2a(dq_u32 a, dq_u32 b, int c) {
#ifdef __CUDA_ARCH__
    return HI ? __dp2a_hi((int)a, (int)b, c) : __dp2a_lo((int)a, (int)b, c);
#else
    return c + (int)(short)(a & 0xffffu) * xt_s8(b, HI ? 2 : 0) + ((int)a >> 16) * xt_s8(b, HI ? 3 : 1);
#endif
}
DQ_FN dq_u32 xt_fbits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    dq_u32 u;
    __builtin_memcpy(&u, &f, 4);
    return u;
#endif
}
DQ_FN float xt_rint(float a) {  // round half to even (np.rint)
#ifdef __CUDA_ARCH__
    float r;
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
#else
    return __builtin_rintf(a);  // the default rounding mode: to nearest, ties to even
#endif
}

// ---- the weight side -----------------------------------------------------------------------------------------
// A decoded sub-block: codes packed in words (int8 x 4, or int16 x 2 for the float types), q_v = fold[v / 16] *
// code_v, value_v = scale * q_v [- minimum * mw[v / 16]] (decode.cuh's DqSub, packed: 14 registers, not 38;
// the heads that set scale, fold, mw and minimum take either). IQ1_S / IQ1_M: the words hold the grid's g (-1, 0, 1)
// and bit e of delta is set where the delta of values 8 e .. 8 e + 7 is -1 (else +1); the code is 8 g + delta, whose
// dot is 8 (g . a) + delta (1 . a): the same integer with no per-byte arithmetic on the weights (xt_isum)
template <int QT> struct XtW {
    dq_u32 q[XtTraits<QT>::WORDS];
    int fold[2], mw[2];
    float scale, minimum;
    dq_u32 delta;
};


// floats.float_view of the 32 values at b (16-byte aligned: every float row of an expert is, rows being 64 / 128-byte
// multiples at 16-byte aligned starts): non-finite values read as 0; amax = f 2^e (1/2 <= f < 1, e = 0 for 0);
// k = max(e - 12, -126); scale 2^k, q = rint(w * 2^-k) (a multiply by a power of two: exact). amax is taken on the
// values' bits (|w| orders as the bits of |w| do for every finite float of each type; F16's converted once).
// The values are read twice (16 or 8 bytes a load) by asm volatile loads, which ptxas keeps in program order (a warp
// decodes several sub-blocks at once, and values held across the amax, or loads hoisted ahead, spilled): rows read
// in place through the read-only path (ld.global.nc: faster than strong CTA-scope loads, docs/perf-notes.md), staged
// rows from shared memory (ld.relaxed.cta on their generic address).
template <int QT> struct XtFloat {
    static constexpr int NW = QT == 0 ? 32 : 16;  // 32-bit words of 32 values
    static constexpr dq_u32 EXP = QT == 0 ? 0x7f800000u : QT == 1 ? 0x7c00u : 0x7f80u;  // a value's exponent bits
    static constexpr dq_u32 ABS = QT == 0 ? 0x7fffffffu : 0x7fffu;
};
template <int N> DQ_FN void xt_load(const dq_u8* b, int i, dq_u32 (&w)[N]) {  // words N i .. N i + N - 1 at b
#ifdef __CUDA_ARCH__
    const dq_u8* p = b + 4 * N * i;
    if (__isGlobal(p)) {  // rows read in place: the read-only path, which L1 keeps for the second pass
        const size_t g = __cvta_generic_to_global(p);
        if constexpr (N == 4)
            asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(g));
        else
            asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(g));
    } else if constexpr (N == 4) {
        asm volatile("ld.relaxed.cta.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
    } else {
        asm volatile("ld.relaxed.cta.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
    }
#else
    __builtin_memcpy(w, b + 4 * N * i, 4 * N);
#endif
}
template <int QT, int N> DQ_FN dq_u32 xt_float_raw(const dq_u32 (&w)[N], int v) {  // value v of N words: its bits
    return QT == 0 ? w[v] : (w[v >> 1] >> (16 * (v & 1))) & 0xffffu;
}
template <int QT> DQ_FN float xt_float_of(dq_u32 raw) {  // a finite value's bits -> float
    return QT == 0 ? dq_bits(raw) : QT == 1 ? dq_h2f((dq_u16)raw) : dq_bits(raw << 16);
}
DQ_FN int xt_rint_int(float a) {  // rint(a) as an int (|a| <= 4096 here); one cvt.rni on the device
#ifdef __CUDA_ARCH__
    return __float2int_rn(a);
#else
    return (int)xt_rint(a);
#endif
}
template <int QT> DQ_FN void xt_float_sub(const dq_u8* b, XtW<QT>& w) {
    typedef XtFloat<QT> F;
    // words a first-pass load (16 bytes; F32, whose registers run tightest, 8), values in 16 bytes
    constexpr int N1 = QT == 0 ? 2 : 4, VPG = QT == 0 ? 4 : 8;
    dq_u32 amax_raw = 0;  // the largest |value| among the finite ones, as the type's bits
    XT_UNROLL
    for (int g = 0; g < F::NW / N1; ++g) {
        dq_u32 x[N1];
        xt_load(b, g, x);
        XT_UNROLL
        for (int v = 0; v < VPG * N1 / 4; ++v) {
            const dq_u32 u = xt_float_raw<QT>(x, v);
            const dq_u32 a = (u & F::EXP) == F::EXP ? 0u : u & F::ABS;
            amax_raw = a > amax_raw ? a : amax_raw;
        }
    }
    const dq_u32 amax = xt_fbits(xt_float_of<QT>(amax_raw));  // |x| as float bits
    // e = biased exponent - 126 for a normal amax; a subnormal one has e <= -126, so k = -126 either way
    int k = amax == 0 ? -12 : amax < 0x00800000u ? -126 : (int)(amax >> 23) - 138;
    k = k < -126 ? -126 : k;
    const float inv = dq_bits((dq_u32)(127 - k) << 23);  // 2^-k, k in [-126, 116]: a normal float
    XT_UNROLL
    for (int g = 0; g < F::NW / 2; ++g) {  // 8 bytes a load here: fewer values live at once
        dq_u32 x[2];
        xt_load(b, g, x);
        XT_UNROLL
        for (int v = 0; v < VPG / 2; v += 2) {
            const dq_u32 u0 = xt_float_raw<QT>(x, v), u1 = xt_float_raw<QT>(x, v + 1);
            const int lo = (u0 & F::EXP) == F::EXP ? 0 : xt_rint_int(dq_mul(xt_float_of<QT>(u0), inv));
            const int hi = (u1 & F::EXP) == F::EXP ? 0 : xt_rint_int(dq_mul(xt_float_of<QT>(u1), inv));
            w.q[(g * VPG / 2 + v) / 2] = ((dq_u32)lo & 0xffffu) | ((dq_u32)hi << 16);
        }
    }
    w.fold[0] = w.fold[1] = w.mw[0] = w.mw[1] = 1;
    w.scale = dq_bits((dq_u32)(k + 127) << 23);
    w.minimum = 0.f;
}

// The types of ggml's 4-bit layout in 32-value groups (value v < 16: the low nibble of byte v, else the high nibble of
// byte v - 16): Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4; QS: their nibbles' offset in the block (IQ4_XS:
// + 16 j); ALIGN: the nibbles' alignment (blocks of 20, 24, 136 bytes: 4; MXFP4's 17-byte blocks: 1)
template <int QT> struct XtNib32 {
    static constexpr bool value = QT == 2 || QT == 3 || QT == 6 || QT == 7 || QT == 20 || QT == 23 || QT == 39;
    static constexpr int QS = QT == 39 ? 1 : QT == 3 ? 4 : QT == 6 ? 6 : QT == 7 || QT == 23 ? 8 : 2;
    static constexpr int ALIGN = QT == 3 || QT == 7 || QT == 23 ? 4 : QT == 39 ? 1 : 2;
};
// Every quantised type's codes four a word, as dq_sub gives them value by value: grid entries read as words from
// the table (its offsets are multiples of 8) with their signs applied to the word (bytes negated where a bit is
// set), bit fields masked four codes at a time, offsets subtracted a byte at a time with no carries; the block's
// fields read 2 bytes at a time (every block size but MXFP4's is even), 4 where the block size is a multiple of 4.
// Scales, folds and minimums: decode.cuh's heads, shared with dq_sub.
template <class T> DQ_FN dq_u32 xt_rd(const dq_u8* p) {  // a little-endian field at p, aligned to its size
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const T*>(p);
#else
    T v;
    __builtin_memcpy(&v, p, sizeof(T));
    return v;
#endif
}
DQ_FN dq_u32 xt_u32(const dq_u8* p) { return xt_rd<dq_u32>(p); }
DQ_FN dq_u32 xt_u16(const dq_u8* p) { return xt_rd<dq_u16>(p); }
DQ_FN dq_u32 xt_ksigns(dq_u32 i) {  // ggml's ksigns_iq2xs[i]: i with bit 7 its parity
#ifdef __CUDA_ARCH__
    return i | ((__popc(i) & 1u) << 7);
#else
    return i | (((dq_u32)__builtin_popcount(i) & 1u) << 7);
#endif
}
DQ_FN dq_u32 xt_signed(dq_u32 g, dq_u32 bits) {  // g's bytes (magnitudes 1..127) negated where bits 0..3 are set
    const dq_u32 ones = dq_bit_bytes(bits);  // dq_neg4's value in the form that gives the expert kernels' code
    return (g ^ (ones * 255u)) + ones;
}
DQ_FN void xt_tab64(const dq_u8* tab, int off, dq_u32& lo, dq_u32& hi) {  // off a multiple of 8: one load
#ifdef __CUDA_ARCH__
    const uint2 u = *reinterpret_cast<const uint2*>(tab + off);
    lo = u.x;
    hi = u.y;
#else
    lo = xt_u32(tab + off);
    hi = xt_u32(tab + off + 4);
#endif
}
DQ_FN dq_u32 xt_prmt(dq_u32 x, dq_u32 y, dq_u32 s) {  // bytes of y:x selected by s's 3-bit fields (__byte_perm)
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    const unsigned long long xy = ((unsigned long long)y << 32) | x;
    dq_u32 r = 0;
    for (int i = 0; i < 4; ++i) r |= (dq_u32)((xy >> (8 * ((s >> (4 * i)) & 7))) & 255u) << (8 * i);
    return r;
#endif
}
DQ_FN dq_u32 xt_iq4(dq_u32 nib, const dq_u32 (&t)[4]) {  // kvalues of 4 nibbles (a byte each) from the table words t
    const dq_u32 u = nib | (nib >> 4), s = ((u & 255u) | ((u >> 8) & 0xff00u)) & 0x7777u;  // 4 3-bit selectors
    const dq_u32 lo = xt_prmt(t[0], t[1], s), hi = xt_prmt(t[2], t[3], s), m = ((nib >> 3) & 0x01010101u) * 255u;
    return (lo & ~m) | (hi & m);  // entries 8..15 where a nibble's bit 3 is set
}
// bytes 4 i .. 4 i + 3 (i < 4) of the 16 at a - off / 8, a 4-aligned: on the device aligned words and a funnel shift
// (MXFP4's 17-byte blocks give its codes any alignment), reading only words that hold some of the 16 bytes (a
// block's last field may end a row, and the row an allocation)
DQ_FN dq_u32 xt_rd4b(const dq_u8* a, dq_u32 off, int i) {
#ifdef __CUDA_ARCH__
    const dq_u32* w = (const dq_u32*)a;
    return __funnelshift_r(w[i], w[i < 3 || off ? i + 1 : 3], off);
#else
    return dq_rd32(a + off / 8 + 4 * i);
#endif
}

// A sub-block's code words, word k (values 4k .. 4k + 3) at a time. xt_sub reads what the words share (the head's
// scale, folds and minimum into the XtW; where the codes are, the fields their bits come from) once; xt_word<QT>(c, k)
// makes word k from it. xt_words makes all eight (k unrolled: the loads the words share are read once); the
// tensor-core fragments (experts_mma.cuh) the two a lane needs (k = t, t + 4 at run time), a quarter of the work.
// The grid types whose entries hold 8 values (XtGrid8: IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) name entry e instead
// (xt_entry: its table offset and sign bits), which xt_words reads 8 bytes at a time and xt_word a half.
struct XtSub {
    const dq_u8* p;    // the codes (nibbles, fields, grid indices)
    const dq_u8* p2;   // Q3_K / Q5_K / Q6_K: the high bits
    const dq_u8* tab;  // decode.cuh's table blob
    dq_u32 x, y, z;    // fields the words share (per type below)
    dq_u32 t[4];       // IQ4_NL / IQ4_XS / MXFP4: the value table's words
    int j;             // the sub-block in its block
};
template <int QT> struct XtGrid8 {
    static constexpr bool value = QT == 16 || QT == 17 || QT == 19 || QT == 22 || QT == 29;
};

template <int QT> DQ_FN XtSub xt_sub(const dq_u8* b, int j, const dq_u8* tab, XtW<QT>& w) {
    XtSub c;
    c.p = c.p2 = b;
    c.tab = tab;
    c.x = c.y = c.z = 0u;
    c.t[0] = c.t[1] = c.t[2] = c.t[3] = 0u;
    c.j = j;
    if constexpr (QT == 8) {  // Q8_0: the codes are the bytes
        dq_legacy_head(b, false, w);
        c.p = b + 2;
    } else if constexpr (QT == 12) {  // Q4_K: a nibble, low or high by j % 2, in 64-value groups
        dq_k4_scales(b, j, w);
        c.p = b + 16 + 32 * (j >> 1);
    } else if constexpr (QT == 21) {  // IQ3_S: a 9-bit grid index a group of 4 (x: its top bits), sign bytes (y)
        dq_iq3s_head(b, j, w);
        c.p = b + 2 + 8 * j;
        c.x = b[66 + j];
        c.y = xt_u16(b + 74 + 4 * j) | (xt_u16(b + 76 + 4 * j) << 16);
    } else if constexpr (XtNib32<QT>::value) {
        typedef XtNib32<QT> N;
        c.p = b + N::QS + (QT == 23 ? 16 * j : 0);
        if constexpr (N::ALIGN == 1) {  // the aligned word before the codes, and their offset from it in bits
            c.z = 8u * ((dq_u32)(unsigned long long)c.p & 3u);
            c.p -= c.z / 8u;  // stepping back keeps the pointer's state space
        }
        if constexpr (QT == 23) dq_iq4xs_head(b, j, w);
        else if constexpr (QT == 39) dq_mxfp4_head(b, w);
        else dq_legacy_head(b, QT == 3 || QT == 7, w);
        // Q5_x: the fifth bits, bit v of a word (2-aligned in Q5_0's 22-byte blocks)
        c.x = QT == 6 ? xt_u16(b + 2) | (xt_u16(b + 4) << 16) : QT == 7 ? xt_u32(b + 4) : 0u;
        if constexpr (QT == 20 || QT == 23 || QT == 39) {
            XT_UNROLL
            for (int i = 0; i < 4; ++i) c.t[i] = xt_u32(tab + (QT == 39 ? DQ_TAB_MXFP4 : DQ_TAB_IQ4NL) + 4 * i);
        }
    } else if constexpr (QT == 10) {  // Q2_K: field j % 4 of 2 bits, bytes of group j / 4
        dq_q2k_head(b, j, w);
        c.p = b + 16 + 32 * (j >> 2);
    } else if constexpr (QT == 13) {  // Q5_K: a nibble (low or high, by j % 2) and high bit j of qh's byte
        dq_k4_scales(b, j, w);
        c.p = b + 48 + 32 * (j >> 1);
        c.p2 = b + 16;
    } else if constexpr (QT == 14) {  // Q6_K: 4 low bits from ql, 2 high from qh
        dq_q6k_head(b, j, w);
        c.p = b + 64 * (j >> 2) + 32 * (j & 1);
        c.p2 = b + 128 + 32 * (j >> 2);
    } else if constexpr (QT == 11) {  // Q3_K: 2 low bits from qs, the high bit from hmask (the block's start)
        dq_q3k_head(b, j, w);
        c.p = b + 32 + 32 * (j >> 2);
    } else if constexpr (QT == 16) {  // IQ2_XXS: 4 grid index bytes (x), then 4 x 7 sign-index bits (y: the head's)
        c.y = dq_iq2xxs_head(b, j, w);
        c.x = xt_u16(b + 2 + 8 * j) | (xt_u16(b + 4 + 8 * j) << 16);
    } else if constexpr (QT == 17) {  // IQ2_XS: a 16-bit word a group: 9-bit grid index, 7-bit sign index
        dq_iq2_scales(b, j, b + 66, w);
        c.p = b + 2 + 8 * j;
    } else if constexpr (QT == 22) {  // IQ2_S: index low bytes (x), a sign byte a group (y), 2 high index bits (z)
        dq_iq2_scales(b, j, b + 74, w);
        c.x = xt_u16(b + 2 + 4 * j) | (xt_u16(b + 4 + 4 * j) << 16);
        c.y = xt_u16(b + 34 + 4 * j) | (xt_u16(b + 36 + 4 * j) << 16);
        c.z = b[66 + j];
    } else if constexpr (QT == 18) {  // IQ3_XXS: a grid index byte (4 values) each, 7 sign-index bits (y) each 8
        c.y = dq_iq3xxs_head(b, j, w);
        c.p = b + 2 + 8 * j;
    } else if constexpr (QT == 19) {  // IQ1_S: g, index low bytes (x), 3 high bits a group and the delta's sign (y)
        c.y = dq_iq1s_head(b, j, w);
        c.x = xt_u16(b + 2 + 4 * j) | (xt_u16(b + 4 + 4 * j) << 16);
        w.delta = (c.y & 0x8000u) ? 15u : 0u;
    } else {  // IQ1_M: g, index low bytes (x), a nibble a group in qh (y: 3 high index bits, the group's delta sign)
        static_assert(QT == 29, "a quantised type without a word decoder");
        dq_iq1m_head(b, j, w);
        c.x = xt_u16(b + 4 * j) | (xt_u16(b + 2 + 4 * j) << 16);
        c.y = xt_u16(b + 32 + 2 * j);
        w.delta = ((c.y >> 3) & 1u) | ((c.y >> 6) & 2u) | ((c.y >> 9) & 4u) | ((c.y >> 12) & 8u);
    }
    return c;
}

// entry e (values 8e .. 8e + 7) of an XtGrid8 type: its table offset (a multiple of 8), bits 0..7 of sg its signs
template <int QT> DQ_FN void xt_entry(const XtSub& c, int e, int& off, dq_u32& sg) {
    sg = 0u;
    if constexpr (QT == 16) {
        off = DQ_TAB_IQ2XXS + 8 * (int)((c.x >> (8 * e)) & 255u);
        sg = xt_ksigns((c.y >> (7 * e)) & 127u);
    } else if constexpr (QT == 17) {
        const dq_u32 q = xt_u16(c.p + 2 * e);
        off = DQ_TAB_IQ2XS + 8 * (int)(q & 511u);
        sg = xt_ksigns(q >> 9);
    } else if constexpr (QT == 22) {
        off = DQ_TAB_IQ2S + 8 * (int)(((c.x >> (8 * e)) & 255u) | (((c.z >> (2 * e)) & 3u) << 8));
        sg = c.y >> (8 * e);
    } else {  // IQ1_S (3 high bits a group), IQ1_M (a nibble a group): no signs
        off = DQ_TAB_IQ1 + 8 * (int)(((c.x >> (8 * e)) & 255u) | (((c.y >> ((QT == 19 ? 3 : 4) * e)) & 7u) << 8));
    }
}

template <int QT> DQ_FN dq_u32 xt_word(const XtSub& c, int k) {
    if constexpr (XtGrid8<QT>::value) {  // half k % 2 of entry k / 2
        int off;
        dq_u32 sg;
        xt_entry<QT>(c, k >> 1, off, sg);
        const dq_u32 g = xt_u32(c.tab + off + 4 * (k & 1));
        if constexpr (XtTraits<QT>::IQ1) return g;
        else return xt_signed(g, sg >> (4 * (k & 1)));
    } else if constexpr (QT == 8) {
        return xt_u16(c.p + 4 * k) | (xt_u16(c.p + 2 + 4 * k) << 16);
    } else if constexpr (QT == 12) {
        return (xt_u32(c.p + 4 * k) >> (4 * (c.j & 1))) & 0x0f0f0f0fu;
    } else if constexpr (QT == 21) {
        const int h = k >> 2;
        const dq_u32 lo = xt_u16(c.p + 4 * h) | (xt_u16(c.p + 2 + 4 * h) << 16);
        const dq_u32 idx = ((lo >> (8 * (k & 3))) & 255u) | (((c.x >> k) & 1u) << 8);
        return xt_signed(xt_u32(c.tab + DQ_TAB_IQ3S + 4 * (int)idx), c.y >> (4 * k));
    } else if constexpr (XtNib32<QT>::value) {  // bytes 4 (k % 4) .., the high nibbles from k = 4
        typedef XtNib32<QT> N;
        const dq_u8* p = c.p + 4 * (k & 3);
        const dq_u32 x = N::ALIGN == 1   ? xt_rd4b(c.p, c.z, k & 3)
                         : N::ALIGN == 4 ? xt_u32(p)
                                         : xt_u16(p) | (xt_u16(p + 2) << 16);
        const dq_u32 nib = (x >> (4 * (k >> 2))) & 0x0f0f0f0fu;
        const dq_u32 hb = dq_bit_bytes(c.x >> (4 * k));
        if constexpr (QT == 2) return (nib + 0x78787878u) ^ 0x80808080u;  // v - 8 a byte, no carries
        else if constexpr (QT == 3) return nib;
        else if constexpr (QT == 6) return ((nib | (hb << 4)) + 0x70707070u) ^ 0x80808080u;  // v - 16
        else if constexpr (QT == 7) return nib | (hb << 4);
        else return xt_iq4(nib, c.t);
    } else if constexpr (QT == 10) {
        return (xt_u32(c.p + 4 * k) >> (2 * (c.j & 3))) & 0x03030303u;
    } else if constexpr (QT == 13) {
        return ((xt_u32(c.p + 4 * k) >> (4 * (c.j & 1))) & 0x0f0f0f0fu) |
               (((xt_u32(c.p2 + 4 * k) >> c.j) & 0x01010101u) << 4);
    } else if constexpr (QT == 14) {  // code = v - 32 a byte, no carries
        const int r = c.j & 3;
        const dq_u32 lo = ((xt_u16(c.p + 4 * k) | (xt_u16(c.p + 4 * k + 2) << 16)) >> (4 * (r >> 1))) & 0x0f0f0f0fu;
        const dq_u32 hi = ((xt_u16(c.p2 + 4 * k) | (xt_u16(c.p2 + 4 * k + 2) << 16)) >> (2 * r)) & 0x03030303u;
        return ((lo | (hi << 4)) + 0x60606060u) ^ 0x80808080u;
    } else if constexpr (QT == 11) {  // code = low + 4 high - 4: a byte v in 0..7 -> v - 4, no carries
        const dq_u32 lo = ((xt_u16(c.p + 4 * k) | (xt_u16(c.p + 4 * k + 2) << 16)) >> (2 * (c.j & 3))) & 0x03030303u;
        const dq_u32 hi = ((xt_u16(c.p2 + 4 * k) | (xt_u16(c.p2 + 4 * k + 2) << 16)) >> c.j) & 0x01010101u;
        return ((lo | (hi << 2)) + 0x7c7c7c7cu) ^ 0x80808080u;
    } else {  // IQ3_XXS: grid index byte k, the signs of its 8-value group k / 2
        static_assert(QT == 18, "a quantised type without a word decoder");
        const int h = k >> 2;
        const dq_u32 idx = xt_u16(c.p + 4 * h) | (xt_u16(c.p + 2 + 4 * h) << 16);
        const dq_u32 sg = xt_ksigns((c.y >> (7 * (k >> 1))) & 127u);
        return xt_signed(xt_u32(c.tab + DQ_TAB_IQ3XXS + 4 * (int)((idx >> (8 * (k & 3))) & 255u)), sg >> (4 * (k & 1)));
    }
}

// words 2e, 2e + 1: the 8-byte grid entry at table offset off, bits 0..7 of sg its signs
template <int QT> DQ_FN void xt_grid8(const dq_u8* tab, int off, dq_u32 sg, int e, XtW<QT>& w) {
    dq_u32 lo, hi;
    xt_tab64(tab, off, lo, hi);
    w.q[2 * e] = xt_signed(lo, sg);
    w.q[2 * e + 1] = xt_signed(hi, sg >> 4);
}
template <int QT> DQ_FN void xt_words(const dq_u8* b, int j, const dq_u8* tab, XtW<QT>& w) {
    const XtSub c = xt_sub<QT>(b, j, tab, w);
    if constexpr (XtGrid8<QT>::value) {
        XT_UNROLL
        for (int e = 0; e < 4; ++e) {
            int off;
            dq_u32 sg;
            xt_entry<QT>(c, e, off, sg);
            if constexpr (XtTraits<QT>::IQ1) xt_tab64(tab, off, w.q[2 * e], w.q[2 * e + 1]);
            else xt_grid8(tab, off, sg, e, w);
        }
    } else {
        XT_UNROLL
        for (int k = 0; k < 8; ++k) w.q[k] = xt_word<QT>(c, k);
    }
}

// Sub-block s (0 .. row's NSUB - 1) of the row whose first byte is at `row`; tab: decode.cuh's table blob
template <int QT> DQ_FN void xt_decode(const dq_u8* row, int s, const dq_u8* tab, XtW<QT>& w) {
    typedef XtTraits<QT> X;
    if constexpr (DqTraits<QT>::QUANT) {
        xt_words<QT>(row + (s / X::NSUB) * X::BB, s % X::NSUB, tab, w);
    } else {
        xt_float_sub<QT>(row + s * X::BB, w);
    }
}
// the same sub-block of a quantised type, its words left to xt_word (the head's fields in w)
template <int QT> DQ_FN XtSub xt_locate(const dq_u8* row, int s, const dq_u8* tab, XtW<QT>& w) {
    typedef XtTraits<QT> X;
    return xt_sub<QT>(row + (s / X::NSUB) * X::BB, s % X::NSUB, tab, w);
}

// ---- the activation side -------------------------------------------------------------------------------------
// An activation sub-block: 32 int8 (4 a word, value v in byte v % 4 of word v / 4), its scale, and sums of its
// integers: for the types with a minimum, over each 16-value half (msum = sum(q_a), or mw0 sum0 + mw1 sum1); for
// IQ1_S / IQ1_M, over each 8-value group, as int16 pairs (groups 0, 1 in sum[0], 2, 3 in sum[1]; |sum| <= 1024):
// their deltas' dot is then two dp2a a sub-block (xt_isum), computed once for all the rows the activation meets
struct XtAct {
    dq_u32 a[8];
    float d;
    int sum[2];
};

template <int QT> DQ_FN void xt_act_sums(XtAct& A) {
    A.sum[0] = A.sum[1] = 0;
    if constexpr (XtTraits<QT>::IQ1) {
        XT_UNROLL
        for (int h = 0; h < 2; ++h) {
            const int g0 = xt_dp4a(A.a[4 * h + 1], 0x01010101u, xt_dp4a(A.a[4 * h], 0x01010101u, 0));
            const int g1 = xt_dp4a(A.a[4 * h + 3], 0x01010101u, xt_dp4a(A.a[4 * h + 2], 0x01010101u, 0));
            A.sum[h] = (int)(((dq_u32)g0 & 0xffffu) | ((dq_u32)g1 << 16));
        }
    } else if (XtTraits<QT>::MIN != DQ_NO_MIN) {
        XT_UNROLL
        for (int k = 0; k < 8; ++k) A.sum[k >> 2] = xt_dp4a(A.a[k], 0x01010101u, A.sum[k >> 2]);
    }
}

// ---- the term ---------------------------------------------------------------------------------------------------
// code v of a decoded sub-block (before its fold): a byte or int16 of the words, IQ1's 8 g + delta
template <int QT> DQ_FN int xt_code(const XtW<QT>& w, int v) {
    constexpr int PER = 32 / XtTraits<QT>::WORDS, BITS = 32 / PER;
    const int c = (int)(w.q[v / PER] << (32 - BITS * (v % PER + 1))) >> (32 - BITS);
    if constexpr (XtTraits<QT>::IQ1) return 8 * c + (((w.delta >> (v >> 3)) & 1u) ? -1 : 1);
    return c;
}

// isum = fold0 * (the low half's integer dot) + fold1 * (the high half's): exact (|isum| < 2^24, docs/quant-types.md)
template <int QT> DQ_FN int xt_isum(const XtW<QT>& w, const XtAct& A) {
    int half[2] = {0, 0};
    if (XtTraits<QT>::WORDS == 8) {
        XT_UNROLL
        for (int k = 0; k < 8; ++k) half[k >> 2] = xt_dp4a(w.q[k], A.a[k], half[k >> 2]);
        if constexpr (XtTraits<QT>::IQ1) {  // 8 (g . a) + delta (1 . a): group e's sum times byte e of D (1 or -1)
            const dq_u32 D = 0x01010101u | (dq_bit_bytes(w.delta) * 0xfeu);
            half[0] = 8 * half[0] + xt_dp2a<false>((dq_u32)A.sum[0], D, 0);
            half[1] = 8 * half[1] + xt_dp2a<true>((dq_u32)A.sum[1], D, 0);
        }
    } else {  // word k: values 2k, 2k + 1 (int16), activation bytes (2k) % 4, + 1 of word k / 2
        XT_UNROLL
        for (int k = 0; k < 16; k += 2) {
            half[k >> 3] = xt_dp2a<false>(w.q[k], A.a[k >> 1], half[k >> 3]);
            half[k >> 3] = xt_dp2a<true>(w.q[k + 1], A.a[k >> 1], half[k >> 3]);
        }
    }
    return w.fold[0] * half[0] + w.fold[1] * half[1];
}

// canonical term: (scale * d) * isum [- (minimum * d) * msum], each operation rounded on its own
template <int QT> DQ_FN float xt_term(const XtW<QT>& w, const XtAct& A) {
    constexpr int MIN = XtTraits<QT>::MIN;
    float t = dq_mul(dq_mul(w.scale, A.d), dq_i2f(xt_isum<QT>(w, A)));
    if (MIN == DQ_MIN)
        t = dq_sub(t, dq_mul(dq_mul(w.minimum, A.d), dq_i2f(A.sum[0] + A.sum[1])));
    else if (MIN == DQ_MIN_WEIGHTED)
        t = dq_sub(t, dq_mul(dq_mul(w.minimum, A.d), dq_i2f(w.mw[0] * A.sum[0] + w.mw[1] * A.sum[1])));
    return t;
}

#endif  // STRATAD_EXPERT_TERM_CUH
