// RMSNorm with numpy's summation tree (norm.cuh).
#include "common.cuh"
#include "dense_common.cuh"
#include "norm.cuh"

extern "C" __global__ void __launch_bounds__(1024) rms_norm_rows(const float* x, i64 ldx, const float* __restrict__ w,
                                                                 float* y, i64 ldy, int n, int L, int NL, float eps,
                                                                 int staged, signed char* __restrict__ q,
                                                                 float* __restrict__ d) {
    PDL_ENTRY();
    extern __shared__ float xs[];
    const float* xg = x + (i64)blockIdx.x * ldx;
    float* yr = y + (i64)blockIdx.x * ldy;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    if (staged) {  // x and w copied by cp.async: no load waits on a store (st.shared after each ld.global held the
                   // next loads back, a round trip each)
        const u32 sx = smem_addr(xs), sw = smem_addr(xs + n);
        if ((((u64)xg | (u64)w) & 15) == 0 && (n & 3) == 0) {
            for (int i = 4 * tid; i < n; i += 4 * blockDim.x) {
                cp_async16(sx + 4 * i, xg + i);
                cp_async16(sw + 4 * i, w + i);
            }
        } else {
            for (int i = tid; i < n; i += blockDim.x) {
                cp_async4(sx + 4 * i, xg + i);
                cp_async4(sw + 4 * i, w + i);
            }
        }
        cp_commit();
        cp_wait<0>();
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
