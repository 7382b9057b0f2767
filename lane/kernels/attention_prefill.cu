// prefill attention (a prompt chunk of T tokens at positions pos0 .. pos0+T-1 over the whole cached prefix):
// the query rows packed per kv head (r = t * group + j: head h * group + j of token t), the flash kernel below, the
// output unpacked (attention.py: PrefillAttention).
#include "common.cuh"
#include "dense_common.cuh"
#include "norm.cuh"
#include "rope.cuh"
#include "attention.cuh"

// q (T, n_head, hd) f32 -> qp (n_kv, T * group, hd) f16, times scale (softmax's 1/sqrt(hd), applied before the
// fp16 rounding so scores need no scaling).
// element idx of a (T, n_head, hd) array -> its place in (n_kv, T * group, hd)
__device__ __forceinline__ i64 kv_major(i64 idx, int T, int n_head, int n_kv, int hd) {
    const int d = (int)(idx % hd);
    const int head = (int)((idx / hd) % n_head);
    const int t = (int)(idx / ((i64)hd * n_head));
    const int g = n_head / n_kv, h = head / g, j = head - h * g;
    return (((i64)h * T + t) * g + j) * hd + d;
}

extern "C" __global__ void attn_q_pack(const float* __restrict__ q, int T, int n_head, int n_kv, int hd,
                                       float scale, u16* __restrict__ qp) {
    PDL_ENTRY();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * n_head * hd) return;
    qp[kv_major(idx, T, n_head, n_kv, hd)] = f2h(f_mul(q[idx], scale));
}

// o (n_kv, T * group, hd) f32 -> out (T, n_head * hd) f32
extern "C" __global__ void attn_o_unpack(const float* __restrict__ o, int T, int n_head, int n_kv, int hd,
                                         float* __restrict__ out) {
    PDL_ENTRY();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * n_head * hd) return;
    out[idx] = o[kv_major(idx, T, n_head, n_kv, hd)];
}

// =============================================================================================================
// prompt attention, flash style on fp16 tensor cores (mma.m16n8k16, fp32 accumulate): no score matrix in
// memory. Per kv head the chunk's query rows r = t * group + j (qp from attn_q_pack: f16, scaled by 1/sqrt(hd))
// attend to keys 0 .. pos0 + t. A block takes BM rows (BM / 16 warps x 16); keys come in tiles of 64 through shared
// memory (cp.async, one barrier a tile; keys past the chunk read as 0, so a NaN left in the cache cannot reach
// P V). Per warp and tile: S (16 x 64) = Q K^T, the online softmax in base 2 (P rounded to f16, l summed from the
// rounded values, as in the decode kernel), then O (16 x hd) += P V with the S accumulators reused as A fragments.
// The B fragments of K and V^T come from shared memory by ldmatrix.x4 (two n-tiles a load); shared rows are padded
// by 16 bytes so that each 8-row phase of ldmatrix hits 32 different banks.
// The block's Q tile sits in shared memory, its fragments read by ldmatrix at each use, with 2 key-tile stages, so
// that two blocks (16 warps) fit an SM's registers (128 a thread) and shared memory.
// Grid (ceil(R / BM), n_kv), BM * 2 threads, dynamic shared memory FaShape<HD, BM>::SMEM. BM = 128; 64 where that
// is over a card's shared memory (head_dim 128 on a 99 KB card). A warp's results depend on its own 16 rows only
// (the tiles it skips, its masks and rescales are its own), so both give the same bits.
// =============================================================================================================
constexpr int FA_BN = 64;

template <int HD, int BM>
struct FaShape {
    static constexpr int THREADS = BM / 16 * 32;
    static constexpr int STAGES = 2;  // key tiles in flight: the next STAGES - 1 load while one computes
    static constexpr int KST = HD + 8;     // K tile row and Q row (halfs)
    static constexpr int VST = FA_BN + 8;  // V^T tile row (halfs)
    static constexpr int STAGE = FA_BN * KST + HD * VST;  // halfs
    static constexpr int QTILE = BM * KST;  // halfs, before the stages
    static constexpr int SMEM = (QTILE + STAGES * STAGE) * 2;  // bytes
};

// four 8x8 b16 matrices from shared memory: thread t gives the address of row t % 8 of matrix t / 8 and receives
// (row lane / 4, columns 2 (lane % 4), +1) of each: for row-major n x k tiles, the B fragments of two mma k-halves
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// keys k0 .. k0 + 63 of one kv head into a stage: K rows (key-major) and V^T rows (dim-major); keys >= S as 0
template <int HD, int BM>
__device__ __forceinline__ void fa_load(u16* st, const u16* __restrict__ kh, const u16* __restrict__ vh, int k0, int S,
                                        int tid) {
    using F = FaShape<HD, BM>;
    u16* ks = st;
    u16* vs = st + FA_BN * F::KST;
    for (int i = tid; i < FA_BN * (HD / 8); i += F::THREADS) {
        const int key = i / (HD / 8), c = i % (HD / 8);
        u16* dst = ks + key * F::KST + c * 8;
        if (k0 + key < S) cp_async16(smem_addr(dst), kh + (i64)(k0 + key) * HD + c * 8);
        else *(uint4*)dst = make_uint4(0u, 0u, 0u, 0u);
    }
    for (int i = tid; i < HD * (FA_BN / 8); i += F::THREADS) {  // V^T: the key tiles' 16-position pieces in order
        const int kt = i / (2 * HD), d = (i >> 1) % HD, key = k0 + 16 * kt + 8 * (i & 1);
        u16* dst = vs + d * F::VST + (key - k0);
        const u16* src = vh + ((i64)(key >> 4) * HD + d) * 16 + (key & 15);
        if (key + 8 <= S) {
            cp_async16(smem_addr(dst), src);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) dst[e] = key + e < S ? src[e] : (u16)0;
        }
    }
}

template <int HD, int BM>
__device__ __forceinline__ void attn_flash_body(const u16* __restrict__ qp, const u16* __restrict__ kc,
                                                const u16* __restrict__ vc, int R, int group, int pos0, int max_ctx,
                                                float* __restrict__ o) {
    using F = FaShape<HD, BM>;
    constexpr int KS = HD / 16, NDT = HD / 8, NT = FA_BN / 8;
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ __align__(16) u16 fa_sm[];
    const int h = blockIdx.y, r0 = blockIdx.x * BM;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, q4 = lane & 3;
    const int S = pos0 + R / group;  // the prefix and the chunk
    const u16* kh = kc + (i64)h * max_ctx * HD;
    const u16* vh = vc + v_at(h, HD, max_ctx, 0, 0);
    const int ra = r0 + w * 16 + g, rb = ra + 8;  // this thread's two rows
    const int la_key = pos0 + min(ra, R - 1) / group, lb_key = pos0 + min(rb, R - 1) / group;  // last key each sees

    // Q's A fragments of a k-step: (row g, dims 2 q4 + {0, 1}), (row g + 8, same), then both at dims + 8
    u32 qf[1][4];
    u16* const stages = fa_sm + F::QTILE;
    // the block's rows into shared memory, landing with the first key tile's commit group
    for (int i = tid; i < BM * (HD / 8); i += F::THREADS) {
        const int r = i / (HD / 8), c = i % (HD / 8);
        cp_async16(smem_addr(fa_sm + r * F::KST + c * 8), qp + ((i64)h * R + min(r0 + r, R - 1)) * HD + c * 8);
    }
    // ldmatrix rows of the Q tile: lanes 0-15 rows w * 16 + lane (dims + 0), lanes 16-31 the same rows, dims + 8
    const u32 qaddr = smem_addr(fa_sm + (w * 16 + (lane & 15)) * F::KST + (lane >> 4) * 8);
    float acc[NDT][4];
#pragma unroll
    for (int i = 0; i < NDT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float ma = NEG_INF, mb = NEG_INF, la = 0.f, lb = 0.f;

    const int kend = pos0 + (min(r0 + BM, R) - 1) / group + 1;  // keys this block needs
    const int nkb = (kend + FA_BN - 1) / FA_BN;
    const int warp_last = pos0 + (min(r0 + w * 16 + 15, R - 1)) / group;  // the warp's last visible key
    const int warp_first = pos0 + min(r0 + w * 16, R - 1) / group;         // every row of the warp sees keys <= it
#pragma unroll
    for (int t = 0; t < F::STAGES - 1; ++t) {  // the first tiles in flight (a commit group each, empty or not)
        if (t < nkb) fa_load<HD, BM>(stages + t * F::STAGE, kh, vh, t * FA_BN, S, tid);
        cp_commit();
    }
    for (int kb = 0; kb < nkb; ++kb) {
        cp_wait<F::STAGES - 2>();  // this thread's copies of tile kb (and of Q) have landed
        __syncthreads();           // everyone's have; and everyone is done with tile kb - 1, whose stage refills now
        const int nx = kb + F::STAGES - 1;
        if (nx < nkb) fa_load<HD, BM>(stages + (nx % F::STAGES) * F::STAGE, kh, vh, nx * FA_BN, S, tid);
        cp_commit();
        const int k0 = kb * FA_BN;
        if (k0 <= warp_last) {  // else every key of the tile is after this warp's rows
            const u16* ks_ = stages + (kb % F::STAGES) * F::STAGE;
            const u16* vs_ = ks_ + FA_BN * F::KST;
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            // this lane's ldmatrix row: key (nt + lane / 16) * 8 + lane % 8, dims + 8 for matrices 1 and 3
            const u32 kaddr = smem_addr(ks_ + ((lane >> 4) * 8 + (lane & 7)) * F::KST + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                u32* a = qf[0];
                ldsm_x4(qaddr + (u32)(ks * 16 * 2), a[0], a[1], a[2], a[3]);
#pragma unroll
                for (int nt = 0; nt < NT; nt += 2) {
                    u32 b0, b1, c0, c1;
                    ldsm_x4(kaddr + (u32)((nt * 8 * F::KST + ks * 16) * 2), b0, b1, c0, c1);
                    mma16816(s[nt], a[0], a[1], a[2], a[3], b0, b1);
                    mma16816(s[nt + 1], a[0], a[1], a[2], a[3], c0, c1);
                }
            }
            float mxa = ma, mxb = mb;
            const bool diag = k0 + FA_BN - 1 > warp_first;  // warp-uniform: some key of the tile is masked
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = k0 + nt * 8 + 2 * q4 + e;
                    s[nt][e] = !diag || key <= la_key ? f_mul(s[nt][e], LOG2E) : NEG_INF;
                    s[nt][2 + e] = !diag || key <= lb_key ? f_mul(s[nt][2 + e], LOG2E) : NEG_INF;
                    mxa = fmaxf(mxa, s[nt][e]);
                    mxb = fmaxf(mxb, s[nt][2 + e]);
                }
            mxa = quad_max(mxa);
            mxb = quad_max(mxb);
            // key 0 is in every row's first tile, so the maxima are finite from the first tile on
            const float ala = f_ex2(f_sub(ma, mxa)), alb = f_ex2(f_sub(mb, mxb));
            ma = mxa;
            mb = mxb;
            la = f_mul(la, ala);
            lb = f_mul(lb, alb);
            if (__any_sync(0xffffffffu, ala != 1.f || alb != 1.f)) {  // else the products are acc itself
#pragma unroll
                for (int i = 0; i < NDT; ++i) rescale_c(acc[i], ala, alb);
            }
            u32 pa[NT], pb[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                pa[nt] = p_h2(s[nt][0], s[nt][1], ma, la);
                pb[nt] = p_h2(s[nt][2], s[nt][3], mb, lb);
            }
            // ldmatrix row: dim (dt + lane / 16) * 8 + lane % 8, keys + 8 for matrices 1 and 3
            const u32 vaddr = smem_addr(vs_ + ((lane >> 4) * 8 + (lane & 7)) * F::VST + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int kk = 0; kk < FA_BN / 16; ++kk)
#pragma unroll
                for (int dt = 0; dt < NDT; dt += 2) {
                    u32 b0, b1, c0, c1;
                    ldsm_x4(vaddr + (u32)((dt * 8 * F::VST + kk * 16) * 2), b0, b1, c0, c1);
                    mma16816(acc[dt], pa[2 * kk], pb[2 * kk], pa[2 * kk + 1], pb[2 * kk + 1], b0, b1);
                    mma16816(acc[dt + 1], pa[2 * kk], pb[2 * kk], pa[2 * kk + 1], pb[2 * kk + 1], c0, c1);
                }
        }
    }
    la = f_add(la, __shfl_xor_sync(0xffffffffu, la, 1));
    la = f_add(la, __shfl_xor_sync(0xffffffffu, la, 2));
    lb = f_add(lb, __shfl_xor_sync(0xffffffffu, lb, 1));
    lb = f_add(lb, __shfl_xor_sync(0xffffffffu, lb, 2));
    const float ia = 1.0f / la, ib = 1.0f / lb;
#pragma unroll
    for (int dt = 0; dt < NDT; ++dt) {
        const int d = dt * 8 + 2 * q4;
        if (ra < R) *(float2*)(o + ((i64)h * R + ra) * HD + d) = make_float2(acc[dt][0] * ia, acc[dt][1] * ia);
        if (rb < R) *(float2*)(o + ((i64)h * R + rb) * HD + d) = make_float2(acc[dt][2] * ib, acc[dt][3] * ib);
    }
}

#define FA_INST(HD, BM, NAME)                                                                                     \
    extern "C" __global__ void __launch_bounds__(BM / 16 * 32, 2) NAME(                                            \
        const u16* __restrict__ qp, const u16* __restrict__ kc, const u16* __restrict__ vc, int R, int group,      \
        int pos0, int max_ctx, float* __restrict__ o) {                                                           \
        PDL_ENTRY();                                                                                               \
        attn_flash_body<HD, BM>(qp, kc, vc, R, group, pos0, max_ctx, o);                                          \
    }
FA_INST(64, 128, attn_flash_prefill_64)
FA_INST(128, 128, attn_flash_prefill_128)
FA_INST(64, 64, attn_flash_prefill_64_m64)
FA_INST(128, 64, attn_flash_prefill_128_m64)
