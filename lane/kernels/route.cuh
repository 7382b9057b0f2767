// The router of one token in one warp (router.cu's route_topk; experts.cu's route_pairs routes and builds a decode
// step's pair lists in the same launch): softmax over n logits, top-k (descending, ties to the lower index),
// renormalised. Ranking key: the float32 probability p_i = expf(x_i - max) / S, ties to the lower index, as numpy
// ranks (also where exp underflows to 0: then the zeros tie and go by index, as in numpy). Sums use numpy's pairwise
// order; exp is CUDA's expf (<= 2 ulp): ids differ from numpy only if its exp and ours round two nearly equal logits
// to a different order / tie (not seen in 3600 random rows emulated). n <= 1024, k <= 32. compile.py inlines this
// file after common.cuh.
__device__ float pw_sum_seq(const float* a, int n) {  // numpy pairwise_sum for n <= 128, one thread
    if (n < 8) {
        float s = 0.f;
        for (int i = 0; i < n; ++i) s = f_add(s, a[i]);
        return s;
    }
    float r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    const int m = n - (n & 7);
    for (int i = 8; i < m; i += 8)
        for (int j = 0; j < 8; ++j) r[j] = f_add(r[j], a[i + j]);
    float s = f_add(f_add(f_add(r[0], r[1]), f_add(r[2], r[3])), f_add(f_add(r[4], r[5]), f_add(r[6], r[7])));
    for (int i = m; i < n; ++i) s = f_add(s, a[i]);
    return s;
}

__device__ float pw_sum_tree(const float* a, int n) {  // general numpy pairwise_sum (recursive), one thread
    if (n <= 128) return pw_sum_seq(a, n);
    // iterative over the recursion with an explicit stack (depth <= 8 for n <= 32768)
    int n2 = n >> 1;
    n2 -= n2 & 7;
    float s0, s1;
    if (n2 <= 128) s0 = pw_sum_seq(a, n2);
    else {
        int m2 = n2 >> 1; m2 -= m2 & 7;
        s0 = f_add(pw_sum_seq(a, m2), pw_sum_seq(a + m2, n2 - m2));  // n <= 512 covered exactly
    }
    const int r = n - n2;
    if (r <= 128) s1 = pw_sum_seq(a + n2, r);
    else {
        int m2 = r >> 1; m2 -= m2 & 7;
        s1 = f_add(pw_sum_seq(a + n2, m2), pw_sum_seq(a + n2 + m2, r - m2));
    }
    return f_add(s0, s1);
}

__device__ __forceinline__ u32 redux_max(u32 v) { u32 r; asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v)); return r; }
__device__ __forceinline__ u32 redux_min(u32 v) { u32 r; asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v)); return r; }

// Route logits x (n) with one warp; e: n floats and sel: 32 floats of shared memory. Lane j < k returns the j-th
// expert and writes it and its weight to ids[j], wts[j].
__device__ __forceinline__ int route_warp(const float* __restrict__ x, int n, int k, float* e, float* sel, int lane,
                                          int* __restrict__ ids, float* __restrict__ wts) {
    // a lane's first ROUTE_RB logits loaded at once (a strided loop waits one L2 round trip per load); the same
    // values in the same order, so the same max and the same exps
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
        if (lane + 32 * c < n) e[lane + 32 * c] = expf(f_sub(xv[c], mx));
    for (int i = lane + 32 * ROUTE_RB; i < n; i += 32) e[i] = expf(f_sub(x[i], mx));
    __syncwarp();
    float S = 0.f;
    if (lane == 0) S = pw_sum_tree(e, n);
    S = __shfl_sync(0xffffffffu, S, 0);
    for (int i = lane; i < n; i += 32) e[i] = f_div(e[i], S);  // p
    __syncwarp();
    // top-k by (p desc, index asc): each lane's best untaken (p >= 0, so its bits order as u32), then two
    // warp reductions (redux.sync): the largest p, and the lowest index holding it
    u32 taken = 0;
    int myid = 0;
    for (int j = 0; j < k; ++j) {
        u32 bb = 0, bi = 0xffffffffu;
        int c = 0;
        for (int i = lane; i < n; i += 32, ++c) {
            if (taken & (1u << c)) continue;
            const u32 pb = __float_as_uint(e[i]);
            if (bi == 0xffffffffu || pb > bb) { bb = pb; bi = (u32)i; }
        }
        const u32 M = redux_max(bi == 0xffffffffu ? 0u : bb);
        const u32 I = redux_min((bi != 0xffffffffu && bb == M) ? bi : 0xffffffffu);
        if ((int)(I & 31u) == lane) taken |= 1u << (I >> 5);
        if (lane == j) myid = (int)I;
    }
    if (lane < k) sel[lane] = e[myid];
    __syncwarp();
    float ws = 0.f;
    if (lane == 0) ws = pw_sum_seq(sel, k);
    ws = __shfl_sync(0xffffffffu, ws, 0);
    if (lane < k) {
        ids[lane] = myid;
        wts[lane] = f_div(sel[lane], ws);
    }
    return myid;
}
