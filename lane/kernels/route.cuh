// The router of one token in one warp (router.cu's route_topk; experts.cu's route_pairs routes and builds a decode
// step's pair lists in the same launch): softmax over n logits, top-k (descending, ties to the lower index),
// renormalised. Ranking key: the float32 probability p_i = expf(x_i - max) / S, ties to the lower index, as numpy
// ranks (also where exp underflows to 0: then the zeros tie and go by index, as in numpy). Sums use numpy's pairwise
// order; exp is CUDA's expf (<= 2 ulp): ids differ from numpy only if its exp and ours round two nearly equal logits
// to a different order / tie (not seen in 3600 random rows emulated). n <= 1024, k <= 32. compile.py inlines this
// file after common.cuh.

// numpy's pairwise sum of a (n values) by a warp, every lane returning it: one leaf for n <= 128, else halves split at
// n2 = n/2 - (n/2)%8, each a leaf or (over 128) split the same way once more (numpy's tree for n <= 488; past that a
// quarter of more than 128 is one leaf of 8 accumulators, where numpy splits again); each leaf summed by
// a group of 8 lanes (common.cuh leaf_sum), a half that is one leaf computed by both its groups (every leaf then
// holds 64 values or more: the same side of 8 across the warp, as leaf_sum needs)
__device__ __forceinline__ float pw_sum_warp(const float* a, int n, int lane) {
    const int j = lane & 7;
    if (n <= 128) return leaf_sum<false>(a, n, j);
    int n2 = n >> 1;
    n2 -= n2 & 7;
    const int r = n - n2;
    int h0 = n2 >> 1, h1 = r >> 1;  // where each half splits, if it holds more than 128
    h0 -= h0 & 7;
    h1 -= h1 & 7;
    const bool s0 = n2 > 128, s1 = r > 128;
    const int g = lane >> 3;  // groups 0, 1: [0, h0) and [h0, n2), or [0, n2) twice; groups 2, 3 the same for r
    const int base = g < 2 ? 0 : n2, len = g < 2 ? n2 : r, h = g < 2 ? h0 : h1;
    const bool split = g < 2 ? s0 : s1, second = g & 1;
    const float v = leaf_sum<false>(a + base + (split && second ? h : 0), split ? (second ? len - h : h) : len, j);
    const float v0 = __shfl_sync(0xffffffffu, v, 0), v1 = __shfl_sync(0xffffffffu, v, 8);
    const float v2 = __shfl_sync(0xffffffffu, v, 16), v3 = __shfl_sync(0xffffffffu, v, 24);
    return f_add(s0 ? f_add(v0, v1) : v0, s1 ? f_add(v2, v3) : v2);
}

__device__ __forceinline__ u32 redux_max(u32 v) { u32 r; asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v)); return r; }
__device__ __forceinline__ u32 redux_min(u32 v) { u32 r; asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v)); return r; }

// Route logits x (n) with one warp; e: n floats and sel: 32 floats of shared memory. Lane j < k returns the j-th
// expert and writes it and its weight to ids[j], wts[j].
__device__ __forceinline__ int route_warp(const float* __restrict__ x, int n, int k, float* e, float* sel, int lane,
                                          int* __restrict__ ids, float* __restrict__ wts) {
    // a lane's first ROUTE_RB logits loaded at once (a strided loop waits one L2 round trip per load), then kept in
    // registers as exps and probabilities (the top-k's rounds read them there); the same values in the same order,
    // so the same max, exps, sum and ranking
    constexpr int ROUTE_RB = 8;
    float xv[ROUTE_RB];
#pragma unroll
    for (int c = 0; c < ROUTE_RB; ++c) xv[c] = lane + 32 * c < n ? x[lane + 32 * c] : NEG_INF;
    float mx = NEG_INF;
#pragma unroll
    for (int c = 0; c < ROUTE_RB; ++c)
        if (lane + 32 * c < n) mx = fmaxf(mx, xv[c]);
    for (int i = lane + 32 * ROUTE_RB; i < n; i += 32) mx = fmaxf(mx, x[i]);
    mx = warp_max(mx);
#pragma unroll
    for (int c = 0; c < ROUTE_RB; ++c)
        if (lane + 32 * c < n) e[lane + 32 * c] = xv[c] = expf(f_sub(xv[c], mx));
    for (int i = lane + 32 * ROUTE_RB; i < n; i += 32) e[i] = expf(f_sub(x[i], mx));
    __syncwarp();
    const float S = pw_sum_warp(e, n, lane);
    __syncwarp();  // every lane's reads of e are done before it holds p
#pragma unroll
    for (int c = 0; c < ROUTE_RB; ++c)
        if (lane + 32 * c < n) e[lane + 32 * c] = xv[c] = f_div(xv[c], S);  // p
    for (int i = lane + 32 * ROUTE_RB; i < n; i += 32) e[i] = f_div(e[i], S);
    __syncwarp();
    // top-k by (p desc, index asc): each lane's best untaken (p >= 0, so its bits order as u32), then two
    // warp reductions (redux.sync): the largest p, and the lowest index holding it
    u32 taken = 0;
    int myid = 0;
    for (int j = 0; j < k; ++j) {
        u32 bb = 0, bi = 0xffffffffu;
        auto consider = [&](int c, float p) {
            const int i = lane + 32 * c;
            if (i < n && !(taken & (1u << c)) && (bi == 0xffffffffu || __float_as_uint(p) > bb)) {
                bb = __float_as_uint(p);
                bi = (u32)i;
            }
        };
#pragma unroll
        for (int c = 0; c < ROUTE_RB; ++c) consider(c, xv[c]);
        for (int c = ROUTE_RB; lane + 32 * c < n; ++c) consider(c, e[lane + 32 * c]);
        const u32 M = redux_max(bi == 0xffffffffu ? 0u : bb);
        const u32 I = redux_min((bi != 0xffffffffu && bb == M) ? bi : 0xffffffffu);
        if ((int)(I & 31u) == lane) taken |= 1u << (I >> 5);
        if (lane == j) myid = (int)I;
    }
    if (lane < k) sel[lane] = e[myid];
    __syncwarp();
    const float ws = leaf_sum<false>(sel, k, lane & 7);  // numpy's order for k <= 32
    if (lane < k) {
        ids[lane] = myid;
        wts[lane] = f_div(sel[lane], ws);
    }
    return myid;
}
