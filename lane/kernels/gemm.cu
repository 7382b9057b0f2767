// A prompt chunk's dense projections run on cuBLAS (gemm.py): these kernels dequantise GGUF rows to fp16 once and
// round the float32 activations to fp16.
#include "common.cuh"
#include "dense_common.cuh"

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
