// =============================================================================================================
// mat-vec  y[r] = sum_c W[r, c] x[c] (+ res[r])
// Block = 8 warps. A warp owns R rows (its "row group"); KS warps of a block split a row group's K dimension
// (tiles round-robin) and are summed in shared memory in warp order (deterministic). Loads are 16-byte,
// coalesced, several tiles in flight per warp (R * U = 4 row-tiles for Q8_0, 8 for the float types).
// Block rows (Q8_0, Q4_K, Q5_K, Q6_K and IQ3_S as the file holds them, or the packed rows of every other quantised
// type, below) stream through a per-warp cp.async ring in shared memory (tile = 32 sub-blocks of 32 values, e.g. 1088
// bytes for Q8_0, 440 for IQ3_S; several row-tiles in flight per warp), then four lanes dot a sub-block of a tile,
// 8 values each; needs row_bytes % 16 == 0 and cols % 256 == 0.
// =============================================================================================================
#define MV_WARPS 8

// a mat-vec's activation: global (read-only path) or shared memory (XS: the fused RMSNorm's output, matvec.cu's norm_matvec)
template <bool XS>
__device__ __forceinline__ float4 ldx4(const float4* p) { return XS ? *p : __ldg(p); }

template <int R, int KS>
__device__ __forceinline__ void mv_finish(float (&acc)[R], int rg, int rows, const float* res, float* y) {
    __shared__ float red[MV_WARPS][R];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
    if (KS > 1) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) red[w][r] = acc[r];
        }
        __syncthreads();
        if ((w % KS) != 0) return;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float s = red[w][r];
            for (int k = 1; k < KS; ++k) s = f_add(s, red[w + k][r]);
            acc[r] = s;
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            int row = rg * R + r;
            if (row < rows) y[row] = res ? f_add(acc[r], res[row]) : acc[r];
        }
    }
}

// The rows the ring mat-vec reads, as formats: blocks of SB bytes holding NSUB sub-blocks of 32 values, TILE the
// bytes of a tile's 32 sub-blocks, SLOT a row's bytes of a ring stage (a tile staged from the 16-byte boundary
// below it: mis(tile) bytes before its first block), RING / NORM_RING row-tiles in flight a warp (NORM_RING where x
// shares the block's shared memory; both keep three blocks an SM), and term(): a lane's 8 values (part `sub`, 0-3)
// of sub-block b of the tile staged at byte `base` dotted with x0, x1, added to acc. part_q (no minimum): the
// part's scale and its 8 int8 codes, for the 8-bit x path.
template <int NSUB_, int SB_, int RING_, int NORM_RING_, int TAB_OFF_ = 0, int TAB_BYTES_ = 0> struct BlkGeom {
    static constexpr int NSUB = NSUB_, SB = SB_, TILE = 32 / NSUB_ * SB_;
    // a table the format reads (IQ3_S's grid: TAB_BYTES at TAB_OFF of the blob), staged after the ring by the block
    static constexpr int TAB_OFF = TAB_OFF_, TAB_BYTES = TAB_BYTES_;
    static constexpr int SLOT = (TILE + TILE % 16 + 15) / 16 * 16;  // TILE % 16 is 0 or 8 (2-byte aligned blocks)
    static constexpr int RING = RING_, NORM_RING = NORM_RING_;
    static_assert(TILE % 16 == 0 || TILE % 16 == 8, "tiles staged from a 16-byte boundary");
    static __device__ __forceinline__ u32 mis(int tile) { return TILE % 16 ? (u32)(tile * TILE) & 15u : 0u; }
};
// Q8_0 as the file holds it: f16 scale, 32 int8, blocks only 2-byte aligned, so the words are funnel-shifted.
struct Q8Blk : BlkGeom<1, 34, 8, 6> {
    static constexpr int BB = 34;
    static __device__ __forceinline__ float scale_q(const u8* sbv, u32 boff, int sub, u32& qa, u32& qb) {
        const float d = h2f(*(const u16*)(sbv + boff));
        const u32 qoff = boff + 2 + 8 * sub;
        const u32* wp = (const u32*)(sbv + (qoff & ~3u));
        const u32 sh = 8 * (qoff & 3u);
        const u32 w0 = wp[0], w1 = wp[1];
        const u32 w2 = sh ? wp[2] : 0u;
        qa = shf_r_clamp(w0, w1, sh);
        qb = shf_r_clamp(w1, w2, sh);
        return d;
    }
    static __device__ __forceinline__ float term(const u8* sbv, u32 base, int b, int sub, const u8*, float4 x0,
                                                 float4 x1, float acc) {
        u32 qa, qb;
        const float d = scale_q(sbv, base + BB * b, sub, qa, qb);
        return f_fma(d, dot8(qa, qb, x0, x1), acc);
    }
    static __device__ __forceinline__ float part_q(const u8* sbv, u32 base, int b, int sub, const u8*, u32& qa,
                                                   u32& qb) {
        return scale_q(sbv, base + BB * b, sub, qa, qb);
    }
    // the 8 int8 of qa, qb times x0, x1 (two chains, then their sum)
    static __device__ __forceinline__ float dot8(u32 qa, u32 qb, float4 x0, float4 x1) {
        qa ^= 0x80808080u;  // i8f reads biased bytes
        qb ^= 0x80808080u;
        float a0 = f_mul(x0.x, i8f(qa, 0));
        float a1 = f_mul(x0.y, i8f(qa, 1));
        a0 = f_fma(x0.z, i8f(qa, 2), a0);
        a1 = f_fma(x0.w, i8f(qa, 3), a1);
        a0 = f_fma(x1.x, i8f(qb, 0), a0);
        a1 = f_fma(x1.y, i8f(qb, 1), a1);
        a0 = f_fma(x1.z, i8f(qb, 2), a0);
        a1 = f_fma(x1.w, i8f(qb, 3), a1);
        return f_add(a0, a1);
    }
};
// value = scale * code - minimum over a lane's 8 values (8 int8 codes in qa, qb): the packed rows' term
template <bool MIN>
__device__ __forceinline__ float rq_term(float s, float m, u32 qa, u32 qb, float4 x0, float4 x1, float acc) {
    acc = f_fma(s, Q8Blk::dot8(qa, qb, x0, x1), acc);
    if (MIN) {
        const float sx = f_add(f_add(f_add(x0.x, x0.y), f_add(x0.z, x0.w)), f_add(f_add(x1.x, x1.y), f_add(x1.z, x1.w)));
        acc = f_fma(-m, sx, acc);
    }
    return acc;
}
// A packed row (decode.cuh rq_pack): NS float32 scales (a 32 or 16 values), NM float32 minimums (none, or one a
// scale), 32 int8 codes; value = scale * code - minimum. A lane's 8 values lie in one 16-value half.
template <int NS, int NM>  // Q8_0's ring bytes, or less
struct RqBlk : BlkGeom<1, 32 + 4 * (NS + NM), 8 * 34 / (32 + 4 * (NS + NM)), 6 * 34 / (32 + 4 * (NS + NM))> {
    static constexpr int BB = 32 + 4 * (NS + NM);
    static __device__ __forceinline__ float term(const u8* sbv, u32 base, int b, int sub, const u8*, float4 x0,
                                                 float4 x1, float acc) {
        const int h = NS == 2 ? sub >> 1 : 0;
        const u32* wp = (const u32*)(sbv + base + BB * b);
        const float m = NM ? __int_as_float(wp[NS + (NM == 2 ? h : 0)]) : 0.f;
        const u32 qa = wp[NS + NM + 2 * sub], qb = wp[NS + NM + 2 * sub + 1];
        return rq_term<NM != 0>(__int_as_float(wp[h]), m, qa, qb, x0, x1, acc);
    }
    // for the 8-bit x path: the numbers FileBlk's rq_part gives for the same part of the file's block, so a weight's
    // rows packed later (weights.DenseWeight.to_packed) give the bits its file rows gave
    static __device__ __forceinline__ float part_q(const u8* sbv, u32 base, int b, int sub, const u8*, u32& qa,
                                                   u32& qb) {
        static_assert(NM == 0, "8-bit x: formats without a minimum");
        const u32* wp = (const u32*)(sbv + base + BB * b);
        qa = wp[NS + 2 * sub];
        qb = wp[NS + 2 * sub + 1];
        return __int_as_float(wp[NS == 2 ? sub >> 1 : 0]);
    }
};
// A type's rows as the file holds them (decode.cuh RQ_PART_TYPES): a lane decodes its part of the staged block with
// rq_part (the packed format's numbers, so the packed rows' bits); tab: the type's table in shared memory.
template <int QT>
struct FileBlk : BlkGeom<DqTraits<QT>::NSUB, DqTraits<QT>::BB, 8, 6, RqTab<QT>::OFF, RqTab<QT>::BYTES> {
    typedef BlkGeom<DqTraits<QT>::NSUB, DqTraits<QT>::BB, 8, 6, RqTab<QT>::OFF, RqTab<QT>::BYTES> G;
    static constexpr bool MIN = DqTraits<QT>::MIN != DQ_NO_MIN;
    static __device__ __forceinline__ RqPart part(const u8* sbv, u32 base, int b, int sub, const u8* tab) {
        return rq_part<QT>(sbv + base + (b / G::NSUB) * G::SB, b % G::NSUB, sub, tab);
    }
    static __device__ __forceinline__ float term(const u8* sbv, u32 base, int b, int sub, const u8* tab, float4 x0,
                                                 float4 x1, float acc) {
        const RqPart p = part(sbv, base, b, sub, tab);
        return rq_term<MIN>(p.scale, p.minimum, p.qa, p.qb, x0, x1, acc);
    }
    static __device__ __forceinline__ float part_q(const u8* sbv, u32 base, int b, int sub, const u8* tab, u32& qa,
                                                   u32& qb) {
        static_assert(!MIN, "8-bit x: types without a minimum");
        const RqPart p = part(sbv, base, b, sub, tab);
        qa = p.qa;
        qb = p.qb;
        return p.scale;
    }
};

// F's rows: a warp's items are (its R rows) x (one tile of 32 sub-blocks); P = RT/R items in flight through a
// cp.async ring in (dynamic) shared memory: 8 warps x RT row-tiles x F::SLOT bytes (69632 for Q8_0's 8 tiles), then
// F::TAB_BYTES of the format's table (tab: the blob in global memory).
// nb: sub-blocks a row; blk: this block's index among the launch's blocks over these rows (blockIdx.x, or less
// where one launch covers two matrices). `wait` runs once the first tiles are in flight: it waits for the
// predecessor (x and res are its output) and may stage x.
template <class F, int R, int KS, int RT, bool XS, bool QX, class Wait>
__device__ __forceinline__ void matvec_blk_body(const u8* __restrict__ W, int rows, int nb, i64 row_bytes,
                                                const u8* __restrict__ tab, const float* x, const float* res,
                                                float* y, u8* ring, int blk, Wait wait) {
    constexpr int P = RT / R;
    static_assert(P >= 1, "a ring tile per row at least");
    static_assert(!QX || !XS, "8-bit x: read from global memory");
    constexpr int SLOT = F::SLOT;
    // QX: x is a row quantised to 8 bits (attn_combine_1p's out_q): nb * 32 int8 codes, then nb float scales
    const signed char* xq = (const signed char*)x;
    const float* xqd = (const float*)(xq + (i64)nb * 32);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int rg = blk * (MV_WARPS / KS) + w / KS;
    const int ks = w % KS;
    const int ntiles = (nb + 31) >> 5;
    const int nitems = ks < ntiles ? (ntiles - ks + KS - 1) / KS : 0;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    u8* st = ring + w * (RT * SLOT);
    const u32 st_addr = smem_addr(st);

    auto issue = [&](int i) {
        if (i < nitems) {
            const int tile = ks + i * KS;
            const u32 mis = F::mis(tile);
            // a row's end is 16-byte aligned, so the last tile's chunks end there
            const int bytes = min(32, nb - tile * 32) / F::NSUB * F::SB;
            const int nch = F::TILE % 16 ? (int)(mis + bytes + 15) >> 4 : bytes / 16;
            const u32 sb = st_addr + (i % P) * (R * SLOT);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = rg * R + r;
                if (row < rows) {
                    const u8* src = W + (i64)row * row_bytes + (i64)tile * F::TILE - mis;
#pragma unroll
                    for (int c = 0; c < 3; ++c) {
                        const int ch = lane + 32 * c;
                        if (ch < nch) cp_async16(sb + r * SLOT + ch * 16, src + ch * 16);
                    }
                }
            }
        }
        cp_commit();  // one group per item, empty past the end, so wait_group counts stay uniform
    };
#pragma unroll
    for (int i = 0; i < P - 1; ++i) issue(i);
    const u8* ftab = tab;  // what F::term reads: its table in shared memory, where it has one
    if constexpr (F::TAB_BYTES > 0) {  // copied while the first tiles load (no predecessor writes it)
        u32* ts = (u32*)(ring + MV_WARPS * RT * SLOT);
        const u32* src = (const u32*)(tab + F::TAB_OFF);
        static_assert(F::TAB_BYTES % (4 * MV_WARPS * 32) == 0, "a table word a thread, or a few");
#pragma unroll
        for (int k = 0; k < F::TAB_BYTES / (4 * MV_WARPS * 32); ++k)
            ts[threadIdx.x + MV_WARPS * 32 * k] = __ldg(src + threadIdx.x + MV_WARPS * 32 * k);
        __syncthreads();
        ftab = (const u8*)ts;
    }
    // 4 lanes per block, 8 values each: a warp step covers 8 blocks and its x reads are 1 KB contiguous
    const int bl = lane >> 2, sub = lane & 3;
    // QX: an item's 8-bit x (a lane's 8 codes and the scale of each of its 4 steps) loaded an item ahead: ptxas
    // places the ring's wait ahead of loads that follow it in the source (SASS of the NVRTC build), so x read in
    // the item would cost an L2 round trip after every tile's wait
    uint2 xv[QX ? 4 : 1];
    float dx[QX ? 4 : 1];
    auto load_x = [&](int i) {
        if constexpr (QX) {
            const int tile = ks + i * KS;
#pragma unroll
            for (int st4 = 0; st4 < 4; ++st4) {
                const int gb = tile * 32 + st4 * 8 + bl;
                if (i < nitems && st4 * 8 + bl < min(32, nb - tile * 32)) {
                    xv[st4] = __ldg((const uint2*)(xq + (i64)gb * 32 + 8 * sub));
                    dx[st4] = __ldg(xqd + gb);
                }
            }
        }
    };
    wait();
    load_x(0);
    for (int i = 0; i < nitems; ++i) {
        issue(i + P - 1);
        cp_wait<P - 1>();
        __syncwarp();
        const int tile = ks + i * KS;
        const int nbt = min(32, nb - tile * 32);
        const u32 mis = F::mis(tile);
        const u8* sbv = st + (i % P) * (R * SLOT);
        uint2 cx[QX ? 4 : 1];
        float cd[QX ? 4 : 1];
#pragma unroll
        for (int st4 = 0; st4 < (QX ? 4 : 0); ++st4) {
            cx[st4] = xv[st4];
            cd[st4] = dx[st4];
        }
        load_x(i + 1);
#pragma unroll
        for (int st4 = 0; st4 < 4; ++st4) {
            const int b = st4 * 8 + bl;
            if constexpr (QX) {  // two dp4a: 8 weights by 8 int8 x, exact in int; one float term a lane
                if (b < nbt) {
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        u32 qa, qb;
                        const float d = F::part_q(sbv, r * SLOT + mis, b, sub, ftab, qa, qb);
                        int sum = __dp4a((int)qa, (int)cx[st4 % 4].x, 0);
                        sum = __dp4a((int)qb, (int)cx[st4 % 4].y, sum);
                        acc[r] = f_fma(f_mul(d, cd[st4 % 4]), (float)sum, acc[r]);
                    }
                }
            } else if (b < nbt) {
                const float4* xp = (const float4*)(x + ((i64)tile * 32 + b) * 32 + 8 * sub);
                const float4 x0 = ldx4<XS>(xp), x1 = ldx4<XS>(xp + 1);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] = F::term(sbv, r * SLOT + mis, b, sub, ftab, x0, x1, acc[r]);
            }
        }
        __syncwarp();  // stage i % P is refilled by the next iteration's issue
    }
    cp_wait<0>();
    mv_finish<R, KS>(acc, rg, rows, res, y);
}

// `wait` (as in the block body) comes after the first weights' loads in the source, but ptxas schedules the PDL wait
// (ACQBULK) ahead of plain loads unless a cp.async precedes it (SASS of the NVRTC build): alone, these go out after it
template <int QT, int R, int KS, bool XS, class Wait>
__device__ __forceinline__ void matvec_float_body(const u8* __restrict__ W, int rows, int nchunk, i64 row_bytes,
                                                  const float* x, const float* res, float* y, Wait wait) {
    constexpr int U = 8 / R;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int rg = blockIdx.x * (MV_WARPS / KS) + w / KS;
    const int ks = w % KS;
    const int ntiles = (nchunk + 31) >> 5;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    uint4 v[U][R];
    auto load = [&](int it) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int ch = (it + u * KS) * 32 + lane;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = rg * R + r;
                if (row < rows && ch < nchunk) v[u][r] = ld_stream(W + (i64)row * row_bytes + (i64)ch * 16);
                else v[u][r] = make_uint4(0, 0, 0, 0);
            }
        }
    };
    load(ks);  // weights are no predecessor's output
    wait();
    for (int it = ks; it < ntiles; it += KS * U) {
        if (it != ks) load(it);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int ch = (it + u * KS) * 32 + lane;
            if (ch < nchunk) {
                if (QT == QT_F32) {
                    const float4 xx = ldx4<XS>((const float4*)x + ch);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        float a = acc[r];
                        a = f_fma(xx.x, __int_as_float(v[u][r].x), a);
                        a = f_fma(xx.y, __int_as_float(v[u][r].y), a);
                        a = f_fma(xx.z, __int_as_float(v[u][r].z), a);
                        a = f_fma(xx.w, __int_as_float(v[u][r].w), a);
                        acc[r] = a;
                    }
                } else {
                    const float4 x0 = ldx4<XS>((const float4*)x + 2 * ch), x1 = ldx4<XS>((const float4*)x + 2 * ch + 1);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const uint4 q = v[u][r];
                        float a = acc[r], b = 0.f;
                        if (QT == QT_F16) {
                            a = f_fma(x0.x, h2f((u16)(q.x & 0xffff)), a); b = f_fma(x0.y, h2f((u16)(q.x >> 16)), b);
                            a = f_fma(x0.z, h2f((u16)(q.y & 0xffff)), a); b = f_fma(x0.w, h2f((u16)(q.y >> 16)), b);
                            a = f_fma(x1.x, h2f((u16)(q.z & 0xffff)), a); b = f_fma(x1.y, h2f((u16)(q.z >> 16)), b);
                            a = f_fma(x1.z, h2f((u16)(q.w & 0xffff)), a); b = f_fma(x1.w, h2f((u16)(q.w >> 16)), b);
                        } else {
                            a = f_fma(x0.x, __int_as_float(q.x << 16), a); b = f_fma(x0.y, __int_as_float(q.x & 0xffff0000u), b);
                            a = f_fma(x0.z, __int_as_float(q.y << 16), a); b = f_fma(x0.w, __int_as_float(q.y & 0xffff0000u), b);
                            a = f_fma(x1.x, __int_as_float(q.z << 16), a); b = f_fma(x1.y, __int_as_float(q.z & 0xffff0000u), b);
                            a = f_fma(x1.z, __int_as_float(q.w << 16), a); b = f_fma(x1.w, __int_as_float(q.w & 0xffff0000u), b);
                        }
                        acc[r] = f_add(a, b);
                    }
                }
            }
        }
    }
    mv_finish<R, KS>(acc, rg, rows, res, y);
}

// x staged in shared memory (the fused norm's row, norm_matvec; the Q8_0 mat-vecs of rows up to NORM_MV_MAX_N) with
// the format's NORM_RING ring tiles a warp, so that three blocks fit an SM beside it (matvec.py's smem sizes)
#define NORM_MV_MAX_N 4096

// x (n floats, n % 4 == 0, n <= NORM_MV_MAX_N) into shared memory by a block of MV_WARPS warps, every thread's
// loads issued before its first store (a strided copy loop waited one L2 round trip per element: 36 % of the qkv
// mat-vec's stall samples, ncu on the H200); a barrier must follow before xs is read.
#define STAGE_V4 (NORM_MV_MAX_N / (4 * MV_WARPS * 32))  // float4 a thread
__device__ __forceinline__ void stage_row(const float* __restrict__ x, int n, float* xs) {
    float4 v[STAGE_V4];
#pragma unroll
    for (int k = 0; k < STAGE_V4; ++k) {
        const int i = threadIdx.x + MV_WARPS * 32 * k;
        if (4 * i < n) v[k] = __ldg((const float4*)x + i);
    }
#pragma unroll
    for (int k = 0; k < STAGE_V4; ++k) {
        const int i = threadIdx.x + MV_WARPS * 32 * k;
        if (4 * i < n) ((float4*)xs)[i] = v[k];
    }
}

// ncu: Q8_0 -> blocks per row; float types -> 16-byte chunks per row
