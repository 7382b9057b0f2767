// The expert kernels' weight decoding, a type at a time: sub-block s of a staged row (shared offset R) decoded to
// 32 weights and a scale, and its canonical term against an activation sub-block. Q8_0, Q4_K and IQ3_S have tuned
// decoders here (decode_sub, and the IQ3_S signed-table term); every other type goes through expert_term.cuh (the
// generic path: its codes four a word, decode.cuh's heads for the scales). experts.cu includes this file after its exact-arithmetic and shared-memory
// helpers; the tensor-core tiles' fragment decoders are experts_mma.cuh's decode_frag.

// ---- formats -----------------------------------------------------------------------------------------------------
template <int QT> struct QF { static constexpr int BV = XtTraits<QT>::BV, BB = XtTraits<QT>::BB; };
// the types with decoders of their own (decode_sub below, decode_frag in experts_mma.cuh); the rest are generic, and
// so is UNTUNED (experts.py: a tuned type whose gate/up rows a card cannot stage, read in place: GU_DIRECT)
#ifndef UNTUNED
#define UNTUNED -1
#endif
template <int QT> struct Tuned {
    static constexpr bool value = QT != UNTUNED && (QT == QT_Q8_0 || QT == QT_Q4_K || QT == QT_IQ3_S);
};
// The part of decode.cuh's table blob a generic type reads, [OFF, END): its grid, or IQ4's 16 values; a block
// copies only that part to shared offset 0 (experts.py: TABLE_PARTS)
template <int QT> struct TabSmem {
    static constexpr bool ON = !Tuned<QT>::value && XtTraits<QT>::TABLE;
    static constexpr int OFF = !ON ? 0 : QT == 16 ? DQ_TAB_IQ2XXS : QT == 17 ? DQ_TAB_IQ2XS : QT == 22 ? DQ_TAB_IQ2S
                             : QT == 18 ? DQ_TAB_IQ3XXS : QT == 19 || QT == 29 ? DQ_TAB_IQ1
                             : QT == 39 ? DQ_TAB_MXFP4 : DQ_TAB_IQ4NL;
    static constexpr int END = !ON ? 0 : QT == 16 ? DQ_TAB_IQ2XS : QT == 17 ? DQ_TAB_IQ2S : QT == 22 ? DQ_TAB_IQ3XXS
                             : QT == 18 ? DQ_TAB_IQ3S : QT == 19 || QT == 29 ? DQ_TAB_KSIGNS
                             : QT == 39 ? DQ_TAB_BYTES : DQ_TAB_MXFP4;
    static constexpr int BYTES = (END - OFF + 15) / 16 * 16;
    static_assert(!ON || (QT == 20 || QT == 23) == (OFF == DQ_TAB_IQ4NL), "a table type without its part");
};

template <int QT, int KIN> struct Geom {
    static_assert(KIN % QF<QT>::BV == 0, "row length must be a multiple of the block size");
    static constexpr int NSUB = KIN / 32;                 // canonical sub-blocks per row
    static constexpr int SPL = (NSUB + 31) / 32;          // sub-blocks per lane
    static constexpr int RB = KIN / QF<QT>::BV * QF<QT>::BB;  // row bytes
};

// The IQ3_S table at shared offset 0 (experts.py: signed_grid). Word (signs4 << 9) | idx holds grid entry idx's
// four magnitudes with byte b negated where bit b of signs4 is set. IQ3_FAST: all 16 sign patterns (32 KB), read by
// iq3s_term_fast; else the plain grid only (signs4 = 0: the first 2 KB, which is all decode_sub reads). The tiled
// kernels reserve GRID_TABLE_BYTES too (one shared layout) but fill the plain 2 KB only.
constexpr int GRID_TABLE_WORDS = IQ3_FAST ? 16 * 512 : 512;
constexpr int GRID_TABLE_BYTES = GRID_TABLE_WORDS * 4;

// Build the first WORDS words of the table at shared offset 0 from the plain grid (512 words in global memory, 2 KB
// from L2 a block instead of the whole table): a thread loads its entries and stores each with the WORDS / 512 sign
// patterns, pattern s negating byte b where bit b of s is set ((v ^ 0xff) + 1 a byte: no carry for magnitudes 1..127).
// experts.py: signed_grid is the same table in numpy.
template <int WORDS> __device__ __forceinline__ void fill_grid(const u32* __restrict__ grid_g) {
    u32* dst = reinterpret_cast<u32*>(g_smem);
    for (int i = threadIdx.x; i < 512; i += blockDim.x) {
        const u32 v = __ldg(grid_g + i);
#pragma unroll
        for (int s = 0; s < WORDS / 512; ++s) {
            const u32 m = ((s & 1) ? 0xffu : 0u) | ((s & 2) ? 0xff00u : 0u) | ((s & 4) ? 0xff0000u : 0u) |
                          ((s & 8) ? 0xff000000u : 0u);
            dst[s * 512 + i] = (v ^ m) + (m & 0x01010101u);
        }
    }
}

// Copy QT's part of decode.cuh's table blob (tab_g) to shared offset 0 for a generic type that reads it: 16-byte
// words, FILL_U loads in flight a thread before their stores (one 4-byte load and its store at a time made IQ1's
// 16 KB eight dependent L2 round trips a launch, before its PDL wait but not hidden: the predecessor's blocks hold
// the SM's registers until they end).
#define FILL_U 4
template <int QT> __device__ __forceinline__ void fill_tab(const u32* __restrict__ tab_g) {
    typedef TabSmem<QT> TS;
    if (TS::BYTES == 0) return;
    static_assert(TS::OFF % 16 == 0 && (TS::END - TS::OFF) % 16 == 0, "table parts of whole 16-byte words");
    constexpr int N = (TS::END - TS::OFF) / 16;
    uint4* dst = reinterpret_cast<uint4*>(g_smem);
    const uint4* src = reinterpret_cast<const uint4*>(tab_g) + TS::OFF / 16;
    const int S = blockDim.x;
    for (int i0 = threadIdx.x; i0 < N; i0 += FILL_U * S) {
        uint4 v[FILL_U];
#pragma unroll
        for (int u = 0; u < FILL_U; ++u)
            if (i0 + u * S < N) v[u] = __ldg(src + i0 + u * S);
#pragma unroll
        for (int u = 0; u < FILL_U; ++u)
            if (i0 + u * S < N) dst[i0 + u * S] = v[u];
    }
}

// One decoded sub-block: 32 signed 8-bit weights (4 per word), scale, minimum (Q4_K only).
struct SubW {
    u32 q[8];
    float sc;
    float mn;
};

// Decode sub-block s of the row whose first byte is at shared offset R.
template <int QT> __device__ __forceinline__ void decode_sub(u32 R, int s, SubW& w);

template <> __device__ __forceinline__ void decode_sub<QT_Q8_0>(u32 R, int s, SubW& w) {
    const u32 B = R + 34u * (u32)s;
    w.sc = h2f(sm_u16(B));
    w.mn = 0.0f;
    const u32 qo = B + 2u, a = qo & ~3u, sh = (qo & 3u) * 8u;
    u32 x[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) x[i] = sm_u32(a + 4u * i);
#pragma unroll
    for (int k = 0; k < 8; ++k) w.q[k] = __funnelshift_r(x[k], x[k + 1], sh);
}

// Q4_K: scale and minimum of sub-block j of the block at shared offset B (16-aligned: d, dmin, scales[0..11])
__device__ __forceinline__ void q4k_scale_min(u32 B, u32 j, float& sc, float& mn) {
    const uint4 hd = sm_u128(B);
    const float d = h2f(hd.x & 0xffffu), dmin = h2f(hd.x >> 16);
    const u32 shb = 8u * (j & 3u);
    const u32 y = (hd.y >> shb) & 255u, z = (hd.z >> shb) & 255u, m = (hd.w >> shb) & 255u;
    const bool lo = j < 4u;
    const u32 scv = lo ? (y & 63u) : ((m & 15u) | ((y >> 2) & 0x30u));
    const u32 mnv = lo ? (z & 63u) : ((m >> 4) | ((z >> 2) & 0x30u));
    sc = f_mul(d, small_i2f((int)scv));
    mn = f_mul(dmin, small_i2f((int)mnv));
}

template <> __device__ __forceinline__ void decode_sub<QT_Q4_K>(u32 R, int s, SubW& w) {
    const u32 j = (u32)s & 7u;
    const u32 B = R + 144u * ((u32)s >> 3);  // 16-aligned
    q4k_scale_min(B, j, w.sc, w.mn);
    const u32 qo = B + 16u + 32u * (j >> 1), nsh = 4u * (j & 1u);
    const uint4 a = sm_u128(qo), c = sm_u128(qo + 16u);
    w.q[0] = (a.x >> nsh) & 0x0f0f0f0fu;
    w.q[1] = (a.y >> nsh) & 0x0f0f0f0fu;
    w.q[2] = (a.z >> nsh) & 0x0f0f0f0fu;
    w.q[3] = (a.w >> nsh) & 0x0f0f0f0fu;
    w.q[4] = (c.x >> nsh) & 0x0f0f0f0fu;
    w.q[5] = (c.y >> nsh) & 0x0f0f0f0fu;
    w.q[6] = (c.z >> nsh) & 0x0f0f0f0fu;
    w.q[7] = (c.w >> nsh) & 0x0f0f0f0fu;
}

// IQ3_S sub-block s of the row at shared offset R: its fields, read as words from the 2-aligned block
struct Iq3sSub {
    float d;
    u32 qs0, qs1, sg, qh, nib;  // qs[8j..8j+7] as two words, the sub-block's 32 sign bits, qh byte, scale nibble
};
__device__ __forceinline__ Iq3sSub iq3s_sub(u32 R, int s) {
    const u32 j = (u32)s & 7u;
    const u32 B = R + 110u * ((u32)s >> 3);  // 2-aligned
    Iq3sSub f;
    f.d = h2f(sm_u16(B));
    const u32 qo = B + 2u + 8u * j;          // qs[8j..8j+7]
    const u32 sh = (qo & 3u) * 8u;           // signs (B + 74 + 4j) have the same alignment
    const u32 qa = qo & ~3u;
    const u32 w0 = sm_u32(qa), w1 = sm_u32(qa + 4u), w2 = sm_u32(qa + 8u);
    const u32 sa = (B + 74u + 4u * j) & ~3u;
    f.qs0 = __funnelshift_r(w0, w1, sh);
    f.qs1 = __funnelshift_r(w1, w2, sh);
    f.sg = __funnelshift_r(sm_u32(sa), sm_u32(sa + 4u), sh);
    f.qh = sm_u8(B + 66u + j);
    f.nib = (sm_u8(B + 106u + (j >> 1)) >> (4u * (j & 1u))) & 15u;
    return f;
}

template <> __device__ __forceinline__ void decode_sub<QT_IQ3_S>(u32 R, int s, SubW& w) {
    const Iq3sSub f = iq3s_sub(R, s);
    const float d = f.d;
    const u32 qs0 = f.qs0, qs1 = f.qs1, sg = f.sg, qh = f.qh, nib = f.nib;
    w.sc = f_mul(d, small_i2f((int)(1u + 2u * nib)));
    w.mn = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const u32 qw = (k < 4) ? qs0 : qs1;
        const u32 idx = ((qw >> (8 * (k & 3))) & 255u) | (((qh >> k) & 1u) << 8);
        const u32 mag = sm_u32(idx * 4u);
        w.q[k] = xt_signed(mag, sg >> (4 * k));  // the signs of values 4k..4k+3
    }
}

// Every other type: expert_term.cuh's decode of sub-block s of the row at shared offset R (the type's part of the
// table blob, for the types that read it, at shared offset 0: the blob's offsets less the part's)
// (W: XtW<QT>; a parameter, so that the GU_DIRECT branches of the bodies name it for the tuned types too)
template <int QT, class W> __device__ __forceinline__ void decode_at(const u8* row, int s, W& w) {
    xt_decode<QT>(row, s, g_smem - TabSmem<QT>::OFF, w);
}
template <int QT> __device__ __forceinline__ void decode_sub(u32 R, int s, XtW<QT>& w) {
    decode_at<QT>(g_smem + R, s, w);
}
template <int QT> __device__ __forceinline__ XtSub locate_sub(u32 R, int s, XtW<QT>& w) {  // its words: xt_word
    return xt_locate<QT>(g_smem + R, s, g_smem - TabSmem<QT>::OFF, w);
}

// Activation sub-block: 32 int8 (4 per word), its scale; (Q4_K) the sum of its integers.
struct Act {
    u32 a[8];
    float d;
    int asum;
};

template <int QT> struct ActNeeds {
    static constexpr bool ASUM = QT == QT_Q4_K;
};

// activation sub-block s: its 32 int8 codes as 8 words, and its scale (SH: q and d in shared memory, else global
// memory read through the read-only path)
template <bool SH>
__device__ __forceinline__ float load_act_words(const signed char* __restrict__ q, const float* __restrict__ d, int s,
                                                u32 (&a)[8]) {
    const uint4* p = reinterpret_cast<const uint4*>(q + 32 * s);
    const uint4 x = SH ? p[0] : __ldg(p), y = SH ? p[1] : __ldg(p + 1);
    a[0] = x.x; a[1] = x.y; a[2] = x.z; a[3] = x.w;
    a[4] = y.x; a[5] = y.y; a[6] = y.z; a[7] = y.w;
    return SH ? d[s] : __ldg(d + s);
}

template <int QT, bool SH = false>
__device__ __forceinline__ void load_act(const signed char* __restrict__ q, const float* __restrict__ d, int s,
                                         Act& A) {
    A.d = load_act_words<SH>(q, d, s, A.a);
    A.asum = 0;
    if (ActNeeds<QT>::ASUM) {
#pragma unroll
        for (int k = 0; k < 8; ++k) A.asum = __dp4a((int)A.a[k], 0x01010101, A.asum);
    }
}

// A generic type's activation sub-block: the same loads, and the half sums its minimum needs (expert_term.cuh)
template <int QT, bool SH = false>
__device__ __forceinline__ void load_act(const signed char* __restrict__ q, const float* __restrict__ d, int s,
                                         XtAct& A) {
    A.d = load_act_words<SH>(q, d, s, A.a);
    xt_act_sums<QT>(A);
}

// The weight and activation sub-block types of QT's decode (a tuned one, or expert_term.cuh's)
template <int QT, bool TUNED = Tuned<QT>::value> struct Sub { typedef SubW W; typedef Act A; };
template <int QT> struct Sub<QT, false> { typedef XtW<QT> W; typedef XtAct A; };

// This lane's activation sub-blocks (lane, lane + 32, ...) of row `row` of a (rows, KIN) quantised input.
template <int QT, int KIN, int N, class AT>
__device__ __forceinline__ void load_row_act(const signed char* __restrict__ q, const float* __restrict__ d, int row,
                                             int lane, AT (&A)[N]) {
    constexpr int NSUB = KIN / 32;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int s = lane + 32 * i;
        if (s < NSUB) load_act<QT>(q + (i64)row * KIN, d + (i64)row * NSUB, s, A[i]);
    }
}

// canonical term: (scale * d_act) * isum  [- (minimum * d_act) * asum]
template <int QT> __device__ __forceinline__ float sub_term(const SubW& w, const Act& A) {
    int isum = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) isum = __dp4a((int)w.q[k], (int)A.a[k], isum);
    float t = f_mul(f_mul(w.sc, A.d), small_i2f(isum));
    if (QT == QT_Q4_K) t = f_sub(t, f_mul(f_mul(w.mn, A.d), small_i2f(A.asum)));
    return t;
}

template <int QT> __device__ __forceinline__ float sub_term(const XtW<QT>& w, const XtAct& A) {
    return xt_term<QT>(w, A);
}

// IQ3_S term from the signed table (IQ3_FAST): isum = sum_k dp4a(table[e_k], a_k) with e_k = signs_k << 9 | idx_k
// (signs_k = sg bits 4k..4k+3, idx_k = qs byte k | qh bit k << 8): the table word is group k's four weights with
// their signs applied, so a group costs one LDS and one dp4a and the activation is used as it is. The 13-bit
// indices of 2 groups come out of one prmt (e 2m | e 2m+1 << 16): the low byte of each from qs, the high byte
// (qh bit | sign nibble << 1) from gl / gh; a group's byte address is then e * 4 (even group: shift and mask; odd
// group: a shift, the word's bits 29..31 and 14..15 being zero).
__device__ __forceinline__ float iq3s_term_fast(u32 R, int s, const Act& A) {
    const Iq3sSub f = iq3s_sub(R, s);
    const float d = f.d;
    const u32 qs0 = f.qs0, qs1 = f.qs1, sg = f.sg, qh = f.qh, nib = f.nib;
    // byte k of gl (groups 0..3) / gh (4..7): bits 8..15 of group k's table index (signs4 << 9) | idx, i.e.
    // qh bit k | sign nibble k << 1 (sg bytes doubled by prmt, their nibbles moved to bits 1..4 of a byte)
    const u32 tl = prmt(sg, 0u, 0x1100u), th = prmt(sg, 0u, 0x3322u);
    const u32 gl = dq_bit_bytes(qh) | ((tl << 1) & 0x001e001eu) | ((tl >> 3) & 0x1e001e00u);
    const u32 gh = dq_bit_bytes(qh >> 4) | ((th << 1) & 0x001e001eu) | ((th >> 3) & 0x1e001e00u);
    const u32 P[4] = {prmt(qs0, gl, 0x5140u), prmt(qs0, gl, 0x7362u), prmt(qs1, gh, 0x5140u),
                      prmt(qs1, gh, 0x7362u)};  // [e 2m | e 2m+1 << 16], e < 2^13 (bits 13..15, 29..31 zero)
    int isum = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const u32 pw = P[k >> 1];
        const u32 addr = (k & 1) ? (pw >> 14) : ((pw << 2) & 0x7ffcu);  // e * 4
        isum = __dp4a((int)sm_u32(addr), (int)A.a[k], isum);
    }
    const float sc = f_mul(d, small_i2f((int)(1u + 2u * nib)));
    return f_mul(f_mul(sc, A.d), small_i2f(isum));
}

// Decode sub-block s of the row at shared offset R and return its canonical term against A.
template <int QT> __device__ __forceinline__ float sub_dot(u32 R, int s, const Act& A) {
    if (QT == QT_IQ3_S && IQ3_FAST) return iq3s_term_fast(R, s, A);
    SubW w;
    decode_sub<QT>(R, s, w);
    return sub_term<QT>(w, A);
}
template <int QT, class AT> __device__ __forceinline__ float sub_dot_at(const u8* row, int s, const AT& A) {
    XtW<QT> w;
    decode_at<QT>(row, s, w);
    return sub_term<QT>(w, A);
}
template <int QT> __device__ __forceinline__ float sub_dot(u32 R, int s, const XtAct& A) {
    return sub_dot_at<QT>(g_smem + R, s, A);
}
