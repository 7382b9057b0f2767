// A prompt chunk's dense projections run on cuBLAS (gemm.py): these kernels dequantise GGUF rows to fp16 once and
// round the float32 activations to fp16.
#include "common.cuh"
#include "decode.cuh"
#include "dense_common.cuh"

// dequantise rows of type QT to f16 (out_t 1), bf16 (30) or f32 (0): G consecutive values a thread, a sub-block
// (32) of a quantised type, 8 of a float type (cols % G == 0)
template <int QT>
__device__ __forceinline__ void dequant_rows_body(const u8* __restrict__ W, int rows, int cols, i64 row_bytes,
                                                  const u8* __restrict__ tab, void* out, int out_t) {
    typedef DqSpan<QT> S;
    constexpr int G = S::SPAN > 8 ? S::SPAN : 8;
    PDL_ENTRY();
    const i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const int gpr = cols / G;
    if (g >= (i64)rows * gpr) return;
    const int row = (int)(g / gpr), c0 = (int)(g % gpr) * G;
    const u8* rp = W + (i64)row * row_bytes;
    float v[G];
#pragma unroll
    for (int k = 0; k < G / S::SPAN; ++k) S::decode(rp, c0 / S::SPAN + k, tab, v + k * S::SPAN);
    const i64 o = (i64)row * cols + c0;
#pragma unroll
    for (int c = 0; c < G; c += 8) {
        if (out_t == QT_F32) {
            float4* op = (float4*)((float*)out + o + c);
            op[0] = make_float4(v[c], v[c + 1], v[c + 2], v[c + 3]);
            op[1] = make_float4(v[c + 4], v[c + 5], v[c + 6], v[c + 7]);
        } else {
            u32 h[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                h[i] = out_t == QT_F16 ? pack_h2(v[c + 2 * i], v[c + 2 * i + 1])
                                       : ((u32)f2bf(v[c + 2 * i]) | ((u32)f2bf(v[c + 2 * i + 1]) << 16));
            *(uint4*)((u16*)out + o + c) = make_uint4(h[0], h[1], h[2], h[3]);
        }
    }
}
#define DEQUANT_ROWS(name, code)                                                                                \
    extern "C" __global__ void dequant_rows_##name(const u8* __restrict__ W, int rows, int cols, i64 row_bytes,  \
                                                   const u8* __restrict__ tab, void* out, int out_t) {           \
        dequant_rows_body<code>(W, rows, cols, row_bytes, tab, out, out_t);                                     \
    }
DQ_ALL_TYPES(DEQUANT_ROWS)

// float32 -> f16 / bf16 (n % 2 == 0)
extern "C" __global__ void convert_f32(const float* __restrict__ x, i64 n, void* out, int out_t) {
    PDL_ENTRY();
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (i >= n) return;
    const float a = x[i], b = x[i + 1];
    ((u32*)out)[i >> 1] = out_t == QT_F16 ? pack_h2(a, b) : ((u32)f2bf(a) | ((u32)f2bf(b) << 16));
}
