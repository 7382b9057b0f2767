// router: one warp per token (route.cuh)
#include "common.cuh"
#include "dense_common.cuh"

#include "route.cuh"

extern "C" __global__ void __launch_bounds__(32) route_topk(const float* __restrict__ logits, i64 ld, int n, int k,
                                                            int* __restrict__ ids, float* __restrict__ wts) {
    PDL_ENTRY();
    __shared__ float e[1024];
    __shared__ float sel[32];
    const int t = blockIdx.x;
    route_warp(logits + (i64)t * ld, n, k, e, sel, threadIdx.x, ids + (i64)t * k, wts + (i64)t * k);
}
