// Mat-vecs over GGUF rows (a decode step's projections and LM head) and the RMSNorm folded into them.
#include "common.cuh"
#include "decode.cuh"
#include "dense_common.cuh"
#include "norm.cuh"
#include "matvec.cuh"

// the packed formats of the quantised types without a fast path of their own (weights.RQ_FORMATS), and the types
// read as the file holds them (decode.cuh RQ_PART_TYPES)
typedef RqBlk<1, 0> Rq10;
typedef RqBlk<1, 1> Rq11;
typedef RqBlk<2, 0> Rq20;
typedef RqBlk<2, 2> Rq22;
#define FILE_BLK_TYPEDEF(name, code) typedef FileBlk<code> Fb_##name;
RQ_PART_TYPES(FILE_BLK_TYPEDEF)

// Block rows (format F): x staged in shared memory where it fits beside the smaller ring, else read from global
// memory (and on 8-bit x, QX: formats without a minimum). tab: decode.cuh's table blob (the IQ grids).
#define MV_BLK_INST(NAME, F, R, KS, QX)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 3) NAME(const u8* __restrict__ W, int rows, int ncu,          \
                                                              i64 row_bytes, const float* __restrict__ x,        \
                                                              const float* res, float* y,                        \
                                                              const u8* __restrict__ tab) {                      \
        extern __shared__ __align__(16) u8 mv_smem[];                                                             \
        if (!QX && R <= 2 && ncu * 32 <= NORM_MV_MAX_N) {                                                         \
            float* xs = (float*)mv_smem;  /* x staged once: the tile steps read it from shared memory */          \
            matvec_blk_body<F, R, KS, F::NORM_RING, true, false>(                                                 \
                W, rows, ncu, row_bytes, tab, xs, res, y, mv_smem + 4 * NORM_MV_MAX_N, blockIdx.x, [&] {         \
                    PDL_ENTRY();                                                                                  \
                    stage_row(x, ncu * 32, xs);                                                                   \
                    __syncthreads();                                                                              \
                });                                                                                               \
        } else                                                                                                    \
            matvec_blk_body<F, R, KS, F::RING, false, QX>(W, rows, ncu, row_bytes, tab, x, res, y, mv_smem,       \
                                                          blockIdx.x, [] { PDL_ENTRY(); });                       \
    }
#define MV_FLOAT_INST(NAME, QT, R, KS, QX)                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(const u8* __restrict__ W, int rows, int ncu,          \
                                                           i64 row_bytes, const float* __restrict__ x,           \
                                                           const float* res, float* y, const u8* __restrict__) {  \
        matvec_float_body<QT, R, KS, false>(W, rows, ncu, row_bytes, x, res, y, [] { PDL_ENTRY(); });            \
    }
#define MV_PLANS(INST, QN, F, QX)                                                                             \
    INST(matvec_##QN##_r4_k1, F, 4, 1, QX)                                                                    \
    INST(matvec_##QN##_r2_k1, F, 2, 1, QX)                                                                    \
    INST(matvec_##QN##_r1_k1, F, 1, 1, QX)                                                                    \
    INST(matvec_##QN##_r1_k2, F, 1, 2, QX)                                                                    \
    INST(matvec_##QN##_r1_k4, F, 1, 4, QX)                                                                    \
    INST(matvec_##QN##_r1_k8, F, 1, 8, QX)                                                                    \
    INST(matvec_##QN##_r4_k2, F, 4, 2, QX)                                                                    \
    INST(matvec_##QN##_r4_k4, F, 4, 4, QX)                                                                    \
    INST(matvec_##QN##_r2_k2, F, 2, 2, QX)                                                                    \
    INST(matvec_##QN##_r2_k4, F, 2, 4, QX)
MV_PLANS(MV_BLK_INST, q8_0, Q8Blk, false)
MV_PLANS(MV_BLK_INST, q8_0x, Q8Blk, true)  // Q8_0 on x quantised to 8 bits (dp4a; the attention combine's out_q)
MV_PLANS(MV_BLK_INST, rq10, Rq10, false)
MV_PLANS(MV_BLK_INST, rq10x, Rq10, true)  // on 8-bit x: an IQ3_S o projection packed (weights.DenseWeight.to_packed)
MV_PLANS(MV_BLK_INST, rq11, Rq11, false)
MV_PLANS(MV_BLK_INST, rq20, Rq20, false)
MV_PLANS(MV_BLK_INST, rq22, Rq22, false)
#define MV_FILE_PLANS(name, code) MV_PLANS(MV_BLK_INST, name, Fb_##name, false)
RQ_PART_TYPES(MV_FILE_PLANS)
MV_PLANS(MV_BLK_INST, iq3_sx, Fb_iq3_s, true)  // on 8-bit x (the o projection of llama.cpp's IQ3 mixes)
MV_PLANS(MV_FLOAT_INST, f16, QT_F16, false)
MV_PLANS(MV_FLOAT_INST, bf16, QT_BF16, false)
MV_PLANS(MV_FLOAT_INST, f32, QT_F32, false)

// A quantised matrix's rows packed once at upload (weights.DenseWeight): sub-block s of each row as decode.cuh's
// rq_pack writes it in format (ns, nm), a thread a sub-block
#define PACK_INST(name, code)                                                                                  \
    extern "C" __global__ void pack_rows_##name(const u8* __restrict__ W, int rows, int nsub, i64 row_bytes,     \
                                                const u8* __restrict__ tab, int ns, int nm, u8* __restrict__ out) { \
        const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;                                                 \
        if (i >= (i64)rows * nsub) return;                                                                        \
        const i64 r = i / nsub;                                                                                   \
        const int s = (int)(i % nsub);                                                                            \
        rq_pack<code>(W + r * row_bytes, s, tab, ns, nm, out + i * (32 + 4 * (ns + nm)));                          \
    }
DQ_QUANT_TYPES(PACK_INST)

// Every type through decode.cuh (the types without a fast path above, and rows the fast paths cannot take): a warp
// owns R rows, KS warps split a row group's spans (32 values of a quantised type, one value of a float type;
// lanes round-robin over them). A lane decodes its span of each row to floats and adds the 32 (1) products to the
// row's sum in a fixed order, so the sums do not depend on the launch: x must be 16-byte aligned.
template <int QT, int R, int KS>
__device__ __forceinline__ void matvec_dq_body(const u8* __restrict__ W, int rows, int nspan, i64 row_bytes,
                                               const u8* __restrict__ tab, const float* __restrict__ x,
                                               const float* res, float* y) {
    typedef DqSpan<QT> S;
    PDL_ENTRY();
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int rg = blockIdx.x * (MV_WARPS / KS) + w / KS;
    const int ks = w % KS;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int s = ks * 32 + lane; s < nspan; s += 32 * KS) {
        float xv[S::SPAN];
        if (S::SPAN == 32) {
#pragma unroll
            for (int k = 0; k < S::SPAN / 4; ++k) {
                const float4 t = __ldg((const float4*)(x + (i64)s * S::SPAN) + k);
                xv[4 * k] = t.x, xv[4 * k + 1] = t.y, xv[4 * k + 2] = t.z, xv[4 * k + 3] = t.w;
            }
        } else {
            xv[0] = __ldg(x + s);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = rg * R + r;
            if (row < rows) {
                float v[S::SPAN];
                S::decode(W + (i64)row * row_bytes, s, tab, v);
                float a = 0.f;
#pragma unroll
                for (int i = 0; i < S::SPAN; ++i) a = f_fma(v[i], xv[i], a);
                acc[r] = f_add(acc[r], a);
            }
        }
    }
    mv_finish<R, KS>(acc, rg, rows, res, y);
}

#define MV_DQ_INST(NAME, QT, R, KS)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) NAME(const u8* __restrict__ W, int rows, int nspan,        \
                                                           i64 row_bytes, const u8* __restrict__ tab,            \
                                                           const float* __restrict__ x, const float* res,        \
                                                           float* y) {                                           \
        matvec_dq_body<QT, R, KS>(W, rows, nspan, row_bytes, tab, x, res, y);                                    \
    }
// the plans of weights.DQ_PLANS
#define MV_DQ_PLANS(name, code)                                                                                \
    MV_DQ_INST(matvec_dq_##name##_r2_k1, code, 2, 1)                                                           \
    MV_DQ_INST(matvec_dq_##name##_r1_k1, code, 1, 1)                                                           \
    MV_DQ_INST(matvec_dq_##name##_r1_k2, code, 1, 2)                                                           \
    MV_DQ_INST(matvec_dq_##name##_r1_k4, code, 1, 4)                                                           \
    MV_DQ_INST(matvec_dq_##name##_r1_k8, code, 1, 8)
DQ_ALL_TYPES(MV_DQ_PLANS)

// =============================================================================================================
// RMSNorm folded into the mat-vec that reads it (a decode step's attention and FFN norms; one launch less
// each). Every block stages the raw row x (n <= NORM_MV_MAX_N) in shared memory, computes its rms with row_rms and
// normalises it there with rms_norm_rows' expressions (the same bits), then runs the mat-vec on it. With q, the
// blocks also write the row's quantisation for the experts (group g by block g % gridDim.x, warp by warp). The
// Q8_0 kernels keep 6 ring tiles a warp (not 8) so that three blocks still fit an SM beside the 16 KB of x.
// Launch with block rows (Q8_0, packed): norm_mv_smem(F) bytes of dynamic shared memory, float types:
// 4 * NORM_MV_MAX_N.
// =============================================================================================================

// The norm's weights are copied into xs with cp.async before the PDL wait (ptxas keeps cp.async ahead of
// griddepcontrol.wait but sinks plain loads past it, SASS of the NVRTC build), then x is loaded after the wait;
// each thread reads its own float4s of w back and writes x over them, so no barrier is needed between the two.
__device__ __forceinline__ void norm_stage(const float* __restrict__ x, const float* __restrict__ w, int n, int L,
                                           int NL, float eps, float* xs, signed char* __restrict__ q,
                                           float* __restrict__ d) {
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    const u32 xs_addr = smem_addr(xs);
#pragma unroll
    for (int k = 0; k < STAGE_V4; ++k) {
        const int i = tid + MV_WARPS * 32 * k;
        if (4 * i < n) cp_async16(xs_addr + 16 * i, w + 4 * i);
    }
    cp_commit();
    PDL_ENTRY();
    float4 xv[STAGE_V4], wv[STAGE_V4];
#pragma unroll
    for (int k = 0; k < STAGE_V4; ++k) {
        const int i = tid + MV_WARPS * 32 * k;
        if (4 * i < n) xv[k] = __ldg((const float4*)x + i);
    }
    cp_wait<0>();  // this thread's copies of w (and any ring tiles issued before: they were in flight as long)
#pragma unroll
    for (int k = 0; k < STAGE_V4; ++k) {
        const int i = tid + MV_WARPS * 32 * k;
        if (4 * i < n) {
            wv[k] = ((const float4*)xs)[i];
            ((float4*)xs)[i] = xv[k];
        }
    }
    __syncthreads();
    const float s = row_rms(xs, n, L, NL, eps);
#pragma unroll
    for (int k = 0; k < STAGE_V4; ++k) {
        const int i = tid + MV_WARPS * 32 * k;
        if (4 * i < n) {
            float4 a = ((float4*)xs)[i];
            a.x = f_mul(f_div(a.x, s), wv[k].x);
            a.y = f_mul(f_div(a.y, s), wv[k].y);
            a.z = f_mul(f_div(a.z, s), wv[k].z);
            a.w = f_mul(f_div(a.w, s), wv[k].w);
            ((float4*)xs)[i] = a;
        }
    }
    __syncthreads();
    if (q != nullptr)
        for (int g = blockIdx.x + gridDim.x * wid; g < (n >> 5); g += gridDim.x * nw)  // warp-uniform
            quant32(xs[g * 32 + lane], lane, q + (i64)g * 32, d + g);
}

#define NORM_MV_HEAD(NAME, LB, ...)                                                                           \
    extern "C" __global__ void __launch_bounds__(256, LB) NAME(                                                   \
        const u8* __restrict__ W, int rows, int ncu, i64 row_bytes, const float* __restrict__ x,                 \
        const float* res, float* y, const float* __restrict__ nw, int n, int L, int NL, float eps,               \
        signed char* __restrict__ q, float* __restrict__ d, const u8* __restrict__ tab __VA_ARGS__) {            \
        extern __shared__ __align__(16) u8 mv_smem[];                                                             \
        float* xs = (float*)mv_smem;                                                                              \
        auto wait = [&] { norm_stage(x, nw, n, L, NL, eps, xs, q, d); };
#define NORM_MV_BLK_INST(NAME, F, R, KS)                                                                      \
    NORM_MV_HEAD(NAME, 3, )                                                                                   \
    matvec_blk_body<F, R, KS, F::NORM_RING, true, false>(W, rows, ncu, row_bytes, tab, xs, res, y,               \
                                                         mv_smem + 4 * NORM_MV_MAX_N, blockIdx.x, wait);         \
    }
#define NORM_MV_FLOAT_INST(NAME, QT, R, KS)                                                                   \
    NORM_MV_HEAD(NAME, 1, )                                                                                   \
    matvec_float_body<QT, R, KS, true>(W, rows, ncu, row_bytes, xs, res, y, wait);                               \
    }
// Two matrices of one width and two file types in one launch (a llama.cpp mix's q and k, then its attn_v of
// another type): the first nblk blocks run the first (W, rows rows), the rest the second (W2, rows2 rows) into
// the rows after it; every block stages the normalised row.
#define NORM_MV_PAIR_INST(NAME, FA, FB, R, KS)                                                                \
    NORM_MV_HEAD(NAME, 3, , const u8* __restrict__ W2, int rows2, i64 row_bytes2, int nblk)                   \
    u8* ring = mv_smem + 4 * NORM_MV_MAX_N;                                                                   \
    if ((int)blockIdx.x < nblk)                                                                               \
        matvec_blk_body<FA, R, KS, FA::NORM_RING, true, false>(W, rows, ncu, row_bytes, tab, xs, res, y, ring,  \
                                                               blockIdx.x, wait);                              \
    else                                                                                                      \
        matvec_blk_body<FB, R, KS, FB::NORM_RING, true, false>(W2, rows2, ncu, row_bytes2, tab, xs,            \
                                                               res ? res + rows : res, y + rows, ring,         \
                                                               blockIdx.x - nblk, wait);                       \
    }
#define NORM_MV_PLANS(INST, QN, F)                                                                            \
    INST(norm_matvec_##QN##_r2_k1, F, 2, 1)                                                                   \
    INST(norm_matvec_##QN##_r1_k1, F, 1, 1)                                                                   \
    INST(norm_matvec_##QN##_r1_k2, F, 1, 2)                                                                   \
    INST(norm_matvec_##QN##_r1_k4, F, 1, 4)                                                                   \
    INST(norm_matvec_##QN##_r1_k8, F, 1, 8)                                                                   \
    INST(norm_matvec_##QN##_r2_k2, F, 2, 2)                                                                   \
    INST(norm_matvec_##QN##_r2_k4, F, 2, 4)
NORM_MV_PLANS(NORM_MV_BLK_INST, q8_0, Q8Blk)
NORM_MV_PLANS(NORM_MV_BLK_INST, rq10, Rq10)
NORM_MV_PLANS(NORM_MV_BLK_INST, rq11, Rq11)
NORM_MV_PLANS(NORM_MV_BLK_INST, rq20, Rq20)
NORM_MV_PLANS(NORM_MV_BLK_INST, rq22, Rq22)
#define NORM_MV_FILE_PLANS(name, code) NORM_MV_PLANS(NORM_MV_BLK_INST, name, Fb_##name)
RQ_PART_TYPES(NORM_MV_FILE_PLANS)
// the pairs of file types llama.cpp's mixes stack (weights.FILE_PAIRS: IQ3_S q, k with Q4_K v; Q4_K or Q5_K with
// Q6_K): norm_matvec2_<first>_<second>
#define NORM_MV_PAIR(A, B) NORM_MV_PAIR_PLANS(A##_##B, Fb_##A, Fb_##B)
#define NORM_MV_PAIR_PLANS(AB, FA, FB)                                                                       \
    NORM_MV_PAIR_INST(norm_matvec2_##AB##_r2_k1, FA, FB, 2, 1)                                                \
    NORM_MV_PAIR_INST(norm_matvec2_##AB##_r1_k1, FA, FB, 1, 1)                                                \
    NORM_MV_PAIR_INST(norm_matvec2_##AB##_r1_k2, FA, FB, 1, 2)                                                \
    NORM_MV_PAIR_INST(norm_matvec2_##AB##_r2_k2, FA, FB, 2, 2)
NORM_MV_PAIR(iq3_s, q4_k)
NORM_MV_PAIR(q4_k, q6_k)
NORM_MV_PAIR(q5_k, q6_k)
NORM_MV_PLANS(NORM_MV_FLOAT_INST, f16, QT_F16)
NORM_MV_PLANS(NORM_MV_FLOAT_INST, bf16, QT_BF16)
NORM_MV_PLANS(NORM_MV_FLOAT_INST, f32, QT_F32)
