// Prompt tiles on int8 tensor cores: expert_gateup_mma and expert_down_mma compute what expert_gateup_tiled and
// expert_down_tiled compute, with the same bits (experts.cu includes this file after expert_decode.cuh and its
// SIMT kernels).
//
// Why the bits are the same: a canonical term is (scale * d_act) * isum with isum the integer dot of one 32-value
// sub-block. mma.m16n8k32.s8 gives exactly that isum for 16 tokens x 8 rows (integer sums are exact in any order),
// and the float part is done per element with the same explicit-rounding operations. What remains is the order of
// the float sums: canonical lane l adds the terms of sub-blocks l, l + 32, ... to 0.0f in order (a "leaf"), and the
// 32 leaves are folded by __shfl_down offsets 16, 8, 4, 2, 1, a balanced tree whose first pairs are (l, l + 16).
// Taking the leaves in bit-reversed lane order (0, 16, 8, 24, 4, ...) and merging them as a binary counter does
// (leaf j merges with the stack while bit b of j is set) builds exactly that tree, one leaf at a time, with five
// partial sums per output instead of 32 (numpy reference: stratad.engine.canonical.bitrev_fold).
//
// Item = (tile of up to MMA_M pairs of one expert, 64 output rows): gate/up rows g..g+31 of both matrices (so that a
// block has each 32-row group of h whole, to quantise it), or down rows r..r+63. A tile is MMA_MT m-tiles of 16
// pairs (4 by default; 2 or 1 where a block's shared memory cannot stage 64 pairs' activation rows beside the
// weights: experts.py). Warp w owns output rows 8(w % 8) .. + 7 (one mma n-tile) for MMA_MPW of the tile's m-tiles:
// it decodes its weight fragment of a sub-block once (from the staged raw rows) and uses it for its m-tiles (more
// m-tiles a warp: less decoding; fewer: more warps to hide latency). The tile's activation rows (int8 and scales) are
// staged once and kept while a block's items (a contiguous range) stay on the same tile.

// Tensor-core tiles for every quantised type; not the float types (ggml's codes 0, 1, 30: their views are int16). A
// sub-block's codes are int8 for all of them (IQ1_S / IQ1_M's 8 g + delta formed from the generic decode's g and
// delta signs); what the view adds is handled per element with the canonical term's operations: types whose
// 16-value halves have integer folds of their own (MmaFolds: Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S, IQ1_M) take two mma
// a sub-block, one a half, and weight the halves' integer sums in integers; types with a minimum subtract
// (minimum * d_act) * msum, msum formed from the activation fragment's own integer sums (per half where the minimum
// is weighted per half: Q2_K). A lane decodes just the two words of the sub-block its fragment holds (decode_frag
// below; experts.py: ExpertKernels.mma, MMA_TYPES).
#define MMA_TYPE(q) ((q) != UNTUNED && (q) != 0 && (q) != 1 && (q) != 30)
template <int QT> struct MmaFolds {
    static constexpr bool value = QT == 10 || QT == 11 || QT == QT_Q6_K || QT == 17 || QT == 22 || QT == 29;
};
#if GU_KIN % 128 == 0 && DN_KIN % 128 == 0 && DN_ROWS % 64 == 0 && MMA_TYPE(GU_QT) && MMA_TYPE(DN_QT)
#define MMA_TILES 1

#ifndef MMA_MPW
#define MMA_MPW 2
#endif
#ifndef MMA_MT
#define MMA_MT 4
#endif
constexpr int MMA_M = 16 * MMA_MT;                 // pairs per tile (MMA_MT m-tiles of 16)
constexpr int MMA_WARPS = 8 * (MMA_MT / MMA_MPW);  // warp w: n-tile w % 8, m-tiles (w / 8) * MMA_MPW .. + MMA_MPW - 1
constexpr int MMA_NE = 4 * MMA_MPW;                // fragment elements a thread sums
static_assert((MMA_MT == 1 || MMA_MT == 2 || MMA_MT == 4) && MMA_MT % MMA_MPW == 0,
              "MMA_MT: 1, 2 or 4 m-tiles a tile; MMA_MPW: m-tiles per warp, dividing it");
// shared bytes at offset 0 of a tile kernel reading weights of type QT: the IQ3_S grid, one copy (decode_frag reads
// it as decode_sub does), a generic type's part of the table blob (as its SIMT kernels hold it: TabSmem), or none
template <int QT> struct MmaTbl {
    static constexpr int BYTES = QT == QT_IQ3_S ? 512 * 4 : TabSmem<QT>::BYTES;
};

template <int QT, int KIN, bool GU> struct MmaGeom {
    static constexpr int NSUB = KIN / 32;
    static constexpr int SPL = (NSUB + 31) / 32;
    static constexpr int RB = Geom<QT, KIN>::RB;
    static constexpr int AST = KIN + 16;       // activation row stride: ldmatrix's 8 rows fall on distinct banks
    static constexpr int DST = NSUB + 4;       // activation-scale row stride (floats): g rows on distinct banks
    static constexpr int CHB = (32 * RB + 14 + 15) / 16 * 16 + 16;  // one staged 32-row range (+16: over-read)
    static constexpr int FIN = MMA_M * 65 * 4; // gate/up: the item's MMA_M x 64 results, aliasing the weights
    static constexpr int WREG = (GU && FIN > 2 * CHB) ? FIN : 2 * CHB;
    static constexpr int O_A = MmaTbl<QT>::BYTES;
    static constexpr int O_D = O_A + MMA_M * AST;
    static constexpr int O_W = O_D + MMA_M * DST * 4;
    static constexpr int SMEM = O_W + WREG;
    static_assert(NSUB % 4 == 0, "scale rows are staged 16 bytes at a time");
};
typedef MmaGeom<GU_QT, GU_KIN, true> MGU;
typedef MmaGeom<DN_QT, DN_KIN, false> MDN;
constexpr int MMA_GU_SMEM = MGU::SMEM;
constexpr int MMA_DN_SMEM = MDN::SMEM;

// volatile keeps it after the barriers that publish the staged rows; no memory clobber, so that the compiler may
// still move ordinary shared loads (scales, weight bytes) around it to hide its latency
__device__ __forceinline__ void ldsm_x4(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// c = a (16 x 32, row) . b (32 x 8, col), int8 in, int32 out from zero
__device__ __forceinline__ void mma_s8(const u32 (&a)[4], u32 b0, u32 b1, int (&c)[4]) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// This thread's B fragment of sub-block s of the row at shared offset R: signed weights 4t..4t+3 (lo) and
// 16+4t..16+4t+3 (hi), i.e. decode_sub's q[t] and q[t + 4], and the sub-block's numbers (the view's scale, minimum,
// and each half's fold and minimum weight; only those its type has are set): the generic types through
// expert_term.cuh's word decoders (the sub-block's head, then words t and t + 4 alone), the tuned ones below.
struct FragSub {
    u32 lo, hi;
    float sc, mn;
    int f0, f1, w0, w1;
};

template <int QT> __device__ __forceinline__ void decode_frag(u32 R, int s, u32 t, FragSub& f) {
    static_assert(MMA_TYPE(QT) && XtTraits<QT>::WORDS == 8, "int8 codes");
    XtW<QT> w;
    const XtSub c = locate_sub<QT>(R, s, w);
    f.lo = xt_word<QT>(c, (int)t);
    f.hi = xt_word<QT>(c, (int)t + 4);
    if constexpr (XtTraits<QT>::IQ1) {  // code 8 g + delta a byte: g (-1, 0, 1) shifted bytewise (the bits a byte
        // shifts into the next are masked off), then the delta of the values' 8-group (lo: group t / 2, hi: 2 + t / 2)
        const u32 dl = (w.delta >> (t >> 1)) & 1u, dh = (w.delta >> (2u + (t >> 1))) & 1u;
        f.lo = __vadd4((f.lo << 3) & 0xf8f8f8f8u, dl ? 0xffffffffu : 0x01010101u);
        f.hi = __vadd4((f.hi << 3) & 0xf8f8f8f8u, dh ? 0xffffffffu : 0x01010101u);
    }
    f.sc = w.scale;
    if constexpr (DqTraits<QT>::MIN != DQ_NO_MIN) f.mn = w.minimum;
    if constexpr (MmaFolds<QT>::value) {
        f.f0 = w.fold[0];
        f.f1 = w.fold[1];
    }
    if constexpr (DqTraits<QT>::MIN == DQ_MIN_WEIGHTED) {
        f.w0 = w.mw[0];
        f.w1 = w.mw[1];
    }
}

template <> __device__ __forceinline__ void decode_frag<QT_Q8_0>(u32 R, int s, u32 t, FragSub& f) {
    const u32 B = R + 34u * (u32)s;  // 2-aligned
    f.sc = h2f(sm_u16(B));
    const u32 o = B + 2u + 4u * t;
    f.lo = sm_u16(o) | (sm_u16(o + 2u) << 16);
    f.hi = sm_u16(o + 16u) | (sm_u16(o + 18u) << 16);
}

template <> __device__ __forceinline__ void decode_frag<QT_Q4_K>(u32 R, int s, u32 t, FragSub& f) {
    const u32 j = (u32)s & 7u;
    const u32 B = R + 144u * ((u32)s >> 3);  // 16-aligned
    q4k_scale_min(B, j, f.sc, f.mn);
    const u32 qo = B + 16u + 32u * (j >> 1), nsh = 4u * (j & 1u);
    f.lo = (sm_u32(qo + 4u * t) >> nsh) & 0x0f0f0f0fu;
    f.hi = (sm_u32(qo + 16u + 4u * t) >> nsh) & 0x0f0f0f0fu;
}

template <> __device__ __forceinline__ void decode_frag<QT_IQ3_S>(u32 R, int s, u32 t, FragSub& f) {
    const u32 j = (u32)s & 7u;
    const u32 B = R + 110u * ((u32)s >> 3);  // 2-aligned
    const float d = h2f(sm_u16(B));
    const u32 nib = (sm_u8(B + 106u + (j >> 1)) >> (4u * (j & 1u))) & 15u;
    f.sc = f_mul(d, small_i2f((int)(1u + 2u * nib)));
    const u32 qh = sm_u8(B + 66u + j);
    u32 q[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 k = t + 4u * h;
        const u32 idx = sm_u8(B + 2u + 8u * j + k) | (((qh >> k) & 1u) << 8);
        const u32 mag = sm_u32(idx * 4u);
        const u32 sg = (sm_u8(B + 74u + 4u * j + (k >> 1)) >> (4u * (k & 1u))) & 15u;
        q[h] = xt_signed(mag, sg);
    }
    f.lo = q[0];
    f.hi = q[1];
}

#ifndef MMA_UNROLL
#define MMA_UNROLL 1
#endif
constexpr int MMA_LEAF_UNROLL = MMA_UNROLL;  // leaves a loop iteration: two give the scheduler independent work

// A warp's weight fragment of one sub-block, with the numbers of the thread's two output columns (rows 2t and
// 2t + 1, decoded by lanes 8t and 8t + 4): scales, and where the type has them minimums, folds (f<column><half>)
// and minimum weights (w<column><half>)
struct MmaFrag {
    u32 b0, b1;
    float sc0, sc1, mn0, mn1;
    int f00, f01, f10, f11, w00, w01, w10, w11;
};

template <int QT> __device__ __forceinline__ void mma_frag(u32 R, int s, u32 t, MmaFrag& f) {
    FragSub d;
    decode_frag<QT>(R, s, t, d);
    f.b0 = d.lo;
    f.b1 = d.hi;
    const int c0 = 8 * t, c1 = 8 * t + 4;
    f.sc0 = __shfl_sync(FULL_MASK, d.sc, c0);
    f.sc1 = __shfl_sync(FULL_MASK, d.sc, c1);
    if constexpr (DqTraits<QT>::MIN != DQ_NO_MIN) {
        f.mn0 = __shfl_sync(FULL_MASK, d.mn, c0);
        f.mn1 = __shfl_sync(FULL_MASK, d.mn, c1);
    }
    if constexpr (MmaFolds<QT>::value) {
        f.f00 = __shfl_sync(FULL_MASK, d.f0, c0);
        f.f01 = __shfl_sync(FULL_MASK, d.f1, c0);
        f.f10 = __shfl_sync(FULL_MASK, d.f0, c1);
        f.f11 = __shfl_sync(FULL_MASK, d.f1, c1);
    }
    if constexpr (DqTraits<QT>::MIN == DQ_MIN_WEIGHTED) {
        f.w00 = __shfl_sync(FULL_MASK, d.w0, c0);
        f.w01 = __shfl_sync(FULL_MASK, d.w1, c0);
        f.w10 = __shfl_sync(FULL_MASK, d.w0, c1);
        f.w11 = __shfl_sync(FULL_MASK, d.w1, c1);
    }
}

// The fragments of leaf l's sub-blocks (l, l + 32, ...) that exist
template <int QT, int SPL, int NSUB> __device__ __forceinline__ void leaf_frags(u32 R, int l, u32 t,
                                                                                MmaFrag (&f)[SPL]) {
#pragma unroll
    for (int i = 0; i < SPL; ++i)
        if (l + 32 * i < NSUB) mma_frag<QT>(R, l + 32 * i, t, f[i]);  // warp-uniform
}

// Push leaf j (x) onto the fold's stack: B = the number of trailing one bits of j, so x merges with levels
// 0 .. B-1 (lower lanes' subtrees on the left, as the fold adds them) and is parked at level B; at j = 31 (B = 5)
// x is the whole fold.
template <int B> __device__ __forceinline__ void push_leaf(float (&lv)[5][MMA_NE], float (&x)[MMA_NE]) {
#pragma unroll
    for (int e = 0; e < MMA_NE; ++e) {
#pragma unroll
        for (int b = 0; b < B; ++b) x[e] = f_add(lv[b][e], x[e]);
        if (B < 5) lv[B < 5 ? B : 0][e] = x[e];
    }
}

// One item's canonical sums: v[mt * 4 + e] for this warp's m-tile mt0 + mt, fragment element e (rows g / g + 8 of
// the m-tile, output columns 2t / 2t + 1 of the warp's n-tile). R: shared offset of this thread's weight row (row g
// of the n-tile); nmt: the m-tiles the tile's pairs fill. FULL: all of the warp's m-tiles are (the common case: no
// branch between their ldmatrix / mma / term chains, so the scheduler can interleave them).
template <int QT, int KIN, bool GU, bool FULL>
__device__ __forceinline__ void mma_leaves(u32 sb, u32 R, int mt0, int nmt, int lane, float (&v)[MMA_NE]) {
    typedef MmaGeom<QT, KIN, GU> G;
    const u32 g = (u32)lane >> 2, t = (u32)lane & 3u;
    // ldmatrix row addresses: lanes 8q..8q+7 give matrix q's rows (q & 1: rows 8..15; q >> 1: bytes 16..31)
    const u32 a_row = sb + G::O_A + (u32)(((lane & 7) + ((lane >> 3) & 1) * 8) * G::AST + (lane >> 4) * 16);
    const float* das = reinterpret_cast<const float*>(g_smem + G::O_D);
    float lv[5][MMA_NE];
    MmaFrag fr[G::SPL];
#pragma unroll (MMA_LEAF_UNROLL)
    for (int j = 0; j < 32; ++j) {
        const int l = (int)(__brev((u32)j) >> 27);  // the canonical lane whose leaf comes j-th
        leaf_frags<QT, G::SPL, G::NSUB>(R, l, t, fr);
        float leaf[MMA_NE];
#pragma unroll
        for (int e = 0; e < MMA_NE; ++e) leaf[e] = 0.0f;
#pragma unroll
        for (int i = 0; i < G::SPL; ++i) {
            const int s = l + 32 * i;
            float term[MMA_NE];
#pragma unroll
            for (int e = 0; e < MMA_NE; ++e) term[e] = 0.0f;
            if (s < G::NSUB) {  // warp-uniform
                const u32 b0 = fr[i].b0, b1 = fr[i].b1;
                const float sc0 = fr[i].sc0, sc1 = fr[i].sc1;
#pragma unroll
                for (int mt = 0; mt < MMA_MPW; ++mt) {
                    if (FULL || mt0 + mt < nmt) {  // warp-uniform
                        u32 a[4];
                        ldsm_x4(a_row + (u32)((mt0 + mt) * 16 * G::AST + 32 * s), a);
                        const int m0 = (mt0 + mt) * 16 + (int)g;
                        const float d0 = das[m0 * G::DST + s], d1 = das[(m0 + 8) * G::DST + s];
                        const MmaFrag& F = fr[i];
                        if constexpr (MmaFolds<QT>::value) {  // isum = fold0 (half 0's sum) + fold1 (half 1's):
                            int c[4], h[4];  // |isum| < 2^24 (docs/quant-types.md), so its float is exact
                            mma_s8(a, b0, 0u, c);
                            mma_s8(a, 0u, b1, h);
                            term[mt * 4 + 0] = f_mul(f_mul(sc0, d0), __int2float_rn(F.f00 * c[0] + F.f01 * h[0]));
                            term[mt * 4 + 1] = f_mul(f_mul(sc1, d0), __int2float_rn(F.f10 * c[1] + F.f11 * h[1]));
                            term[mt * 4 + 2] = f_mul(f_mul(sc0, d1), __int2float_rn(F.f00 * c[2] + F.f01 * h[2]));
                            term[mt * 4 + 3] = f_mul(f_mul(sc1, d1), __int2float_rn(F.f10 * c[3] + F.f11 * h[3]));
                        } else {
                            int c[4];
                            mma_s8(a, b0, b1, c);
                            term[mt * 4 + 0] = f_mul(f_mul(sc0, d0), small_i2f(c[0]));
                            term[mt * 4 + 1] = f_mul(f_mul(sc1, d0), small_i2f(c[1]));
                            term[mt * 4 + 2] = f_mul(f_mul(sc0, d1), small_i2f(c[2]));
                            term[mt * 4 + 3] = f_mul(f_mul(sc1, d1), small_i2f(c[3]));
                        }
                        if constexpr (DqTraits<QT>::MIN != DQ_NO_MIN) {  // - (minimum * d_act) * msum
                            // the activation's integer sums of rows g (a0: half 0, a2: half 1) and g + 8 (a1, a3)
                            // over the four lanes of a row; msum = their total, or each half's times its weight
                            int s0 = __dp4a((int)a[0], 0x01010101, 0), s1 = __dp4a((int)a[1], 0x01010101, 0);
                            int u0 = __dp4a((int)a[2], 0x01010101, 0), u1 = __dp4a((int)a[3], 0x01010101, 0);
                            if constexpr (DqTraits<QT>::MIN == DQ_MIN) {
                                s0 += u0;
                                s1 += u1;
                            }
#pragma unroll
                            for (int o = 1; o <= 2; o <<= 1) {
                                s0 += __shfl_xor_sync(FULL_MASK, s0, o);
                                s1 += __shfl_xor_sync(FULL_MASK, s1, o);
                                if constexpr (DqTraits<QT>::MIN == DQ_MIN_WEIGHTED) {
                                    u0 += __shfl_xor_sync(FULL_MASK, u0, o);
                                    u1 += __shfl_xor_sync(FULL_MASK, u1, o);
                                }
                            }
                            int m00 = s0, m10 = s0, m01 = s1, m11 = s1;  // m<column><row>
                            if constexpr (DqTraits<QT>::MIN == DQ_MIN_WEIGHTED) {
                                m00 = F.w00 * s0 + F.w01 * u0;
                                m10 = F.w10 * s0 + F.w11 * u0;
                                m01 = F.w00 * s1 + F.w01 * u1;
                                m11 = F.w10 * s1 + F.w11 * u1;
                            }
                            term[mt * 4 + 0] = f_sub(term[mt * 4 + 0], f_mul(f_mul(F.mn0, d0), small_i2f(m00)));
                            term[mt * 4 + 1] = f_sub(term[mt * 4 + 1], f_mul(f_mul(F.mn1, d0), small_i2f(m10)));
                            term[mt * 4 + 2] = f_sub(term[mt * 4 + 2], f_mul(f_mul(F.mn0, d1), small_i2f(m01)));
                            term[mt * 4 + 3] = f_sub(term[mt * 4 + 3], f_mul(f_mul(F.mn1, d1), small_i2f(m11)));
                        }
                    }
                }
            }
#pragma unroll
            for (int e = 0; e < MMA_NE; ++e) leaf[e] = f_add(leaf[e], term[e]);  // 0.0f past NSUB, as the lanes do
        }
        switch (__ffs(~j) - 1) {  // warp-uniform branch: each leaf does only its own merges
            case 0: push_leaf<0>(lv, leaf); break;
            case 1: push_leaf<1>(lv, leaf); break;
            case 2: push_leaf<2>(lv, leaf); break;
            case 3: push_leaf<3>(lv, leaf); break;
            case 4: push_leaf<4>(lv, leaf); break;
            default:
                push_leaf<5>(lv, leaf);
#pragma unroll
                for (int e = 0; e < MMA_NE; ++e) v[e] = leaf[e];
        }
    }
}

template <int QT, int KIN, bool GU>
__device__ __forceinline__ void mma_sums(u32 sb, u32 R, int mt0, int nmt, int lane, float (&v)[MMA_NE]) {
    if (mt0 >= nmt) {  // warp-uniform: no pair in this warp's m-tiles (their outputs are never read), no decoding
#pragma unroll
        for (int e = 0; e < MMA_NE; ++e) v[e] = 0.0f;
        return;
    }
    if (mt0 + MMA_MPW <= nmt) mma_leaves<QT, KIN, GU, true>(sb, R, mt0, nmt, lane, v);
    else mma_leaves<QT, KIN, GU, false>(sb, R, mt0, nmt, lane, v);
}

// Stage the tile's activation rows (int8 and scales) of pairs p0 .. p0 + 63 (rows past cnt repeat the last one).
// Gate/up reads the pairs' tokens' rows of qa / da, down the pairs' own rows of qh / dh.
template <int KIN, bool GU>
__device__ __forceinline__ void mma_stage_act(u32 sb, const int* __restrict__ pairs, int p0, int cnt,
                                              const signed char* __restrict__ q, const float* __restrict__ d) {
    typedef MmaGeom<GU ? GU_QT : DN_QT, KIN, GU> G;
    constexpr int QC = KIN / 16, DC = G::NSUB / 4;
    for (int c = threadIdx.x; c < MMA_M * (QC + DC); c += blockDim.x) {
        const bool isq = c < MMA_M * QC;
        const int cc = isq ? c : c - MMA_M * QC;
        const int m = isq ? cc / QC : cc / DC, k = isq ? cc - m * QC : cc - m * DC;
        const int p = p0 + min(m, cnt - 1);
        const i64 row = GU ? (i64)__ldg(pairs + 2 * p) : (i64)p;
        if (isq) cp_async16(sb + G::O_A + (u32)(m * G::AST + 16 * k), q + row * KIN + 16 * k);
        else cp_async16(sb + G::O_D + (u32)(m * G::DST * 4 + 16 * k), d + row * G::NSUB + 4 * k);
    }
}

// One item: stage the tile's activations (unless this block holds them already) and the weights' two 32-row ranges
// (w and w + off1), then this warp's sums (n-tiles 0-3 read the first range, 4-7 the second).
template <int QT, int KIN, bool GU>
__device__ __forceinline__ void mma_item(u32 sb, const int* __restrict__ pairs, int tile, int p0, int cnt,
                                         int& staged, const signed char* __restrict__ q,
                                         const float* __restrict__ d, const u8* w, i64 off1, int warp, int lane,
                                         float (&v)[MMA_NE]) {
    typedef MmaGeom<QT, KIN, GU> G;
    __syncthreads();  // the previous item is done with the weights / results region
    if (tile != staged) mma_stage_act<KIN, GU>(sb, pairs, p0, cnt, q, d);
    staged = tile;
    const u32 off = stage_row(sb + G::O_W, w, 32 * G::RB, threadIdx.x, blockDim.x);
    stage_row(sb + G::O_W + G::CHB, w + off1, 32 * G::RB, threadIdx.x, blockDim.x);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    const int nt = warp & 7;
    const u32 R = G::O_W + (nt >> 2) * G::CHB + off + (u32)(((nt & 3) * 8 + (lane >> 2)) * G::RB);
    mma_sums<QT, KIN, GU>(sb, R, (warp >> 3) * MMA_MPW, (cnt + 15) >> 4, lane, v);
}

// The tiled kernels' loop: the type's table at offset 0 (MmaTbl), then this block's
// items, a contiguous share of them so that consecutive items share their tile (whose activations stay staged). An
// item is (tile, group of output rows: 32 rows of gate and of up, or 64 down rows); for each whose tile has pairs,
// mma_item's sums v of this warp over the group's weight rows (from the tile's slot; the second 32-row range off1
// after the first), then out(grp, p0, cnt, v) writes them.
template <int QT, int KIN, bool GU, class Out>
__device__ __forceinline__ void mma_items(const u8* __restrict__ pool, i64 slot_bytes, i64 off1,
                                          const int* __restrict__ pairs, const int* __restrict__ tiles,
                                          const int* __restrict__ n_tiles_p, int max_tiles,
                                          const signed char* __restrict__ q, const float* __restrict__ d,
                                          const u32* __restrict__ grid_g, int lane, int warp, Out out) {
    constexpr int GROWS = GU ? 32 : 64;                       // a group's rows of each matrix
    constexpr int NGRP = (GU ? GU_ROWS : DN_ROWS) / GROWS;    // groups a tile
    const u32 sb = smem_base();
    const int items = clamp_pairs(n_tiles_p, max_tiles) * NGRP;
    if constexpr (TabSmem<QT>::ON) {
        fill_tab<QT>(grid_g);  // grid_g: the table blob
    } else if constexpr (QT == QT_IQ3_S) {
        for (int e = threadIdx.x; e < MmaTbl<QT>::BYTES / 4; e += blockDim.x)
            reinterpret_cast<u32*>(g_smem)[e] = __ldg(grid_g + e);
    }
    const int b0 = (int)((i64)items * blockIdx.x / gridDim.x);
    const int b1 = (int)((i64)items * (blockIdx.x + 1) / gridDim.x);
    int staged = -1;  // the tile whose activations are in shared memory
#pragma unroll 1
    for (int it = b0; it < b1; ++it) {
        const int tile = it / NGRP, grp = it - tile * NGRP;
        int p0, cnt;
        Tile<MMA_M>::get(tiles, tile, p0, cnt);
        if (cnt <= 0) continue;  // block-uniform
        const int slot = __ldg(pairs + 2 * p0 + 1);
        const u8* w = pool + (i64)slot * slot_bytes + (i64)grp * GROWS * MmaGeom<QT, KIN, GU>::RB;
        float v[MMA_NE];
        mma_item<QT, KIN, GU>(sb, pairs, tile, p0, cnt, staged, q, d, w, off1, warp, lane, v);
        out(grp, p0, cnt, v);
    }
}

extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, 1)
expert_gateup_mma(GU_TILED_PARAMS) {
    PDL_ENTRY();
    constexpr int NG = GU_ROWS / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // n-tiles 0-3: gate rows 8n..8n+7 of the group; n-tiles 4-7: the same rows of up
    mma_items<GU_QT, GU_KIN, true>(pool, slot_bytes, up_off, pairs, tiles, n_tiles_p, max_tiles, qa, da, grid_g, lane,
                                   warp, [&](int grp, int p0, int cnt, const float (&v)[MMA_NE]) {
        const int nt = warp & 7, mt0 = (warp >> 3) * MMA_MPW;
        __syncthreads();  // every warp is done with the weights: the results take their place
        float* fin = reinterpret_cast<float*>(g_smem + MGU::O_W);  // [pair][65]: gate 0..31, up 32..63
#pragma unroll
        for (int mt = 0; mt < MMA_MPW; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = (mt0 + mt) * 16 + (lane >> 2) + (e >> 1) * 8;
                fin[m * 65 + nt * 8 + 2 * (lane & 3) + (e & 1)] = v[mt * 4 + e];
            }
        __syncthreads();
        for (int m = warp; m < cnt; m += MMA_WARPS) {  // warp-uniform: one pair's 32 values of h, quantised
            const i64 p = p0 + m;
            const float hv = f_mul(c_silu(fin[m * 65 + lane]), fin[m * 65 + 32 + lane]);
            hbuf[p * GU_ROWS + grp * 32 + lane] = hv;
            quant32(hv, lane, qhbuf + p * GU_ROWS + grp * 32, dhbuf + p * NG + grp);
        }
    });
}

extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, 1)
expert_down_mma(DN_TILED_PARAMS) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    mma_items<DN_QT, DN_KIN, false>(pool, slot_bytes, 32 * MDN::RB, pairs, tiles, n_tiles_p, max_tiles, qhbuf, dhbuf,
                                    grid_g, lane, warp, [&](int grp, int p0, int cnt, const float (&v)[MMA_NE]) {
        const int nt = warp & 7, mt0 = (warp >> 3) * MMA_MPW;
#pragma unroll
        for (int mt = 0; mt < MMA_MPW; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = (mt0 + mt) * 16 + (lane >> 2) + h * 8;
                if (m < cnt)
                    *reinterpret_cast<float2*>(out + (i64)(p0 + m) * DN_ROWS + grp * 64 + nt * 8 + 2 * (lane & 3)) =
                        make_float2(v[mt * 4 + 2 * h], v[mt * 4 + 2 * h + 1]);
            }
    });
}

#else
#define MMA_TILES 0
constexpr int MMA_GU_SMEM = 0;
constexpr int MMA_DN_SMEM = 0;
#endif
