// decode attention, split-K ("flash decoding") on fp16 tensor cores (mma.m16n8k16, fp32 accumulate).
// Grid (nsplit, n_kv, T), 4 warps per block. Token t attends to positions [0, pos[0] + t] of its kv head.
// chunk = roundup64(max(chunk_min, ceil(len / nsplit))), block s covers [s*chunk, min(len, (s+1)*chunk));
// blocks past ceil(len / chunk) exit. Warp w takes 16-position tiles w, w+4, ... of the block's range.
//  S (heads x 8 positions) = Q (16 head rows: the group's heads, zero-padded) K^T: the k (head-dim) index is
//  permuted identically in Q and K so that each thread loads whole 16-byte chunks of K rows; the positions of
//  the two 8-column S tiles are interleaved so that the S accumulators become the P A-fragments of
//  O (heads x hd) = P V, and each thread's B-fragment of V^T is 4 consecutive positions (8 bytes). With 8 heads a
//  group (half of an A operand padding) O^T = V^T P^T instead: the same V^T loads as A fragments, the first half of
//  the P fragments as B, half the MMAs and accumulators (fewer registers: docs/perf-notes.md).
// Online softmax in base 2 (scores * log2(e)/sqrt(hd)), P rounded to f16 and l summed from the rounded values.
// The block merges its 4 warps and writes one partial (m, l, O unnormalised) per (t, kv head, split, head).
// A warp's K / V tiles reach its registers one of two ways, the arithmetic the same: loaded where used (plain), or
// the next tile prefetched into registers (PIPE, 246 registers at 16 heads).
#include "common.cuh"
#include "dense_common.cuh"
#include "norm.cuh"
#include "rope.cuh"
#include "attention.cuh"

__device__ __forceinline__ void attn_split_geom(int len, int nsplit, int chunk_min, int& chunk, int& nact) {
    int c = (len + nsplit - 1) / nsplit;
    c = max(c, chunk_min);
    c = (c + 63) & ~63;
    chunk = c;
    nact = (len + c - 1) / c;
}

__device__ __forceinline__ u32 uget(const uint4& v, int m) { return m == 0 ? v.x : m == 1 ? v.y : m == 2 ? v.z : v.w; }

// A decode step's q/k RMSNorm, RoPE and KV append, folded into the split kernel (FUSE, T = 1): the raw q/k/v row
// and what qk_norm_rope_kv takes besides.
struct AttnQkv {
    const float* qkv;
    const float* qnw;
    const float* knw;
    float eps;
    const float* cos_t;
    const float* sin_t;
};

// The decode position, read with cp.async before the PDL wait, then the wait (ptxas keeps cp.async ahead of
// griddepcontrol.wait but sinks plain loads past it, SASS of the NVRTC build): an earlier step's advance_pos wrote
// it, never the kernel this one waits for. Every thread of the block calls it (one barrier).
__device__ __forceinline__ int pos_then_wait(const int* pos_p) {
    __shared__ int s_pos;
    if (threadIdx.x == 0) cp_async4(smem_addr(&s_pos), pos_p);
    cp_commit();
    PDL_ENTRY();
    cp_wait<0>();
    __syncthreads();
    return s_pos;
}

template <int HD, bool G16, bool PIPE, bool FUSE>
__device__ __forceinline__ void attn_split_body(const float* __restrict__ q, const u16* kc, const u16* vc,
                                                const int* __restrict__ pos_p, int n_head, int n_kv, int max_ctx,
                                                int nsplit, int chunk_min, float scale_log2,
                                                float* __restrict__ part_o, float* __restrict__ part_ml,
                                                AttnQkv f) {
    constexpr int NJ = HD / 32;   // 16-byte chunks of a K row per thread
    constexpr int KS = HD / 16;   // k-steps of QK^T
    constexpr int NDT = HD / 8;   // dim tiles of PV
    constexpr int ROWS = G16 ? 16 : 8;
    __shared__ float sm_o[4][ROWS][HD];
    __shared__ float sm_m[4][ROWS], sm_l[4][ROWS];

    const int s = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z;
    const int group = n_head / n_kv;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;

    int len = 0, chunk = 0, nact = 0;
    const float* qg = FUSE ? nullptr : q + ((i64)t * n_head + (i64)kvh * group) * HD;  // the group's q rows
    if (FUSE) {  // the position first: blocks past the active splits leave before doing anything
        const int pos = pos_then_wait(pos_p);
        len = min(pos + 1, max_ctx);
        attn_split_geom(len, nsplit, chunk_min, chunk, nact);
        if (s >= nact) return;
        float* qs = &sm_o[0][0][0];  // the group's q rows, then (the appending block) the raw k row; sm_o's use comes
        float* kx = qs + 16 * HD;    // after a barrier
        const int pc = min(pos, max_ctx - 1);
        const float* ct = f.cos_t + (i64)pc * (HD / 2);
        const float* st = f.sin_t + (i64)pc * (HD / 2);
        const HeadRope rq = head_rope_load(f.qnw, ct, st, HD, lane);  // issued with the q rows' loads
        {  // the warp's q heads j = w, w + 4, .. (group <= 16: four at most) loaded at once, then staged
            float v[4][HD / 32];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const int j = w + 4 * jj;
#pragma unroll
                for (int m = 0; m < HD / 32; ++m)
                    if (j < group) v[jj][m] = f.qkv[((i64)kvh * group + j) * HD + lane + 32 * m];
            }
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const int j = w + 4 * jj;
#pragma unroll
                for (int m = 0; m < HD / 32; ++m)
                    if (j < group) qs[j * HD + lane + 32 * m] = v[jj][m];
            }
            __syncwarp();
        }
        for (int j = w; j < group; j += 4) {  // warp-uniform: head kvh * group + j, normalised and rotated in place
            float* x = qs + j * HD;
            head_norm_rope(x, rq, f.eps, HD, lane, [&](int i, float oa, float ob) {
                x[i] = oa;
                x[i + HD / 2] = ob;
            });
        }
        if (s == nact - 1 && pos < max_ctx) {  // its range holds the position: it writes the step's K and V there
            // (all of this kernel's K / V loads take the coherent path, so this block's own loads see them)
            u16* kw = const_cast<u16*>(kc);
            u16* vw = const_cast<u16*>(vc);
            const float* kv_row = f.qkv + (i64)(n_head + kvh) * HD;  // raw k of this kv head; v follows the k heads
            if (w == 0) {
                const HeadRope rk = head_rope_load(f.knw, ct, st, HD, lane);
                for (int d = lane; d < HD; d += 32) kx[d] = kv_row[d];
                __syncwarp();
                head_norm_rope(kx, rk, f.eps, HD, lane, [&](int i, float oa, float ob) {
                    kw[((i64)kvh * max_ctx + pos) * HD + i] = f2h(oa);
                    kw[((i64)kvh * max_ctx + pos) * HD + i + HD / 2] = f2h(ob);
                });
            } else if (w == 1) {
                for (int d = lane; d < HD; d += 32)
                    vw[v_at(kvh, HD, max_ctx, d, pos)] = f2h(kv_row[(i64)n_kv * HD + d]);
            }
        }
        __syncthreads();  // q in shared memory; the K / V row written (for this block's own loads)
        qg = qs;
    }

    // ---- Q fragments (f16, permuted k) ----
    u32 qa[KS][2], qb[KS][2];
    {
        const float* q0 = qg + g * HD;
        const float* q8 = qg + (g + 8) * HD;
        const bool v0 = g < group, v8 = G16 && (g + 8 < group);
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int L = 2 * ks + e, j = L >> 2, m = L & 3;
                const int d = 8 * (tq + 4 * j) + 2 * m;
                qa[ks][e] = v0 ? pack_h2(q0[d], q0[d + 1]) : 0u;
                qb[ks][e] = v8 ? pack_h2(q8[d], q8[d + 1]) : 0u;
            }
        }
    }

    if (FUSE) {
        __syncthreads();  // every warp has its fragments: sm_o is free for the merge
    } else {  // the position is read after the q loads were issued (independent latencies overlap)
        len = min(pos_p[0] + t + 1, max_ctx);
        attn_split_geom(len, nsplit, chunk_min, chunk, nact);
        if (s >= nact) return;
    }
    const int start = s * chunk, end = min(len, start + chunk);
    const int ntile = (end - start + 15) >> 4;

    // O's accumulators. A group of 8 heads fills half of an m16n8k16 A operand, so there O^T = V^T P^T instead
    // (V^T 16 dims x 16 positions the A operand, P^T the B one: the two PV MMAs of a 16-dim slice become one):
    // o[j] holds dims 16 j + g (c0, c1) and 16 j + g + 8 (c2, c3) of heads 2 tq, 2 tq + 1. 16 heads: O = P V,
    // o[dt] holds heads g (c0, c1) and g + 8 (c2, c3), dims dt * 8 + 2 tq, + 1.
    constexpr int NO = G16 ? NDT : NDT / 2;
    float o[NO][4];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = NEG_INF, m8 = NEG_INF, l0 = 0.f, l8 = 0.f;

    const u16* kbase = kc + (i64)kvh * max_ctx * HD;
    const u16* vbase = vc + v_at(kvh, HD, max_ctx, 0, 0);

    // ---- loads of one tile: K rows for the two S tiles, V^T 4 positions x NDT dims ----
    auto load_tile = [&](int it, uint4 (&k)[2][NJ], uint2 (&v)[NDT]) {
        const int p0 = start + 16 * it;
#pragma unroll
        for (int si = 0; si < 2; ++si) {
            const int p = p0 + 4 * (g >> 1) + 2 * si + (g & 1);
            const u16* kr = kbase + (i64)p * HD;
#pragma unroll
            for (int j = 0; j < NJ; ++j) k[si][j] = ld_stream<!FUSE>(kr + 8 * (tq + 4 * j));
        }
#pragma unroll
        for (int dt = 0; dt < NDT; ++dt) {
            const u16* vp = vbase + ((i64)(p0 >> 4) * HD + dt * 8 + g) * 16 + 4 * tq;  // p0 % 16 == 0
            v[dt] = ld_stream_u2<!FUSE>(vp);
        }
    };

    // ---- one tile at p0: S = Q K^T, the online softmax, O = O * alpha + P V ----
    auto compute_tile = [&](int p0, uint4 (&kv)[2][NJ], uint2 (&vv)[NDT]) {
        float sc[2][4];
#pragma unroll
        for (int si = 0; si < 2; ++si) {
            sc[si][0] = sc[si][1] = sc[si][2] = sc[si][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                const int j = ks >> 1, m = 2 * (ks & 1);
                mma16816(sc[si], qa[ks][0], qb[ks][0], qa[ks][1], qb[ks][1], uget(kv[si][j], m), uget(kv[si][j], m + 1));
            }
        }
        float mx0 = NEG_INF, mx8 = NEG_INF;
        const bool edge = p0 + 16 > end;  // warp-uniform: only the range's last tile has positions to mask
#pragma unroll
        for (int si = 0; si < 2; ++si) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool ok = !edge || p0 + 4 * tq + 2 * si + e < end;
                sc[si][e] = ok ? f_mul(sc[si][e], scale_log2) : NEG_INF;
                sc[si][2 + e] = ok ? f_mul(sc[si][2 + e], scale_log2) : NEG_INF;
                mx0 = fmaxf(mx0, sc[si][e]);
                mx8 = fmaxf(mx8, sc[si][2 + e]);
            }
        }
        mx0 = quad_max(mx0);
        mx8 = quad_max(mx8);
        const float mn0 = fmaxf(m0, mx0), mn8 = fmaxf(m8, mx8);
        const float al0 = f_ex2(f_sub(m0, mn0)), al8 = f_ex2(f_sub(m8, mn8));
        m0 = mn0;
        m8 = mn8;
        u32 pa[2][2];  // [si][row half]: f16x2 of P
        float ps0 = 0.f, ps8 = 0.f;
#pragma unroll
        for (int si = 0; si < 2; ++si) {
            pa[si][0] = p_h2(sc[si][0], sc[si][1], mn0, ps0);
            pa[si][1] = p_h2(sc[si][2], sc[si][3], mn8, ps8);
        }
        l0 = f_fma(l0, al0, ps0);
        l8 = f_fma(l8, al8, ps8);
        // ---- mask V past the end (cache contents there are arbitrary) ----
        if (p0 + 16 > end) {
            const int pb = p0 + 4 * tq;
#pragma unroll
            for (int dt = 0; dt < NDT; ++dt) {
                if (pb + 0 >= end) vv[dt].x &= 0xffff0000u;
                if (pb + 1 >= end) vv[dt].x &= 0x0000ffffu;
                if (pb + 2 >= end) vv[dt].y &= 0xffff0000u;
                if (pb + 3 >= end) vv[dt].y &= 0x0000ffffu;
            }
        }
        // where no lane's maximum moved every factor is exactly 1 and the products would be the accumulators
        // themselves: skipped (most tiles at long context), the same bits
        if (__any_sync(0xffffffffu, al0 != 1.f || al8 != 1.f)) {
            if (G16) {
#pragma unroll
                for (int dt = 0; dt < NDT; ++dt) rescale_c(o[dt], al0, al8);
            } else {  // columns are heads 2 tq, 2 tq + 1: their factors from those heads' quads
                const float a = __shfl_sync(0xffffffffu, al0, 8 * tq), b = __shfl_sync(0xffffffffu, al0, 8 * tq + 4);
#pragma unroll
                for (int j = 0; j < NO; ++j) {
                    o[j][0] = f_mul(o[j][0], a);
                    o[j][1] = f_mul(o[j][1], b);
                    o[j][2] = f_mul(o[j][2], a);
                    o[j][3] = f_mul(o[j][3], b);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            if (G16)
                mma16816(o[j], pa[0][0], pa[0][1], pa[1][0], pa[1][1], vv[j].x, vv[j].y);
            else  // A = V^T rows 16 j + g, + 8 (the loads of dim tiles 2 j, 2 j + 1), B = P^T of head g
                mma16816(o[j], vv[2 * j].x, vv[2 * j + 1].x, vv[2 * j].y, vv[2 * j + 1].y, pa[0][0], pa[1][0]);
        }
    };

    uint4 kv[2][NJ];
    uint2 vv[NDT];
    if (PIPE && w < ntile) load_tile(w, kv, vv);
    for (int it = w; it < ntile; it += 4) {
        uint4 kn[2][NJ];
        uint2 vn[NDT];
        if (PIPE) {
            if (it + 4 < ntile) load_tile(it + 4, kn, vn);  // next tile in flight while this one computes
        } else {
            load_tile(it, kv, vv);
        }
        compute_tile(start + 16 * it, kv, vv);
        if (PIPE) {
#pragma unroll
            for (int si = 0; si < 2; ++si)
#pragma unroll
                for (int j = 0; j < NJ; ++j) kv[si][j] = kn[si][j];
#pragma unroll
            for (int dt = 0; dt < NDT; ++dt) vv[dt] = vn[dt];
        }
    }
    // ---- merge the 4 warps ----
    l0 = f_add(l0, __shfl_xor_sync(0xffffffffu, l0, 1));
    l0 = f_add(l0, __shfl_xor_sync(0xffffffffu, l0, 2));
    l8 = f_add(l8, __shfl_xor_sync(0xffffffffu, l8, 1));
    l8 = f_add(l8, __shfl_xor_sync(0xffffffffu, l8, 2));
#pragma unroll
    for (int j = 0; j < NO; ++j) {
        if (G16) {
            sm_o[w][g][j * 8 + 2 * tq] = o[j][0];
            sm_o[w][g][j * 8 + 2 * tq + 1] = o[j][1];
            sm_o[w][(g + 8) % ROWS][j * 8 + 2 * tq] = o[j][2];
            sm_o[w][(g + 8) % ROWS][j * 8 + 2 * tq + 1] = o[j][3];
        } else {
            sm_o[w][2 * tq][16 * j + g] = o[j][0];
            sm_o[w][2 * tq + 1][16 * j + g] = o[j][1];
            sm_o[w][2 * tq][16 * j + g + 8] = o[j][2];
            sm_o[w][2 * tq + 1][16 * j + g + 8] = o[j][3];
        }
    }
    if (tq == 0) {
        sm_m[w][g] = m0;
        sm_l[w][g] = l0;
        if (G16) {
            sm_m[w][(g + 8) % ROWS] = m8;
            sm_l[w][(g + 8) % ROWS] = l8;
        }
    }
    __syncthreads();
    const i64 pbase = (((i64)t * n_kv + kvh) * nsplit + s) * group;
    for (int idx = threadIdx.x; idx < group * HD; idx += blockDim.x) {
        const int h = idx / HD, d = idx % HD;
        float M = sm_m[0][h];
#pragma unroll
        for (int ww = 1; ww < 4; ++ww) M = fmaxf(M, sm_m[ww][h]);
        float acc = 0.f, lsum = 0.f;
#pragma unroll
        for (int ww = 0; ww < 4; ++ww) {
            const float f = f_ex2(f_sub(sm_m[ww][h], M));
            acc = f_fma(f, sm_o[ww][h][d], acc);
            lsum = f_fma(f, sm_l[ww][h], lsum);
        }
        part_o[(pbase + h) * HD + d] = acc;
        if (d == 0) {
            part_ml[(pbase + h) * 2] = M;
            part_ml[(pbase + h) * 2 + 1] = lsum;
        }
    }
}

#define ATTN_INST(HD, G16, PIPE, NAME)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                       \
        const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,                     \
        const int* __restrict__ pos_p, int n_head, int n_kv, int max_ctx, int nsplit, int chunk_min,             \
        float scale_log2, float* __restrict__ part_o, float* __restrict__ part_ml) { PDL_ENTRY();                \
        attn_split_body<HD, G16, PIPE, false>(q, kc, vc, pos_p, n_head, n_kv, max_ctx, nsplit, chunk_min,         \
                                              scale_log2, part_o, part_ml, AttnQkv{});                            \
    }
// the decode step's variant (T = 1) that also does qk_norm_rope_kv's work: q from the raw qkv row, K / V appended
#define ATTN_QKV_INST(HD, G16, PIPE, NAME)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                       \
        const float* __restrict__ qkv, const float* __restrict__ qnw, const float* __restrict__ knw, float eps,  \
        const float* __restrict__ cos_t, const float* __restrict__ sin_t, u16* kc, u16* vc,                      \
        const int* __restrict__ pos_p, int n_head, int n_kv, int max_ctx, int nsplit, int chunk_min,             \
        float scale_log2, float* __restrict__ part_o, float* __restrict__ part_ml) {                             \
        attn_split_body<HD, G16, PIPE, true>(nullptr, kc, vc, pos_p, n_head, n_kv, max_ctx, nsplit,              \
                                                   chunk_min, scale_log2, part_o, part_ml,                        \
                                                   AttnQkv{qkv, qnw, knw, eps, cos_t, sin_t});                    \
    }
// every kernel of a family at the four head shapes: INST(HD, G16, <the family's flags>, attn_split_hd{HD}_g{8,16}SUF)
#define ATTN_SHAPES(INST, SUF, ...)                                                                               \
    INST(64, false, __VA_ARGS__, attn_split_hd64_g8##SUF)                                                         \
    INST(64, true, __VA_ARGS__, attn_split_hd64_g16##SUF)                                                         \
    INST(128, false, __VA_ARGS__, attn_split_hd128_g8##SUF)                                                       \
    INST(128, true, __VA_ARGS__, attn_split_hd128_g16##SUF)
ATTN_SHAPES(ATTN_INST, , false)
ATTN_SHAPES(ATTN_INST, _pipe, true)
ATTN_SHAPES(ATTN_QKV_INST, _qkv, true)
ATTN_SHAPES(ATTN_QKV_INST, _qkv_plain, false)

// combine the splits in one pass: grid (n_head, T, hd / (4 * cols)), block = 128 threads; out (T, n_head, hd) f32.
// A block takes `cols` float4 columns of one head (every block of the head weighs the splits the same way); thread = (split
// group, column): 128 / cols groups stride over the splits, 4 loads in flight each, then summed in group order.
// More blocks a head (fewer columns each) make the chains over the splits shorter: at 32K a head's 264 splits were
// 66 loads a thread deep with all 32 columns in one block.
// Each thread keeps a running maximum of its splits and rescales its sums as it goes, so that the maxima, sums and
// partial outputs are loaded together: one dependent round trip after the wait (the weights are products of ex2
// factors).
extern "C" __global__ void __launch_bounds__(128) attn_combine(const float* __restrict__ part_o,
                                                               const float* __restrict__ part_ml,
                                                               const int* __restrict__ pos_p, int n_head,
                                                               int n_kv, int hd, int max_ctx, int nsplit,
                                                               int chunk_min, int cols, float* __restrict__ out,
                                                               signed char* __restrict__ oq,
                                                               float* __restrict__ od) {
    // oq, od (T = 1, cols a multiple of 8; or null): the output row also quantised to 8 bits a value in groups of
    // 32 (canonical.quantize_act), for the o mat-vec on 8-bit x (matvec qx)
    __shared__ float4 accs[128];
    __shared__ float2 mls[128];
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    const int group = n_head / n_kv, kvh = h / group, hj = h % group;
    int len = min(pos_then_wait(pos_p) + t + 1, max_ctx);
    int chunk, nact;
    attn_split_geom(len, nsplit, chunk_min, chunk, nact);
    const i64 base = ((i64)t * n_kv + kvh) * nsplit * group + hj;  // + s * group
    const int V4 = cols, SG = blockDim.x / V4, c0 = blockIdx.z * cols;
    const int c = tid % V4, sg = tid / V4;
    const float* po = part_o + base * hd + 4 * (c0 + c);
    const float* pm = part_ml + base * 2;
    const i64 step = (i64)group * hd, mstep = (i64)group * 2;
    float M = NEG_INF, L = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [&](float2 ml, float4 v) {  // this split into the running (M, L, a)
        const float Mn = fmaxf(M, ml.x);
        const float r = f_ex2(f_sub(M, Mn)), f = f_ex2(f_sub(ml.x, Mn));
        M = Mn;
        L = f_fma(f, ml.y, f_mul(r, L));
        a.x = f_fma(f, v.x, f_mul(r, a.x)); a.y = f_fma(f, v.y, f_mul(r, a.y));
        a.z = f_fma(f, v.z, f_mul(r, a.z)); a.w = f_fma(f, v.w, f_mul(r, a.w));
    };
    int s = sg;
    for (; s + 3 * SG < nact; s += 4 * SG) {  // 4 splits' loads in flight
        float2 ml[4];
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            ml[u] = *(const float2*)(pm + (s + u * SG) * mstep);
            v[u] = *(const float4*)(po + (s + u * SG) * step);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) add(ml[u], v[u]);
    }
    for (; s < nact; s += SG) add(*(const float2*)(pm + s * mstep), *(const float4*)(po + s * step));
    accs[tid] = a;
    mls[tid] = make_float2(M, L);
    __syncthreads();
    if (tid < V4) {  // the split groups in order
        float Mx = mls[tid].x;
        for (int k = 1; k < SG; ++k) Mx = fmaxf(Mx, mls[k * V4 + tid].x);
        float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
        float Ls = 0.f;
        for (int k = 0; k < SG; ++k) {
            const float2 ml = mls[k * V4 + tid];
            const float4 u = accs[k * V4 + tid];
            const float f = f_ex2(f_sub(ml.x, Mx));  // a group without splits: M = -inf, f = 0 (its sums are 0)
            Ls = f_fma(f, ml.y, Ls);
            r.x = f_fma(f, u.x, r.x); r.y = f_fma(f, u.y, r.y); r.z = f_fma(f, u.z, r.z); r.w = f_fma(f, u.w, r.w);
        }
        const float inv = f_div(1.f, Ls);
        const float4 o = make_float4(f_mul(r.x, inv), f_mul(r.y, inv), f_mul(r.z, inv), f_mul(r.w, inv));
        const i64 at = ((i64)t * n_head + h) * hd + 4 * (c0 + tid);
        *(float4*)(out + at) = o;
        if (oq != nullptr) {  // eight threads a group of 32 values
            const u32 mask = V4 >= 32 ? 0xffffffffu : (1u << V4) - 1u;
            float m = f_max(f_max(f_abs(o.x), f_abs(o.y)), f_max(f_abs(o.z), f_abs(o.w)));
#pragma unroll
            for (int k = 4; k; k >>= 1) m = f_max(m, __shfl_xor_sync(mask, m, k));
            const float dd = quant_scale(m), qi = quant_inv(dd);
            *(char4*)(oq + at) = make_char4(quant_code(o.x, qi), quant_code(o.y, qi), quant_code(o.z, qi),
                                            quant_code(o.w, qi));
            if ((tid & 7) == 0) od[at >> 5] = dd;
        }
    }
}
