// stratad dense-path GPU kernels (one sequence): mat-vec / batched GEMM over GGUF rows, RMSNorm, fused q/k
// RMSNorm + RoPE + KV append, split-K decode attention + combine, router (softmax -> top-k), argmax, top-k/top-p
// sampling and embedding lookup. Wrappers and numpy references: dense.py beside this file.
//
// All activations are float32. Nothing reads a host-side, data-dependent size: positions / lengths / tokens are
// read from device memory, grids are fixed, so every launch can be captured in a CUDA graph and replayed.
//
// Exactness notes (what is bit-identical to the numpy reference, and why):
//  * rms_norm: numpy's float32 mean is a pairwise sum (8 accumulators over leaves of <= 128 values, leaves
//    combined as a binary tree); we evaluate the same tree (host passes the leaf plan), then /n, +eps, sqrt,
//    x/s, *w are single IEEE operations (explicit .rn PTX) -> bit-identical to reference.rms_norm.
//  * rope: cos/sin come from a host table computed exactly like reference.rope; a*cos - b*sin is two .rn
//    multiplies and one .rn subtract as numpy does -> q after norm+rope is bit-identical.
//  * embed: dequantisation (f16 * int8 in f32 is exact) -> bit-identical to quants.dequantize.
//  * matvec / GEMM / attention / softmax: float32 (or fp16 tensor-core) sums in another order than BLAS/numpy:
//    measured tolerances in docs/perf-notes.md.
//
// GGML type numbers: F32 = 0, F16 = 1, Q8_0 = 8 (34-byte blocks {f16 d, int8 q[32]}), BF16 = 30.

#include "common.cuh"

#define QT_F32 0
#define QT_F16 1
#define QT_Q8_0 8
#define QT_BF16 30


// ---- exact float helpers (explicit rounding; --fmad cannot touch them) --------------------------------------
__device__ __forceinline__ float f_sqrt(float a) { float r; asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a)); return r; }
__device__ __forceinline__ float f_fma(float a, float b, float c) { float r; asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c)); return r; }
__device__ __forceinline__ float f_ex2(float a) { float r; asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(a)); return r; }
__device__ __forceinline__ float h2f(u16 h) { float r; asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h)); return r; }
__device__ __forceinline__ u16 f2h(float f) { u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
__device__ __forceinline__ u16 f2bf(float f) { u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
__device__ __forceinline__ float bf2f(u32 b) { return __int_as_float(b << 16); }
// pack two floats into f16x2: lo in bits 0..15
__device__ __forceinline__ u32 pack_h2(float lo, float hi) { u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r; }
__device__ __forceinline__ u32 shf_r_clamp(u32 lo, u32 hi, u32 sh) { u32 r; asm("shf.r.clamp.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sh)); return r; }

// streaming 16- and 8-byte loads that leave L1 alone (weights and KV, read once): NC on the non-coherent path (data
// no kernel writes meanwhile), else on the coherent one (data the kernel itself may have written: the fused decode
// step's KV append, which the non-coherent path need not see)
template <bool NC = true>
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    if (NC)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    else
        asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
template <bool NC = true>
__device__ __forceinline__ uint2 ld_stream_u2(const void* p) {
    uint2 r;
    if (NC) asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    else asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ void st_shared_v4(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// int8 lane k of word u (already xor 0x80808080) as an exact float: 2^23 + (q + 128) - (2^23 + 128)
#define MAGIC_BIAS 8388736.0f
__device__ __forceinline__ float i8f(u32 u, u32 k) { return f_sub(__int_as_float(prmt(u, 0x4B000000u, 0x7440u + k)), MAGIC_BIAS); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = f_add(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// one element (col) of a row in any dense type (slow paths: fallback mat-vec, GEMM tile loads, embed)
__device__ __forceinline__ float load_elem(int qt, const u8* row, int col) {
    if (qt == QT_Q8_0) {
        const u8* b = row + (col >> 5) * 34;
        u16 d = (u16)b[0] | ((u16)b[1] << 8);
        return f_mul(h2f(d), (float)(signed char)b[2 + (col & 31)]);
    } else if (qt == QT_F16) {
        const u16* p = (const u16*)row;
        return h2f(p[col]);
    } else if (qt == QT_BF16) {
        const u16* p = (const u16*)row;
        return bf2f(p[col]);
    }
    return ((const float*)row)[col];
}

// =============================================================================================================
// 1. mat-vec  y[r] = sum_c W[r, c] x[c] (+ res[r])
// Block = 8 warps. A warp owns R rows (its "row group"); KS warps of a block split a row group's K dimension
// (tiles round-robin) and are summed in shared memory in warp order (deterministic). Loads are 16-byte,
// coalesced, several tiles in flight per warp (R * U = 4 row-tiles for Q8_0, 8 for the float types).
// Q8_0 rows (34-byte blocks, 2-byte aligned quants) stream through a per-warp cp.async ring in shared memory
// (tile = 32 blocks = 1088 bytes = 68 x 16 B; 8 row-tiles in flight per warp; launch with Q8_SMEM_BYTES of
// dynamic shared memory), then lane l dots block l of a tile; needs row_bytes % 16 == 0 (cols % 256 == 0).
// Float types read 16-byte chunks straight into registers (tile = 32 lanes * 16 bytes); row_bytes % 16 == 0.
// y and res may alias (in-place residual add).
// =============================================================================================================
#define MV_WARPS 8
#define Q8_TILE_BYTES 1088

// a mat-vec's activation: global (read-only path) or shared memory (XS: the fused RMSNorm's output, section 2b)
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

// A staged Q8_0 block's scale, and the 8 signed weight bytes of lane part `sub` (0-3) as two words: the block
// starts at byte `boff` of the stage, 34-byte blocks are only 2-byte aligned, so the words are funnel-shifted.
__device__ __forceinline__ float q8_staged(const u8* sbv, u32 boff, int sub, u32& qa, u32& qb) {
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

// Q8_0: a warp's items are (its R rows) x (one tile of 32 blocks); P = 8/R items in flight through a cp.async
// ring in (dynamic) shared memory: 8 warps x 8 row-tiles x 1088 bytes = 69632 bytes per block.
// RT row-tiles in flight per warp (Q8_RING_TILES; fewer where x shares the block's shared memory, XS). `wait` runs
// once the first tiles are in flight: it waits for the predecessor (x and res are its output) and may stage x.
#define Q8_RING_TILES 8
#define Q8_SMEM_BYTES (MV_WARPS * Q8_RING_TILES * Q8_TILE_BYTES)
template <int R, int KS, int V, int RT, bool XS, bool QX, class Wait>
__device__ __forceinline__ void matvec_q8_0_body(const u8* __restrict__ W, int rows, int nb, i64 row_bytes,
                                                 const float* x, const float* res, float* y,
                                                 u8* q8_ring, Wait wait) {
    constexpr int P = RT / R;
    static_assert(P >= 1, "a ring tile per row at least");
    static_assert(!QX || (!XS && V == 2), "8-bit x: read from global memory, four lanes a block");
    // QX: x is a row quantised to 8 bits (attn_combine_1p's out_q): nb * 32 int8 codes, then nb float scales
    const signed char* xq = (const signed char*)x;
    const float* xqd = (const float*)(xq + (i64)nb * 32);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int rg = blockIdx.x * (MV_WARPS / KS) + w / KS;
    const int ks = w % KS;
    const int ntiles = (nb + 31) >> 5;
    const int nitems = ks < ntiles ? (ntiles - ks + KS - 1) / KS : 0;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    u8* st = q8_ring + w * (RT * Q8_TILE_BYTES);
    const u32 st_addr = smem_addr(st);

    auto issue = [&](int i) {
        if (i < nitems) {
            const int tile = ks + i * KS;
            const int nch = min(32, nb - tile * 32) * 34 / 16;
            const u32 sb = st_addr + (i % P) * (R * Q8_TILE_BYTES);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = rg * R + r;
                if (row < rows) {
                    const u8* src = W + (i64)row * row_bytes + (i64)tile * Q8_TILE_BYTES;
#pragma unroll
                    for (int c = 0; c < 3; ++c) {
                        const int ch = lane + 32 * c;
                        if (ch < nch) cp_async16(sb + r * Q8_TILE_BYTES + ch * 16, src + ch * 16);
                    }
                }
            }
        }
        cp_commit();  // one group per item, empty past the end, so wait_group counts stay uniform
    };
#pragma unroll
    for (int i = 0; i < P - 1; ++i) issue(i);
    wait();
    for (int i = 0; i < nitems; ++i) {
        issue(i + P - 1);
        cp_wait<P - 1>();
        __syncwarp();
        const int tile = ks + i * KS;
        const int nbt = min(32, nb - tile * 32);
        const u8* sbv = st + (i % P) * (R * Q8_TILE_BYTES);
        if (V == 2) {
            // 4 lanes per block, 8 values each: a warp step covers 8 blocks and its x reads are 1 KB contiguous
            const int bl = lane >> 2, sub = lane & 3;
#pragma unroll
            for (int st4 = 0; st4 < 4; ++st4) {
                const int b = st4 * 8 + bl;
                if (QX && b < nbt) {  // two dp4a: 8 weights by 8 int8 x, exact in int; one float term a lane
                    const int gb = tile * 32 + b;
                    const uint2 xv = __ldg((const uint2*)(xq + (i64)gb * 32 + 8 * sub));
                    const float dx = __ldg(xqd + gb);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        u32 qa, qb;
                        const float d = q8_staged(sbv, r * Q8_TILE_BYTES + 34 * b, sub, qa, qb);
                        int sum = __dp4a((int)qa, (int)xv.x, 0);
                        sum = __dp4a((int)qb, (int)xv.y, sum);
                        acc[r] = f_fma(f_mul(d, dx), (float)sum, acc[r]);
                    }
                } else if (b < nbt) {
                    const float4* xp = (const float4*)(x + ((i64)tile * 32 + b) * 32 + 8 * sub);
                    const float4 x0 = ldx4<XS>(xp), x1 = ldx4<XS>(xp + 1);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        u32 qa, qb;
                        const float d = q8_staged(sbv, r * Q8_TILE_BYTES + 34 * b, sub, qa, qb);
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
                        acc[r] = f_fma(d, f_add(a0, a1), acc[r]);
                    }
                }
            }
        } else if (lane < nbt) {
            const float4* xp = (const float4*)(x + ((i64)tile * 32 + lane) * 32);
            float4 xv[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) xv[j] = ldx4<XS>(xp + j);
            const u8* sb = sbv;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 boff = r * Q8_TILE_BYTES + 34 * lane;
                const u32* wp = (const u32*)(sb + (boff & ~3u));
                const u32 s = boff & 3u;  // 0 or 2
                u32 wd[9];
#pragma unroll
                for (int j = 0; j < 9; ++j) wd[j] = wp[j];
                const float d = h2f((u16)(s ? (wd[0] >> 16) : (wd[0] & 0xffffu)));
                const u32 sh = 8 * (s + 2);
                float a0 = 0.f, a1 = 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const u32 q = shf_r_clamp(wd[j], wd[j + 1], sh) ^ 0x80808080u;
                    const float4 xx = xv[j];
                    a0 = f_fma(xx.x, i8f(q, 0), a0);
                    a1 = f_fma(xx.y, i8f(q, 1), a1);
                    a0 = f_fma(xx.z, i8f(q, 2), a0);
                    a1 = f_fma(xx.w, i8f(q, 3), a1);
                }
                acc[r] = f_fma(d, f_add(a0, a1), acc[r]);
            }
        }
        __syncwarp();  // stage i % P is refilled by the next iteration's issue
    }
    cp_wait<0>();
    mv_finish<R, KS>(acc, rg, rows, res, y);
}

// `wait` (as in the Q8_0 body) comes after the first weights' loads in the source, but ptxas schedules the PDL wait
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

// x staged in shared memory (the fused norm's row, section 2b; the Q8_0 mat-vecs of rows up to NORM_MV_MAX_N) with
// NORM_MV_RING ring tiles a warp, so that three blocks fit an SM beside it
#define NORM_MV_MAX_N 4096
#define NORM_MV_RING 6
#define NORM_MV_Q8_SMEM (MV_WARPS * NORM_MV_RING * Q8_TILE_BYTES + 4 * NORM_MV_MAX_N)

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
#define MV_INST(NAME, QT, R, KS, QV, QX)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, (QT == QT_Q8_0 ? 3 : 1)) NAME(                              \
        const u8* __restrict__ W, int rows, int ncu, i64 row_bytes, const float* __restrict__ x, const float* res,  \
        float* y) {                                                                                               \
        extern __shared__ __align__(16) u8 mv_smem[];                                                             \
        if (QT == QT_Q8_0 && !QX && R <= 2 && ncu * 32 <= NORM_MV_MAX_N) {                                        \
            float* xs = (float*)mv_smem;  /* x staged once: the tile steps read it from shared memory */          \
            matvec_q8_0_body<R, KS, QV, NORM_MV_RING, true, false>(                                               \
                W, rows, ncu, row_bytes, xs, res, y, mv_smem + 4 * NORM_MV_MAX_N, [&] {                          \
                    PDL_ENTRY();                                                                                  \
                    stage_row(x, ncu * 32, xs);                                                                   \
                    __syncthreads();                                                                              \
                });                                                                                               \
        } else if (QT == QT_Q8_0)                                                                                \
            matvec_q8_0_body<R, KS, QV, Q8_RING_TILES, false, QX>(W, rows, ncu, row_bytes, x, res, y, mv_smem,    \
                                                                  [] { PDL_ENTRY(); });                           \
        else matvec_float_body<QT, R, KS, false>(W, rows, ncu, row_bytes, x, res, y, [] { PDL_ENTRY(); });       \
    }
#define MV_PLANS(QN, QT, QV, QX)                                                                                  \
    MV_INST(matvec_##QN##_r4_k1, QT, 4, 1, QV, QX)                                                                \
    MV_INST(matvec_##QN##_r2_k1, QT, 2, 1, QV, QX)                                                                \
    MV_INST(matvec_##QN##_r1_k1, QT, 1, 1, QV, QX)                                                                \
    MV_INST(matvec_##QN##_r1_k2, QT, 1, 2, QV, QX)                                                                \
    MV_INST(matvec_##QN##_r1_k4, QT, 1, 4, QV, QX)                                                                \
    MV_INST(matvec_##QN##_r1_k8, QT, 1, 8, QV, QX)                                                                \
    MV_INST(matvec_##QN##_r4_k2, QT, 4, 2, QV, QX)                                                                \
    MV_INST(matvec_##QN##_r4_k4, QT, 4, 4, QV, QX)                                                                \
    MV_INST(matvec_##QN##_r2_k2, QT, 2, 2, QV, QX)                                                                \
    MV_INST(matvec_##QN##_r2_k4, QT, 2, 4, QV, QX)
MV_PLANS(q8_0, QT_Q8_0, 2, false)    // Q8_0, 4 lanes per block (coalesced activation reads)
MV_PLANS(q8_0x, QT_Q8_0, 2, true)    // Q8_0 on x quantised to 8 bits (dp4a; the attention combine's out_q)
MV_PLANS(q8_0v1, QT_Q8_0, 1, false)  // Q8_0, one lane per block (the first version)
MV_PLANS(f16, QT_F16, 0, false)
MV_PLANS(bf16, QT_BF16, 0, false)
MV_PLANS(f32, QT_F32, 0, false)

// any shape (unaligned rows, cols not a multiple of the fast paths' granules): one warp per row, scalar loads
extern "C" __global__ void __launch_bounds__(256) matvec_generic(const u8* __restrict__ W, int qt, int rows, int cols,
                                                                 i64 row_bytes, const float* __restrict__ x,
                                                                 const float* res, float* y) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= rows) return;
    const u8* rp = W + (i64)row * row_bytes;
    float a = 0.f;
    for (int c = lane; c < cols; c += 32) a = f_fma(load_elem(qt, rp, c), x[c], a);
    a = warp_sum(a);
    if (lane == 0) y[row] = res ? f_add(a, res[row]) : a;
}

// =============================================================================================================
// 1b. batched: Y[t, r] = sum_c X[t, c] W[r, c] (+ res[t, r]), float32 SIMT GEMM (64 tokens x 64 rows per block,
// K step 32, 4x4 per thread). The accurate path; dense.py also offers cuBLAS on dequantised fp16/bf16/f32 tiles.
// Needs cols % 32 == 0.
// =============================================================================================================
#define GB 64
#define GK 32
extern "C" __global__ void __launch_bounds__(256) gemm_f32(const u8* __restrict__ W, int qt, int rows, int cols,
                                                           i64 row_bytes, const float* __restrict__ X, i64 ldx, int T,
                                                           const float* res, i64 ldr, float* Y, i64 ldy) {
    PDL_ENTRY();
    __shared__ __align__(16) float As[GK][GB + 4];  // X tile, k-major
    __shared__ __align__(16) float Bs[GK][GB + 4];  // W tile, k-major
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int t0 = blockIdx.y * GB, r0 = blockIdx.x * GB;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < cols; k0 += GK) {
        // X tile: 64 tokens x 32 cols = 512 float4, 2 per thread
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int idx = tid + 256 * h, tok = idx >> 3, c4 = idx & 7;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t0 + tok < T) v = *(const float4*)(X + (i64)(t0 + tok) * ldx + k0 + 4 * c4);
            As[4 * c4 + 0][tok] = v.x; As[4 * c4 + 1][tok] = v.y; As[4 * c4 + 2][tok] = v.z; As[4 * c4 + 3][tok] = v.w;
        }
        // W tile: 64 rows x 32 cols, thread = (row, 8 cols)
        {
            const int rr = tid >> 2, p = tid & 3, row = r0 + rr;
            float v[8];
            if (row < rows) {
                const u8* rp = W + (i64)row * row_bytes;
                if (qt == QT_Q8_0) {
                    const u8* b = rp + (k0 >> 5) * 34;
                    const float d = h2f((u16)b[0] | ((u16)b[1] << 8));
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[i] = f_mul(d, (float)(signed char)b[2 + 8 * p + i]);
                } else if (qt == QT_F32) {
                    const float4* fp = (const float4*)(rp + (i64)(k0 + 8 * p) * 4);
                    float4 a = fp[0], c = fp[1];
                    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
                } else {
                    const uint4 q = *(const uint4*)(rp + (i64)(k0 + 8 * p) * 2);
                    const u32 wv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        if (qt == QT_F16) { v[2 * i] = h2f((u16)(wv[i] & 0xffff)); v[2 * i + 1] = h2f((u16)(wv[i] >> 16)); }
                        else { v[2 * i] = __int_as_float(wv[i] << 16); v[2 * i + 1] = __int_as_float(wv[i] & 0xffff0000u); }
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) Bs[8 * p + i][rr] = v[i];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < GK; ++k) {
            const float4 a = *(const float4*)&As[k][ty * 4];
            const float4 b = *(const float4*)&Bs[k][tx * 4];
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = f_fma(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int t = t0 + ty * 4 + i;
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = r0 + tx * 4 + j;
            if (r < rows) Y[(i64)t * ldy + r] = res ? f_add(acc[i][j], res[(i64)t * ldr + r]) : acc[i][j];
        }
    }
}

// dequantise rows to f16 (out_t 1), bf16 (30) or f32 (0); 8 consecutive elements per thread (cols % 8 == 0)
extern "C" __global__ void dequant_rows(const u8* __restrict__ W, int qt, int rows, int cols, i64 row_bytes,
                                        void* out, int out_t) {
    PDL_ENTRY();
    const i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const int gpr = cols >> 3;
    if (g >= (i64)rows * gpr) return;
    const int row = (int)(g / gpr), c0 = (int)(g % gpr) * 8;
    const u8* rp = W + (i64)row * row_bytes;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = load_elem(qt, rp, c0 + i);
    const i64 o = (i64)row * cols + c0;
    if (out_t == QT_F32) {
        float4* op = (float4*)((float*)out + o);
        op[0] = make_float4(v[0], v[1], v[2], v[3]);
        op[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
        u32 h[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            h[i] = out_t == QT_F16 ? pack_h2(v[2 * i], v[2 * i + 1])
                                   : ((u32)f2bf(v[2 * i]) | ((u32)f2bf(v[2 * i + 1]) << 16));
        *(uint4*)((u16*)out + o) = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

// float32 -> f16 / bf16 (n % 2 == 0)
extern "C" __global__ void convert_f32(const float* __restrict__ x, i64 n, void* out, int out_t) {
    PDL_ENTRY();
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (i >= n) return;
    const float a = x[i], b = x[i + 1];
    ((u32*)out)[i >> 1] = out_t == QT_F16 ? pack_h2(a, b) : ((u32)f2bf(a) | ((u32)f2bf(b) << 16));
}

// =============================================================================================================
// 2. RMSNorm, numpy's exact summation tree.
// numpy's float32 add.reduce over a contiguous row of n values (pairwise_sum): n < 8: sequential from 0;
// n <= 128: 8 accumulators r[j] = a[j] + a[j+8] + ... over the first n - n%8 values, then
// ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the n%8 leftovers sequentially; n > 128: split at
// n2 = n/2 - (n/2)%8 and add the two halves' sums. The host passes that tree as NL equal leaves of L values
// (NL a power of two, L <= 128); mode 0 = generic (not numpy's order) for other n.
// =============================================================================================================

// pairwise sum of squares of one leaf of L <= 128 values, by the 8 lanes j0..j0+7 of a warp (j = lane & 7).
// returns the leaf sum in every one of those 8 lanes
__device__ __forceinline__ float leaf_sq_sum(const float* a, int L, int j) {
    if (L < 8) {
        float s = 0.f;
        for (int i = 0; i < L; ++i) s = f_add(s, f_mul(a[i], a[i]));
        return s;
    }
    const int m = L - (L & 7);
    float r = f_mul(a[j], a[j]);
    for (int i = j + 8; i < m; i += 8) r = f_add(r, f_mul(a[i], a[i]));
    r = f_add(r, __shfl_xor_sync(0xffffffffu, r, 1));
    r = f_add(r, __shfl_xor_sync(0xffffffffu, r, 2));
    r = f_add(r, __shfl_xor_sync(0xffffffffu, r, 4));
    for (int i = m; i < L; ++i) r = f_add(r, f_mul(a[i], a[i]));
    return r;
}

// sqrt(mean(x^2) + eps) of the row xr (n values, shared or global memory) in numpy's pairwise order (the plan's NL
// leaves of L values; L = 0: no plan, a block-strided sum), by the whole block (blockDim >= NL * 8, a multiple of
// 32). Every thread returns it; every read of xr is done before the first barrier.
__device__ __forceinline__ float row_rms(const float* xr, int n, int L, int NL, float eps) {
    __shared__ float part[32];
    __shared__ float s_rms;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    float sum;
    if (L > 0) {
        const int leaf = tid >> 3;
        // every lane takes part in the shuffles (leaves past NL compute a copy of the last one, then drop it)
        float s = leaf_sq_sum(xr + (i64)min(leaf, NL - 1) * L, L, lane & 7);
        if (leaf >= NL) s = 0.f;
        // leaves in a warp: lanes 0, 8, 16, 24 -> (l0+l1)+(l2+l3)
        if (NL >= 2) s = f_add(s, __shfl_xor_sync(0xffffffffu, s, 8));
        if (NL >= 4) s = f_add(s, __shfl_xor_sync(0xffffffffu, s, 16));
        const int nwl = (NL + 3) >> 2;  // warps holding leaves
        if (lane == 0 && wid < nwl) part[wid] = s;
        __syncthreads();
        if (wid == 0) {
            float v = lane < nwl ? part[lane] : 0.f;
            for (int o = 1; o < nwl; o <<= 1) {
                const float u = __shfl_xor_sync(0xffffffffu, v, o);
                v = f_add(v, u);
            }
            if (lane == 0) part[0] = v;
        }
        __syncthreads();
        sum = part[0];
    } else {
        float s = 0.f;
        for (int i = tid; i < n; i += blockDim.x) s = f_add(s, f_mul(xr[i], xr[i]));
        s = warp_sum(s);
        if (lane == 0) part[wid] = s;
        __syncthreads();
        if (wid == 0) {
            float v = lane < nw ? part[lane] : 0.f;
            v = warp_sum(v);
            if (lane == 0) part[0] = v;
        }
        __syncthreads();
        sum = part[0];
    }
    if (tid == 0) s_rms = f_sqrt(f_add(f_div(sum, (float)n), eps));
    __syncthreads();
    return s_rms;
}

// rows of x (ldx apart) -> y (ldy apart). blockDim >= max(256, NL*8), multiple of 32. With `staged`, the row is
// first copied with w to dynamic shared memory (8n bytes) by coalesced loads, so the summation chains wait on shared
// memory, not on global latency. With q (n a multiple of 32): each row also quantised for the experts, q (rows, n)
// int8 and d (rows, n / 32) (the launch the experts' quantisation would otherwise take).
extern "C" __global__ void __launch_bounds__(1024) rms_norm_rows(const float* x, i64 ldx, const float* __restrict__ w,
                                                                 float* y, i64 ldy, int n, int L, int NL, float eps,
                                                                 int staged, signed char* __restrict__ q,
                                                                 float* __restrict__ d) {
    PDL_ENTRY();
    extern __shared__ float xs[];
    const float* xg = x + (i64)blockIdx.x * ldx;
    float* yr = y + (i64)blockIdx.x * ldy;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    if (staged) {  // x and w: one round of independent loads
        for (int i = tid; i < n; i += blockDim.x) {
            xs[i] = xg[i];
            xs[n + i] = w[i];
        }
        __syncthreads();
    }
    const float* xr = staged ? xs : xg;
    const float* wr = staged ? xs + n : w;
    const float s = row_rms(xr, n, L, NL, eps);
    if (q == nullptr) {
        for (int i = tid; i < n; i += blockDim.x) yr[i] = f_mul(f_div(xr[i], s), wr[i]);
        return;
    }
    const int G = n >> 5;  // a warp's groups of 32: normalised, written, quantised
    for (int g = wid; g < G; g += nw) {
        const int i = g * 32 + lane;
        const float v = f_mul(f_div(xr[i], s), wr[i]);
        yr[i] = v;
        quant32(v, lane, q + (i64)blockIdx.x * n + i - lane, d + (i64)blockIdx.x * G + g);
    }
}

// =============================================================================================================
// 2b. RMSNorm folded into the mat-vec that reads it (a decode step's attention and FFN norms; one launch less
// each). Every block stages the raw row x (n <= NORM_MV_MAX_N) in shared memory, computes its rms with row_rms and
// normalises it there with rms_norm_rows' expressions (the same bits), then runs the mat-vec on it. With q, the
// blocks also write the row's quantisation for the experts (group g by block g % gridDim.x, warp by warp). The
// Q8_0 kernels keep 6 ring tiles a warp (not 8) so that three blocks still fit an SM beside the 16 KB of x.
// Launch with Q8_0: NORM_MV_Q8_SMEM bytes of dynamic shared memory, float types: 4 * NORM_MV_MAX_N.
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

#define NORM_MV_INST(NAME, QT, R, KS, QV)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, (QT == QT_Q8_0 ? 3 : 1)) NAME(                              \
        const u8* __restrict__ W, int rows, int ncu, i64 row_bytes, const float* __restrict__ x,                 \
        const float* res, float* y, const float* __restrict__ nw, int n, int L, int NL, float eps,               \
        signed char* __restrict__ q, float* __restrict__ d) {                                                    \
        extern __shared__ __align__(16) u8 mv_smem[];                                                             \
        float* xs = (float*)mv_smem;                                                                              \
        auto wait = [&] { norm_stage(x, nw, n, L, NL, eps, xs, q, d); };                                          \
        if (QT == QT_Q8_0)                                                                                       \
            matvec_q8_0_body<R, KS, QV, NORM_MV_RING, true, false>(W, rows, ncu, row_bytes, xs, res, y,          \
                                                                   mv_smem + 4 * NORM_MV_MAX_N, wait);            \
        else                                                                                                      \
            matvec_float_body<QT, R, KS, true>(W, rows, ncu, row_bytes, xs, res, y, wait);                        \
    }
#define NORM_MV_PLANS(QN, QT, QV)                                                                                 \
    NORM_MV_INST(norm_matvec_##QN##_r2_k1, QT, 2, 1, QV)                                                          \
    NORM_MV_INST(norm_matvec_##QN##_r1_k1, QT, 1, 1, QV)                                                          \
    NORM_MV_INST(norm_matvec_##QN##_r1_k2, QT, 1, 2, QV)                                                          \
    NORM_MV_INST(norm_matvec_##QN##_r1_k4, QT, 1, 4, QV)                                                          \
    NORM_MV_INST(norm_matvec_##QN##_r1_k8, QT, 1, 8, QV)                                                          \
    NORM_MV_INST(norm_matvec_##QN##_r2_k2, QT, 2, 2, QV)                                                          \
    NORM_MV_INST(norm_matvec_##QN##_r2_k4, QT, 2, 4, QV)
NORM_MV_PLANS(q8_0, QT_Q8_0, 2)
NORM_MV_PLANS(f16, QT_F16, 0)
NORM_MV_PLANS(bf16, QT_BF16, 0)
NORM_MV_PLANS(f32, QT_F32, 0)

// =============================================================================================================
// 3. fused per-head q/k RMSNorm + NEOX RoPE + KV append, T tokens at positions pos[0] + t.
// qkv: (T, ld) rows = [q (n_head*hd) | k (n_kv*hd) | v (n_kv*hd)]. One warp per (token, head); heads
// [0, n_head) are q (-> q_out (T, n_head, hd) f32), [n_head, n_head+n_kv) k (-> K cache), then v (-> V cache).
// K cache (one layer): (n_kv, max_ctx, hd) f16.  V cache: transposed in blocks of 16 positions, (n_kv, max_ctx / 16,
// hd, 16) f16 (v_at). cos/sin tables: (max_ctx, hd/2) f32. hd <= 256, even.
// =============================================================================================================
// V^T of a 16-position tile is one contiguous hd x 16 piece (4 KB at hd 128), like the tile's K rows: attention
// reads whole lines, not hd pieces of 32 bytes max_ctx apart. max_ctx is a multiple of 16.
__device__ __forceinline__ i64 v_at(int kvh, int hd, int max_ctx, int d, int p) {
    return (((i64)kvh * (max_ctx >> 4) + (p >> 4)) * hd + d) * 16 + (p & 15);
}
__device__ __forceinline__ float head_sq_sum(const float* a, int n, int lane) {
    // numpy pairwise order for n <= 256: one leaf (n <= 128) or two leaves split at n2
    if (n <= 128) return __shfl_sync(0xffffffffu, leaf_sq_sum(a, n, lane & 7), 0);
    int n2 = n >> 1;
    n2 -= n2 & 7;
    const float s0 = leaf_sq_sum(a, n2, lane & 7);
    const float s1 = leaf_sq_sum(a + n2, n - n2, lane & 7);
    return f_add(__shfl_sync(0xffffffffu, s0, 0), __shfl_sync(0xffffffffu, s1, 0));
}

// A lane's norm weights and the position's cos / sin for its pairs i = lane + 32 m < hd / 2 (hd <= 256).
struct HeadRope {
    float wa[4], wb[4], cv[4], sv[4];
};
__device__ __forceinline__ HeadRope head_rope_load(const float* __restrict__ wn, const float* __restrict__ ct,
                                                   const float* __restrict__ stb, int hd, int lane) {
    HeadRope r;
    const int half = hd >> 1;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int i = lane + 32 * m;
        if (i < half) { r.wa[m] = wn[i]; r.wb[m] = wn[i + half]; r.cv[m] = ct[i]; r.sv[m] = stb[i]; }
    }
    return r;
}

// One head's RMSNorm (weights wn) and NEOX RoPE (the position's cos / sin rows ct, stb) by a warp: x (hd <= 256
// values, shared memory) -> emit(i, out[i], out[i + hd / 2]) for each of the lane's pairs i < hd / 2; the weights
// and tables as head_rope_load read them (loaded before the norm, or earlier by the caller).
template <class Emit>
__device__ __forceinline__ void head_norm_rope(const float* x, const HeadRope& r, float eps, int hd, int lane,
                                               Emit emit) {
    const int half = hd >> 1;
    const float sum = head_sq_sum(x, hd, lane);
    const float s = f_sqrt(f_add(f_div(sum, (float)hd), eps));
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int i = lane + 32 * m;
        if (i >= half) break;
        const float a = f_mul(f_div(x[i], s), r.wa[m]);
        const float b = f_mul(f_div(x[i + half], s), r.wb[m]);
        const float c = r.cv[m], sn = r.sv[m];
        emit(i, f_sub(f_mul(a, c), f_mul(b, sn)), f_add(f_mul(b, c), f_mul(a, sn)));
    }
}

extern "C" __global__ void __launch_bounds__(128) qk_norm_rope_kv(
    const float* __restrict__ qkv, i64 ld, int T, const float* __restrict__ qnw, const float* __restrict__ knw,
    float eps, const float* __restrict__ cos_t, const float* __restrict__ sin_t, const int* __restrict__ pos_p,
    float* __restrict__ q_out, u16* __restrict__ kc, u16* __restrict__ vc, int n_head, int n_kv, int hd,
    int max_ctx) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31;
    const int hh = blockIdx.x * 4 + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (hh >= n_head + 2 * n_kv || t >= T) return;
    __shared__ float hs[4][256];
    const float* xg = qkv + (i64)t * ld + (i64)hh * hd;
    float* x = hs[threadIdx.x >> 5];
    for (int d = lane; d < hd; d += 32) x[d] = xg[d];
    const int pos = pos_p[0] + t;
    __syncwarp();
    const int half = hd >> 1;
    if (hh >= n_head + n_kv) {  // v: plain f16 copy into V^T
        if (pos >= max_ctx) return;
        const int kv = hh - n_head - n_kv;
        u16* vo = vc + v_at(kv, hd, max_ctx, 0, pos);  // dim d at vo[16 d]
        for (int d = lane; d < hd; d += 32) vo[16 * d] = f2h(x[d]);
        return;
    }
    const bool is_q = hh < n_head;
    const int pc = min(pos, max_ctx - 1);
    head_norm_rope(x, head_rope_load(is_q ? qnw : knw, cos_t + (i64)pc * half, sin_t + (i64)pc * half, hd, lane),
                   eps, hd, lane,
                   [&](int i, float oa, float ob) {
                       if (is_q) {
                           float* qo = q_out + ((i64)t * n_head + hh) * hd;
                           qo[i] = oa;
                           qo[i + half] = ob;
                       } else if (pos < max_ctx) {
                           u16* ko = kc + ((i64)(hh - n_head) * max_ctx + pos) * hd;
                           ko[i] = f2h(oa);
                           ko[i + half] = f2h(ob);
                       }
                   });
}

// pos[0] += T (end of a captured decode step)
extern "C" __global__ void advance_pos(int* pos, int T) {
    PDL_ENTRY();
    if (threadIdx.x == 0 && blockIdx.x == 0) pos[0] += T;
}

// =============================================================================================================
// 4. decode attention, split-K ("flash decoding") on fp16 tensor cores (mma.m16n8k16, fp32 accumulate).
// Grid (nsplit, n_kv, T), 4 warps per block. Token t attends to positions [0, pos[0] + t] of its kv head.
// chunk = roundup64(max(chunk_min, ceil(len / nsplit))), block s covers [s*chunk, min(len, (s+1)*chunk));
// blocks past ceil(len / chunk) exit. Warp w takes 16-position tiles w, w+4, ... of the block's range.
//  S (heads x 8 positions) = Q (16 head rows: the group's heads, zero-padded) K^T: the k (head-dim) index is
//  permuted identically in Q and K so that each thread loads whole 16-byte chunks of K rows; the positions of
//  the two 8-column S tiles are interleaved so that the S accumulators become the P A-fragments of
//  O (heads x hd) = P V, and each thread's B-fragment of V^T is 4 consecutive positions (8 bytes). With 8 heads a
//  group (half of an A operand padding) O^T = V^T P^T instead: the same V^T loads as A fragments, the first half of
//  the P fragments as B, half the MMAs and accumulators (H200, a3b: 168 -> 137 registers plain, 250 -> 212 fused).
// Online softmax in base 2 (scores * log2(e)/sqrt(hd)), P rounded to f16 and l summed from the rounded values.
// The block merges its 4 warps and writes one partial (m, l, O unnormalised) per (t, kv head, split, head).
// A warp's K / V tiles reach its registers one of three ways, the arithmetic the same: loaded where used (plain),
// the next tile prefetched into registers (PIPE, 246 registers at 16 heads), or through the warp's ring in dynamic
// shared memory, cp.async keeping STAGES - 1 tiles in flight (RING, ~165 registers; AttnRing<G16>::STAGES * 64 * HD
// bytes a warp).
// =============================================================================================================
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// max over the 4 lanes of a quad (the lanes holding one row of an mma C fragment)
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// an mma C fragment's rows rescaled (online softmax): row lane / 4 by a, row lane / 4 + 8 by b
__device__ __forceinline__ void rescale_c(float (&c)[4], float a, float b) {
    c[0] = f_mul(c[0], a);
    c[1] = f_mul(c[1], a);
    c[2] = f_mul(c[2], b);
    c[3] = f_mul(c[3], b);
}

// two probabilities exp2(s - m) rounded to an f16x2 (an mma A-fragment register); sum += the rounded values
__device__ __forceinline__ u32 p_h2(float s0, float s1, float m, float& sum) {
    const u32 h = pack_h2(f_ex2(f_sub(s0, m)), f_ex2(f_sub(s1, m)));
    sum = f_add(sum, f_add(h2f((u16)(h & 0xffff)), h2f((u16)(h >> 16))));
    return h;
}

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

// K / V of one 16-position tile in a warp's shared-memory ring (RING): K rows (16 x HD halfs) with their 16-byte
// chunks permuted by attn_swz(row) so that the fragment loads (rows 2m and 2m + 1 of a quarter-warp, four chunks
// each) hit 32 different banks, then V^T rows (HD x 16 halfs, 32 bytes each: a half-warp's loads are contiguous).
template <int HD>
__device__ __forceinline__ int attn_swz(int r) { return ((r >> 2) | ((r & 1) << 2)) & (HD / 8 - 1); }
template <bool G16> struct AttnRing { static constexpr int STAGES = G16 ? 2 : 3; };  // two blocks an SM either way

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

template <int HD, bool G16, bool PIPE, bool FUSE, bool RING = false>
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
    if (RING) {
        // this warp's tiles w, w + 4, ... through its ring: STAGES - 1 tiles in flight (cp.async, L2 only: the
        // appending block sees its own K / V row) while one computes; no block barrier, the warp owns its ring
        constexpr int ST = AttnRing<G16>::STAGES, STAGE = 32 * HD;  // halfs: K 16 x HD, V^T HD x 16
        extern __shared__ __align__(16) u16 attn_ring[];
        u16* ring = attn_ring + w * ST * STAGE;
        const int nmine = w < ntile ? (ntile - w + 3) >> 2 : 0;
        auto issue = [&](int i) {  // the warp's i-th tile into stage i % ST
            u16* kst = ring + (i % ST) * STAGE;
            u16* vst = kst + 16 * HD;
            const int p0 = start + 16 * (w + 4 * i);
#pragma unroll
            for (int u = 0; u < HD / 16; ++u) {
                const int ci = lane + 32 * u, r = ci / (HD / 8), c = ci % (HD / 8);
                cp_async16(smem_addr(kst + r * HD + (c ^ attn_swz<HD>(r)) * 8), kbase + (i64)(p0 + r) * HD + c * 8);
            }
#pragma unroll
            for (int u = 0; u < HD / 16; ++u) {  // the tile's V^T: one contiguous piece, copied as it is
                const int ci = lane + 32 * u;
                cp_async16(smem_addr(vst + ci * 8), vbase + (i64)(p0 >> 4) * HD * 16 + ci * 8);
            }
        };
#pragma unroll
        for (int i = 0; i < ST - 1; ++i) {
            if (i < nmine) issue(i);
            cp_commit();
        }
        for (int i = 0; i < nmine; ++i) {
            cp_wait<ST - 2>();  // this lane's copies of tile i have landed
            __syncwarp();       // every lane's have, and every lane is done with tile i - 1's stage
            if (i + ST - 1 < nmine) issue(i + ST - 1);
            cp_commit();
            const u16* kst = ring + (i % ST) * STAGE;
            const u16* vst = kst + 16 * HD;
#pragma unroll
            for (int si = 0; si < 2; ++si) {
                const int r = 4 * (g >> 1) + 2 * si + (g & 1);
#pragma unroll
                for (int j = 0; j < NJ; ++j)
                    kv[si][j] = *(const uint4*)(kst + r * HD + ((tq + 4 * j) ^ attn_swz<HD>(r)) * 8);
            }
#pragma unroll
            for (int dt = 0; dt < NDT; ++dt) vv[dt] = *(const uint2*)(vst + (dt * 8 + g) * 16 + 4 * tq);
            compute_tile(start + 16 * (w + 4 * i), kv, vv);
        }
    } else {
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

#define ATTN_INST(HD, G16, PIPE, RING, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                       \
        const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,                     \
        const int* __restrict__ pos_p, int n_head, int n_kv, int max_ctx, int nsplit, int chunk_min,             \
        float scale_log2, float* __restrict__ part_o, float* __restrict__ part_ml) { PDL_ENTRY();                \
        attn_split_body<HD, G16, PIPE, false, RING>(q, kc, vc, pos_p, n_head, n_kv, max_ctx, nsplit, chunk_min,   \
                                                    scale_log2, part_o, part_ml, AttnQkv{});                      \
    }
// the decode step's variant (T = 1) that also does qk_norm_rope_kv's work: q from the raw qkv row, K / V appended
#define ATTN_QKV_INST(HD, G16, PIPE, RING, NAME)                                                                  \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                       \
        const float* __restrict__ qkv, const float* __restrict__ qnw, const float* __restrict__ knw, float eps,  \
        const float* __restrict__ cos_t, const float* __restrict__ sin_t, u16* kc, u16* vc,                      \
        const int* __restrict__ pos_p, int n_head, int n_kv, int max_ctx, int nsplit, int chunk_min,             \
        float scale_log2, float* __restrict__ part_o, float* __restrict__ part_ml) {                             \
        attn_split_body<HD, G16, PIPE, true, RING>(nullptr, kc, vc, pos_p, n_head, n_kv, max_ctx, nsplit,        \
                                                   chunk_min, scale_log2, part_o, part_ml,                        \
                                                   AttnQkv{qkv, qnw, knw, eps, cos_t, sin_t});                    \
    }
// every kernel of a family at the four head shapes: INST(HD, G16, <the family's flags>, attn_split_hd{HD}_g{8,16}SUF)
#define ATTN_SHAPES(INST, SUF, ...)                                                                               \
    INST(64, false, __VA_ARGS__, attn_split_hd64_g8##SUF)                                                         \
    INST(64, true, __VA_ARGS__, attn_split_hd64_g16##SUF)                                                         \
    INST(128, false, __VA_ARGS__, attn_split_hd128_g8##SUF)                                                       \
    INST(128, true, __VA_ARGS__, attn_split_hd128_g16##SUF)
ATTN_SHAPES(ATTN_INST, , false, false)
ATTN_SHAPES(ATTN_INST, _pipe, true, false)
ATTN_SHAPES(ATTN_INST, _ring, false, true)
ATTN_SHAPES(ATTN_QKV_INST, _qkv, true, false)
ATTN_SHAPES(ATTN_QKV_INST, _qkv_plain, false, false)
ATTN_SHAPES(ATTN_QKV_INST, _qkv_ring, false, true)

// combine the splits: grid (n_head, T, hd / (4 * cols)), block = 128 threads; out (T, n_head, hd) f32. A block
// takes `cols` float4 columns of one head (every block of the head weighs the splits the same way); thread = (split
// group, column): 128 / cols groups stride over the splits, 4 loads in flight each, then summed in group order.
// More blocks a head (fewer columns each) make the chains over the splits shorter: at 32K a head's 264 splits were
// 66 loads a thread deep with all 32 columns in one block.
extern "C" __global__ void __launch_bounds__(128) attn_combine(const float* __restrict__ part_o,
                                                               const float* __restrict__ part_ml,
                                                               const int* __restrict__ pos_p, int n_head, int n_kv,
                                                               int hd, int max_ctx, int nsplit, int chunk_min,
                                                               int cols, float* __restrict__ out) {
    extern __shared__ float wts[];  // nsplit
    __shared__ float red[4];
    __shared__ float s_M, s_L;
    __shared__ float4 accs[128];
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int group = n_head / n_kv, kvh = h / group, hj = h % group;
    int len = min(pos_then_wait(pos_p) + t + 1, max_ctx);
    int chunk, nact;
    attn_split_geom(len, nsplit, chunk_min, chunk, nact);
    const i64 base = ((i64)t * n_kv + kvh) * nsplit * group + hj;  // + s * group
    float M = NEG_INF;
    for (int s = tid; s < nact; s += blockDim.x) M = fmaxf(M, part_ml[(base + (i64)s * group) * 2]);
    M = warp_max(M);
    if (lane == 0) red[wid] = M;
    __syncthreads();
    if (tid == 0) s_M = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();
    M = s_M;
    float L = 0.f;
    for (int s = tid; s < nact; s += blockDim.x) {
        const float f = f_ex2(f_sub(part_ml[(base + (i64)s * group) * 2], M));
        wts[s] = f;
        L = f_fma(f, part_ml[(base + (i64)s * group) * 2 + 1], L);
    }
    L = warp_sum(L);
    __syncthreads();
    if (lane == 0) red[wid] = L;
    __syncthreads();
    if (tid == 0) s_L = f_add(f_add(red[0], red[1]), f_add(red[2], red[3]));
    __syncthreads();
    const float inv = f_div(1.f, s_L);
    const int V4 = cols, SG = blockDim.x / V4, c0 = blockIdx.z * cols;
    const int c = tid % V4, sg = tid / V4;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    const float* po = part_o + base * hd + 4 * (c0 + c);
    const i64 step = (i64)group * hd;
    int s = sg;
    for (; s + 3 * SG < nact; s += 4 * SG) {  // 4 independent loads in flight
        const float4 v0 = *(const float4*)(po + s * step);
        const float4 v1 = *(const float4*)(po + (s + SG) * step);
        const float4 v2 = *(const float4*)(po + (s + 2 * SG) * step);
        const float4 v3 = *(const float4*)(po + (s + 3 * SG) * step);
        const float f0 = wts[s], f1 = wts[s + SG], f2 = wts[s + 2 * SG], f3 = wts[s + 3 * SG];
        a0 = f_fma(f0, v0.x, a0); a1 = f_fma(f0, v0.y, a1); a2 = f_fma(f0, v0.z, a2); a3 = f_fma(f0, v0.w, a3);
        a0 = f_fma(f1, v1.x, a0); a1 = f_fma(f1, v1.y, a1); a2 = f_fma(f1, v1.z, a2); a3 = f_fma(f1, v1.w, a3);
        a0 = f_fma(f2, v2.x, a0); a1 = f_fma(f2, v2.y, a1); a2 = f_fma(f2, v2.z, a2); a3 = f_fma(f2, v2.w, a3);
        a0 = f_fma(f3, v3.x, a0); a1 = f_fma(f3, v3.y, a1); a2 = f_fma(f3, v3.z, a2); a3 = f_fma(f3, v3.w, a3);
    }
    for (; s < nact; s += SG) {
        const float4 v = *(const float4*)(po + s * step);
        const float f = wts[s];
        a0 = f_fma(f, v.x, a0); a1 = f_fma(f, v.y, a1); a2 = f_fma(f, v.z, a2); a3 = f_fma(f, v.w, a3);
    }
    accs[tid] = make_float4(a0, a1, a2, a3);
    __syncthreads();
    if (tid < V4) {
        float4 r = accs[tid];
        for (int k = 1; k < SG; ++k) {
            const float4 u = accs[k * V4 + tid];
            r.x = f_add(r.x, u.x); r.y = f_add(r.y, u.y); r.z = f_add(r.z, u.z); r.w = f_add(r.w, u.w);
        }
        *(float4*)(out + ((i64)t * n_head + h) * hd + 4 * (c0 + tid)) = make_float4(f_mul(r.x, inv), f_mul(r.y, inv),
                                                                             f_mul(r.z, inv), f_mul(r.w, inv));
    }
}

// combine the splits in one pass: the grid and threads of attn_combine, but each thread keeps a running maximum of
// its splits and rescales its sums as it goes, so that the maxima, sums and partial outputs are loaded together: one
// dependent round trip after the wait instead of attn_combine's three. Other rounding than attn_combine (the weights
// are products of ex2 factors), the same in every mode.
extern "C" __global__ void __launch_bounds__(128) attn_combine_1p(const float* __restrict__ part_o,
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

// combine the splits (first version: thread per dim, 2 loads in flight): grid (n_head, T), block 128
extern "C" __global__ void __launch_bounds__(128) attn_combine_v1(const float* __restrict__ part_o,
                                                               const float* __restrict__ part_ml,
                                                               const int* __restrict__ pos_p, int n_head, int n_kv,
                                                               int hd, int max_ctx, int nsplit, int chunk_min,
                                                               float* __restrict__ out) {
    extern __shared__ float wts[];  // nsplit
    __shared__ float red[4];
    __shared__ float s_M, s_L;
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int group = n_head / n_kv, kvh = h / group, hj = h % group;
    int len = min(pos_then_wait(pos_p) + t + 1, max_ctx);
    int chunk, nact;
    attn_split_geom(len, nsplit, chunk_min, chunk, nact);
    const i64 base = ((i64)t * n_kv + kvh) * nsplit * group + hj;  // + s * group
    float M = NEG_INF;
    for (int s = tid; s < nact; s += blockDim.x) M = fmaxf(M, part_ml[(base + (i64)s * group) * 2]);
    M = warp_max(M);
    if (lane == 0) red[wid] = M;
    __syncthreads();
    if (tid == 0) s_M = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();
    M = s_M;
    float L = 0.f;
    for (int s = tid; s < nact; s += blockDim.x) {
        const float f = f_ex2(f_sub(part_ml[(base + (i64)s * group) * 2], M));
        wts[s] = f;
        L = f_fma(f, part_ml[(base + (i64)s * group) * 2 + 1], L);
    }
    L = warp_sum(L);
    __syncthreads();
    if (lane == 0) red[wid] = L;
    __syncthreads();
    if (tid == 0) s_L = f_add(f_add(red[0], red[1]), f_add(red[2], red[3]));
    __syncthreads();
    const float inv = f_div(1.f, s_L);
    for (int d = tid; d < hd; d += blockDim.x) {
        float a0 = 0.f, a1 = 0.f;
        int s = 0;
        for (; s + 1 < nact; s += 2) {
            a0 = f_fma(wts[s], part_o[(base + (i64)s * group) * hd + d], a0);
            a1 = f_fma(wts[s + 1], part_o[(base + (i64)(s + 1) * group) * hd + d], a1);
        }
        if (s < nact) a0 = f_fma(wts[s], part_o[(base + (i64)s * group) * hd + d], a0);
        out[((i64)t * n_head + h) * hd + d] = f_mul(f_add(a0, a1), inv);
    }
}

// =============================================================================================================
// 5. router: one warp per token (route.cuh)
// =============================================================================================================
#include "route.cuh"

extern "C" __global__ void __launch_bounds__(32) route_topk(const float* __restrict__ logits, i64 ld, int n, int k,
                                                            int* __restrict__ ids, float* __restrict__ wts) {
    PDL_ENTRY();
    __shared__ float e[1024];
    __shared__ float sel[32];
    const int t = blockIdx.x;
    route_warp(logits + (i64)t * ld, n, k, e, sel, threadIdx.x, ids + (i64)t * k, wts + (i64)t * k);
}

// =============================================================================================================
// 6. argmax (np.argmax: first index of the maximum; a NaN counts as the maximum) and top-k / top-p sampling.
// Keys: u64 (order(x) << 32) | (0xffffffff - index), larger = better; order(): -0 -> +0, NaN above +inf.
// =============================================================================================================
__device__ __forceinline__ u64 sort_key(float v, int i) {
    u32 b = __float_as_uint(v);
    if (v != v) b = 0xffffffffu;
    else {
        if (b == 0x80000000u) b = 0;  // -0 == +0
        b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    }
    return ((u64)b << 32) | (u64)(0xffffffffu - (u32)i);
}
__device__ __forceinline__ int key_index(u64 k) { return (int)(0xffffffffu - (u32)(k & 0xffffffffu)); }

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 u = __shfl_xor_sync(0xffffffffu, v, o);
        v = u > v ? u : v;
    }
    return v;
}

// grid NB blocks x 256 threads; the last block to finish reduces the NB partials and resets the counter
extern "C" __global__ void __launch_bounds__(256) argmax_k(const float* __restrict__ x, int n, u64* part,
                                                           u32* counter, int* out) {
    PDL_ENTRY();
    __shared__ u64 red[8];
    __shared__ bool last;
    const int tid = threadIdx.x;
    u64 best = 0;
    for (int i = blockIdx.x * 256 + tid; i < n; i += gridDim.x * 256) {
        const u64 k = sort_key(x[i], i);
        best = k > best ? k : best;
    }
    best = warp_max_u64(best);
    if ((tid & 31) == 0) red[tid >> 5] = best;
    __syncthreads();
    if (tid == 0) {
        u64 b = red[0];
        for (int i = 1; i < 8; ++i) b = red[i] > b ? red[i] : b;
        part[blockIdx.x] = b;
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    u64 b = 0;
    for (int i = tid; i < gridDim.x; i += 256) {
        const u64 v = ((volatile u64*)part)[i];
        b = v > b ? v : b;
    }
    b = warp_max_u64(b);
    if ((tid & 31) == 0) red[tid >> 5] = b;
    __syncthreads();
    if (tid == 0) {
        u64 bb = red[0];
        for (int i = 1; i < 8; ++i) bb = red[i] > bb ? red[i] : bb;
        out[0] = key_index(bb);
        *counter = 0;
    }
}

// bitonic sort (descending) of M (power of two) u64 keys in shared memory by the whole block
__device__ void bitonic_desc(u64* a, int M) {
    for (int size = 2; size <= M; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int i = threadIdx.x; i < (M >> 1); i += blockDim.x) {
                const int lo = 2 * i - (i & (stride - 1));
                const int hi = lo + stride;
                const bool desc = (lo & size) == 0;
                const u64 x = a[lo], y = a[hi];
                if ((x < y) == desc) { a[lo] = y; a[hi] = x; }
            }
        }
    }
    __syncthreads();
}

#define SAMPLE_KMAX 256
#define SAMPLE_CHUNK 4096

// stage 1: block b sorts logits [b*4096, (b+1)*4096) and writes its best 256 keys to cand[b*256 ...]
extern "C" __global__ void __launch_bounds__(1024) topk_stage1(const float* __restrict__ x, int n, u64* cand) {
    PDL_ENTRY();
    __shared__ u64 a[SAMPLE_CHUNK];
    const int b0 = blockIdx.x * SAMPLE_CHUNK;
    for (int i = threadIdx.x; i < SAMPLE_CHUNK; i += blockDim.x) a[i] = b0 + i < n ? sort_key(x[b0 + i], b0 + i) : 0ull;
    bitonic_desc(a, SAMPLE_CHUNK);
    for (int i = threadIdx.x; i < SAMPLE_KMAX; i += blockDim.x) cand[(i64)blockIdx.x * SAMPLE_KMAX + i] = a[i];
}

// stage 2 (one block of 1024): merge the sorted lists, then temperature / top-k / top-p / draw. params (float64):
// [temperature, top_k, top_p, u]. The algorithm (mirrored by dense.sample_ref):
//   K = top_k if 0 < top_k <= 256 else 256 (and <= n); candidates c_0..c_{K-1} = the K largest logits,
//   ties to the lower index, in that order. temperature <= 0: token = c_0 (np.argmax).
//   z_j = (double)logit(c_j) / temperature; e_j = exp(z_j - z_0); S_j = e_0 + ... + e_j (float64).
//   keep = K if top_p >= 1 else 1 + first j with S_j >= top_p * T, T = S_{K-1}, or with no top-k (top_k <= 0 or
//   >= n) the whole vocabulary's sum of exp(logit_i / temperature - z_0) (the host's top-p); token = -1 if the
//   nucleus is wider than the K candidates (S_{K-1} < top_p * T: the host samples);
//   token = c_i, i = first j < keep with S_j > u * S_{keep-1} (i = keep-1 if none).
extern "C" __global__ void __launch_bounds__(1024) topk_sample(const u64* __restrict__ cand, int nb,
                                                               const float* __restrict__ x, int n,
                                                               const double* __restrict__ params,
                                                               int* __restrict__ out) {
    PDL_ENTRY();
    extern __shared__ u64 a[];  // P lists of 256 sorted keys, P = next pow2 >= nb
    __shared__ double S[SAMPLE_KMAX];
    __shared__ double red[1024];
    __shared__ int s_keep, s_pick;
    int P = 1;
    while (P < nb) P <<= 1;
    for (int i = threadIdx.x; i < P * SAMPLE_KMAX; i += blockDim.x) a[i] = i < nb * SAMPLE_KMAX ? cand[i] : 0ull;
    __syncthreads();
    // merge tree: list j <- top 256 of lists j and j + half: c_i = max(A_i, B_255-i) is bitonic and holds them;
    // a descending half-cleaner cascade (strides 128 .. 1) sorts it
    for (int half = P >> 1; half >= 1; half >>= 1) {
        for (int idx = threadIdx.x; idx < half * SAMPLE_KMAX; idx += blockDim.x) {
            const int j = idx / SAMPLE_KMAX, i = idx % SAMPLE_KMAX;
            const u64 A = a[j * SAMPLE_KMAX + i], B = a[(j + half) * SAMPLE_KMAX + SAMPLE_KMAX - 1 - i];
            a[j * SAMPLE_KMAX + i] = A > B ? A : B;
        }
        __syncthreads();
        for (int stride = SAMPLE_KMAX / 2; stride >= 1; stride >>= 1) {
            for (int idx = threadIdx.x; idx < half * (SAMPLE_KMAX / 2); idx += blockDim.x) {
                const int j = idx / (SAMPLE_KMAX / 2), i = idx % (SAMPLE_KMAX / 2);
                const int lo = j * SAMPLE_KMAX + 2 * i - (i & (stride - 1)), hi = lo + stride;
                const u64 x0 = a[lo], x1 = a[hi];
                if (x0 < x1) { a[lo] = x1; a[hi] = x0; }
            }
            __syncthreads();
        }
    }
    const double temp = params[0], topp = params[2], u = params[3];
    const int topk = (int)params[1];
    int K = (topk > 0 && topk <= SAMPLE_KMAX) ? topk : SAMPLE_KMAX;
    K = min(K, n);
    if (!(temp > 0.0)) {
        if (threadIdx.x == 0) out[0] = key_index(a[0]);
        return;
    }
    const int tid = threadIdx.x;
    const double z0 = (double)x[key_index(a[0])] / temp;
    if (tid < K) S[tid] = exp((double)x[key_index(a[tid])] / temp - z0);
    __syncthreads();
    if (tid == 0) {  // sequential prefix sum (np.cumsum order): non-decreasing, so each crossing below is unique
        double acc = 0.0;
        for (int i = 0; i < K; ++i) { acc += S[i]; S[i] = acc; }
        s_keep = K;
        s_pick = -1;
    }
    __syncthreads();
    double total = S[K - 1];
    if (topp < 1.0 && (topk <= 0 || topk >= n)) {  // top-p of the whole vocabulary
        double acc = 0.0;
        for (int i = tid; i < n; i += blockDim.x) acc += exp((double)x[i] / temp - z0);
        red[tid] = acc;
        __syncthreads();
        for (int o = blockDim.x >> 1; o > 0; o >>= 1) {
            if (tid < o) red[tid] += red[tid + o];
            __syncthreads();
        }
        total = red[0];
        if (S[K - 1] < topp * total) {  // block-uniform: the nucleus is wider than the candidates
            if (tid == 0) out[0] = -1;
            return;
        }
    }
    if (topp < 1.0 && tid < K) {
        const double thr = topp * total;
        if (S[tid] >= thr && (tid == 0 || S[tid - 1] < thr)) s_keep = tid + 1;
    }
    __syncthreads();
    const int keep = s_keep;
    const double r = u * S[keep - 1];
    if (tid < keep && S[tid] > r && (tid == 0 || S[tid - 1] <= r)) s_pick = tid;
    __syncthreads();
    if (tid == 0) out[0] = key_index(a[s_pick >= 0 ? s_pick : keep - 1]);
}

// Temperature sampling over the whole vocabulary (no top-k or top-p): the first token whose cumulative probability
// in vocabulary order exceeds u (stratad.engine.sampling.Sampler.pick's inverse CDF), in float64 as the host does it:
// e_i = exp((x_i - max) / temperature), token = first i with e_0 + ... + e_i > u * total. The sums run in another
// order than the host's cumulative sum, so the token is the host's but where u falls within float64 rounding of a
// boundary. cdf_max: grid NB x 256, the maximum of block b's CDF_CHUNK logits. cdf_sample: the same grid, each block's
// sum; the last block to finish finds the block that holds the draw and scans it. params: [temperature, top_k,
// top_p, u] as for topk_sample (only temperature and u are read).
#define CDF_CHUNK 4096
extern "C" __global__ void __launch_bounds__(256) cdf_max(const float* __restrict__ x, int n, float* __restrict__ pmax) {
    PDL_ENTRY();
    __shared__ float red[8];
    const int tid = threadIdx.x, b0 = blockIdx.x * CDF_CHUNK, b1 = min(n, b0 + CDF_CHUNK);
    float m = NEG_INF;
    for (int i = b0 + tid; i < b1; i += 256) m = fmaxf(m, x[i]);
    m = warp_max(m);
    if ((tid & 31) == 0) red[tid >> 5] = m;
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < 8; ++w) m = fmaxf(m, red[w]);
        pmax[blockIdx.x] = fmaxf(m, red[0]);
    }
}

extern "C" __global__ void __launch_bounds__(256) cdf_sample(const float* __restrict__ x, int n,
                                                             const float* __restrict__ pmax,
                                                             const double* __restrict__ params, double* psum,
                                                             u32* counter, int* __restrict__ out) {
    PDL_ENTRY();
    __shared__ double red[256];
    __shared__ bool last;
    __shared__ int s_block, s_pick;
    __shared__ double s_base;
    const int tid = threadIdx.x, nb = gridDim.x;
    float mf = NEG_INF;
    for (int b = 0; b < nb; ++b) mf = fmaxf(mf, pmax[b]);
    const double M = (double)mf, temp = params[0];
    auto e = [&](int i) { return exp(((double)x[i] - M) / temp); };
    {
        const int b0 = blockIdx.x * CDF_CHUNK, b1 = min(n, b0 + CDF_CHUNK);
        double s = 0.0;
        for (int i = b0 + tid; i < b1; i += 256) s += e(i);
        red[tid] = s;
        __syncthreads();
        for (int o = 128; o > 0; o >>= 1) {
            if (tid < o) red[tid] += red[tid + o];
            __syncthreads();
        }
        if (tid == 0) {
            psum[blockIdx.x] = red[0];
            __threadfence();
            last = atomicAdd(counter, 1u) == (u32)nb - 1;
        }
        __syncthreads();
        if (!last) return;
    }
    __threadfence();
    if (tid == 0) {  // the block holding the draw, and the sum before it
        const volatile double* ps = psum;
        double total = 0.0;
        for (int b = 0; b < nb; ++b) total += ps[b];
        const double target = params[3] * total;
        double before = 0.0;
        int j = nb - 1;
        for (int b = 0; b < nb; ++b) {
            if (before + ps[b] > target) { j = b; break; }
            before += ps[b];
        }
        s_block = j;
        s_base = before;
        s_pick = n;  // none found: the last token, as the host's min(searchsorted, n - 1)
        red[0] = target;
        *counter = 0;
    }
    __syncthreads();
    const double target = red[0];
    __syncthreads();
    // block s_block: thread t's 16 consecutive values, then an exclusive scan of the 256 thread sums
    const int b0 = s_block * CDF_CHUNK, per = CDF_CHUNK / 256, i0 = b0 + tid * per;
    double mine = 0.0;
    for (int k = 0; k < per && i0 + k < n; ++k) mine += e(i0 + k);
    red[tid] = mine;
    __syncthreads();
    if (tid == 0) {
        double run = s_base;
        for (int t = 0; t < 256; ++t) {
            const double v = red[t];
            red[t] = run;
            run += v;
        }
    }
    __syncthreads();
    double c = red[tid];
    for (int k = 0; k < per && i0 + k < n; ++k) {
        c += e(i0 + k);
        if (c > target) {
            atomicMin(&s_pick, i0 + k);
            break;
        }
    }
    __syncthreads();
    if (tid == 0) out[0] = min(s_pick, n - 1);
}

// =============================================================================================================
// 7. embedding: out[t] = dequantised row tokens[t] of the table (a bad token id gives a NaN row).
// =============================================================================================================
extern "C" __global__ void __launch_bounds__(256) embed_rows(const u8* __restrict__ table, int qt, int vocab,
                                                             int d, i64 row_bytes, const int* __restrict__ tokens,
                                                             float* __restrict__ out) {
    PDL_ENTRY();
    const int t = blockIdx.x;
    const int tok = tokens[t];
    float* o = out + (i64)t * d;
    if (tok < 0 || tok >= vocab) {
        for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const u8* rp = table + (i64)tok * row_bytes;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = load_elem(qt, rp, i);
}

// =============================================================================================================
// 8. prefill attention (a prompt chunk of T tokens at positions pos0 .. pos0+T-1 over the whole cached prefix):
// the query rows packed per kv head (r = t * group + j: head h * group + j of token t), the flash kernel below, the
// output unpacked (dense.py: PrefillAttention).
// =============================================================================================================
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
// attend to keys 0 .. pos0 + t. A block takes 128 rows (8 warps x 16); keys come in tiles of 64 through shared
// memory (cp.async, one barrier a tile; keys past the chunk read as 0, so a NaN left in the cache cannot reach
// P V). Per warp and tile: S (16 x 64) = Q K^T, the online softmax in base 2 (P rounded to f16, l summed from the
// rounded values, as in the decode kernel), then O (16 x hd) += P V with the S accumulators reused as A fragments.
// The B fragments of K and V^T come from shared memory by ldmatrix.x4 (two n-tiles a load); shared rows are padded
// by 16 bytes so that each 8-row phase of ldmatrix hits 32 different banks.
// Two shapes (FaShape<HD, QS>), the same arithmetic on the same values, so the same bits:
//   QS = false: Q's fragments in registers (182 at hd 128), 3 key-tile stages, one block (8 warps) an SM;
//   QS = true:  the block's Q tile in shared memory, its fragments read by ldmatrix at each use, 2 stages, so
//               that two blocks (16 warps) fit an SM's registers (128 a thread) and shared memory.
// Grid (ceil(R / 128), n_kv), 256 threads, dynamic shared memory FaShape<HD, QS>::SMEM.
// =============================================================================================================
constexpr int FA_BM = 128, FA_BN = 64, FA_THREADS = FA_BM / 16 * 32;

template <int HD, bool QS>
struct FaShape {
    static constexpr int STAGES = QS ? 2 : 3;  // key tiles in flight: the next STAGES - 1 load while one computes
    static constexpr int KST = HD + 8;     // K tile row and Q row (halfs)
    static constexpr int VST = FA_BN + 8;  // V^T tile row (halfs)
    static constexpr int STAGE = FA_BN * KST + HD * VST;  // halfs
    static constexpr int QTILE = QS ? FA_BM * KST : 0;    // halfs, before the stages
    static constexpr int SMEM = (QTILE + STAGES * STAGE) * 2;  // bytes
};

// four 8x8 b16 matrices from shared memory: thread t gives the address of row t % 8 of matrix t / 8 and receives
// (row lane / 4, columns 2 (lane % 4), +1) of each: for row-major n x k tiles, the B fragments of two mma k-halves
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// keys k0 .. k0 + 63 of one kv head into a stage: K rows (key-major) and V^T rows (dim-major); keys >= S as 0
template <int HD>
__device__ __forceinline__ void fa_load(u16* st, const u16* __restrict__ kh, const u16* __restrict__ vh, int k0, int S,
                                        int tid) {
    using F = FaShape<HD, false>;  // the tile strides of both shapes
    u16* ks = st;
    u16* vs = st + FA_BN * F::KST;
    for (int i = tid; i < FA_BN * (HD / 8); i += FA_THREADS) {
        const int key = i / (HD / 8), c = i % (HD / 8);
        u16* dst = ks + key * F::KST + c * 8;
        if (k0 + key < S) cp_async16(smem_addr(dst), kh + (i64)(k0 + key) * HD + c * 8);
        else *(uint4*)dst = make_uint4(0u, 0u, 0u, 0u);
    }
    for (int i = tid; i < HD * (FA_BN / 8); i += FA_THREADS) {  // V^T: the key tiles' 16-position pieces in order
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

template <int HD, bool QS>
__device__ __forceinline__ void attn_flash_body(const u16* __restrict__ qp, const u16* __restrict__ kc,
                                                const u16* __restrict__ vc, int R, int group, int pos0, int max_ctx,
                                                float* __restrict__ o) {
    using F = FaShape<HD, QS>;
    constexpr int KS = HD / 16, NDT = HD / 8, NT = FA_BN / 8;
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ __align__(16) u16 fa_sm[];
    const int h = blockIdx.y, r0 = blockIdx.x * FA_BM;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, q4 = lane & 3;
    const int S = pos0 + R / group;  // the prefix and the chunk
    const u16* kh = kc + (i64)h * max_ctx * HD;
    const u16* vh = vc + v_at(h, HD, max_ctx, 0, 0);
    const int ra = r0 + w * 16 + g, rb = ra + 8;  // this thread's two rows
    const int la_key = pos0 + min(ra, R - 1) / group, lb_key = pos0 + min(rb, R - 1) / group;  // last key each sees

    // Q's A fragments: (row g, dims 2 q4 + {0, 1}), (row g + 8, same), then both at dims + 8, for each k-step
    u32 qf[QS ? 1 : KS][4];
    u16* const stages = fa_sm + F::QTILE;
    if (QS) {  // the block's rows into shared memory, landing with the first key tile's commit group
        for (int i = tid; i < FA_BM * (HD / 8); i += FA_THREADS) {
            const int r = i / (HD / 8), c = i % (HD / 8);
            cp_async16(smem_addr(fa_sm + r * F::KST + c * 8), qp + ((i64)h * R + min(r0 + r, R - 1)) * HD + c * 8);
        }
    } else {
        const u16* qa = qp + ((i64)h * R + min(ra, R - 1)) * HD;
        const u16* qb = qp + ((i64)h * R + min(rb, R - 1)) * HD;
#pragma unroll
        for (int ks = 0; ks < (QS ? 1 : KS); ++ks) {
            const int d = ks * 16 + 2 * q4;
            qf[ks][0] = *(const u32*)(qa + d);
            qf[ks][1] = *(const u32*)(qb + d);
            qf[ks][2] = *(const u32*)(qa + d + 8);
            qf[ks][3] = *(const u32*)(qb + d + 8);
        }
    }
    // ldmatrix rows of the Q tile: lanes 0-15 rows w * 16 + lane (dims + 0), lanes 16-31 the same rows, dims + 8
    const u32 qaddr = smem_addr(fa_sm + (w * 16 + (lane & 15)) * F::KST + (lane >> 4) * 8);
    float acc[NDT][4];
#pragma unroll
    for (int i = 0; i < NDT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float ma = NEG_INF, mb = NEG_INF, la = 0.f, lb = 0.f;

    const int kend = pos0 + (min(r0 + FA_BM, R) - 1) / group + 1;  // keys this block needs
    const int nkb = (kend + FA_BN - 1) / FA_BN;
    const int warp_last = pos0 + (min(r0 + w * 16 + 15, R - 1)) / group;  // the warp's last visible key
    const int warp_first = pos0 + min(r0 + w * 16, R - 1) / group;         // every row of the warp sees keys <= it
#pragma unroll
    for (int t = 0; t < F::STAGES - 1; ++t) {  // the first tiles in flight (a commit group each, empty or not)
        if (t < nkb) fa_load<HD>(stages + t * F::STAGE, kh, vh, t * FA_BN, S, tid);
        cp_commit();
    }
    for (int kb = 0; kb < nkb; ++kb) {
        cp_wait<F::STAGES - 2>();  // this thread's copies of tile kb (and of Q) have landed
        __syncthreads();           // everyone's have; and everyone is done with tile kb - 1, whose stage refills now
        const int nx = kb + F::STAGES - 1;
        if (nx < nkb) fa_load<HD>(stages + (nx % F::STAGES) * F::STAGE, kh, vh, nx * FA_BN, S, tid);
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
                u32* a = qf[QS ? 0 : ks];
                if (QS) ldsm_x4(qaddr + (u32)(ks * 16 * 2), a[0], a[1], a[2], a[3]);
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

#define FA_INST(HD, QS, NAME)                                                                                     \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, QS ? 2 : 1) NAME(                                      \
        const u16* __restrict__ qp, const u16* __restrict__ kc, const u16* __restrict__ vc, int R, int group,      \
        int pos0, int max_ctx, float* __restrict__ o) {                                                           \
        PDL_ENTRY();                                                                                               \
        attn_flash_body<HD, QS>(qp, kc, vc, R, group, pos0, max_ctx, o);                                          \
    }
FA_INST(64, false, attn_flash_prefill_64)
FA_INST(128, false, attn_flash_prefill_128)
FA_INST(64, true, attn_flash_prefill_64_qs)
FA_INST(128, true, attn_flash_prefill_128_qs)
