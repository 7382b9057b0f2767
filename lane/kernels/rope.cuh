// =============================================================================================================
// fused per-head q/k RMSNorm + NEOX RoPE + KV append, T tokens at positions pos[0] + t.
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
    if (n <= 128) return __shfl_sync(0xffffffffu, leaf_sum<true>(a, n, lane & 7), 0);
    int n2 = n >> 1;
    n2 -= n2 & 7;
    const float s0 = leaf_sum<true>(a, n2, lane & 7);
    const float s1 = leaf_sum<true>(a + n2, n - n2, lane & 7);
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
