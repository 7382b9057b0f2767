// =============================================================================================================
// RMSNorm, numpy's exact summation tree.
// numpy's float32 add.reduce over a contiguous row of n values (pairwise_sum): n < 8: sequential from 0;
// n <= 128: 8 accumulators r[j] = a[j] + a[j+8] + ... over the first n - n%8 values, then
// ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the n%8 leftovers sequentially; n > 128: split at
// n2 = n/2 - (n/2)%8 and add the two halves' sums. The host passes that tree as NL equal leaves of L values
// (NL a power of two, L <= 128); mode 0 = generic (not numpy's order) for other n.
// =============================================================================================================

// sqrt(mean(x^2) + eps) of the row xr (n values, shared or global memory) in numpy's pairwise order (the plan's NL
// leaves of L values; L = 0: no plan, a block-strided sum), by the whole block (blockDim >= NL * 8, a multiple of
// 32). Every thread returns it; every read of xr is done before the one barrier, after which every warp adds the
// warps' sums in the same tree and takes the root itself (the same bits in every lane; no second barrier and no
// hand-off through one thread). Called once a kernel: part is not reused.
__device__ __forceinline__ float row_rms(const float* xr, int n, int L, int NL, float eps) {
    __shared__ float part[32];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    float sum;
    if (L > 0) {
        const int leaf = tid >> 3;
        // every lane takes part in the shuffles (leaves past NL compute a copy of the last one, then drop it)
        float s = leaf_sum<true>(xr + (i64)min(leaf, NL - 1) * L, L, lane & 7);
        if (leaf >= NL) s = 0.f;
        // leaves in a warp: lanes 0, 8, 16, 24 -> (l0+l1)+(l2+l3)
        if (NL >= 2) s = f_add(s, __shfl_xor_sync(0xffffffffu, s, 8));
        if (NL >= 4) s = f_add(s, __shfl_xor_sync(0xffffffffu, s, 16));
        const int nwl = (NL + 3) >> 2;  // warps holding leaves
        if (lane == 0 && wid < nwl) part[wid] = s;
        __syncthreads();
        float v = lane < nwl ? part[lane] : 0.f;
        for (int o = 1; o < nwl; o <<= 1) {
            const float u = __shfl_xor_sync(0xffffffffu, v, o);
            v = f_add(v, u);
        }
        sum = __shfl_sync(0xffffffffu, v, 0);
    } else {
        float s = 0.f;
        for (int i = tid; i < n; i += blockDim.x) s = f_add(s, f_mul(xr[i], xr[i]));
        s = warp_sum(s);
        if (lane == 0) part[wid] = s;
        __syncthreads();
        sum = __shfl_sync(0xffffffffu, warp_sum(lane < nw ? part[lane] : 0.f), 0);
    }
    return f_sqrt(f_add(f_div(sum, (float)n), eps));
}

// rows of x (ldx apart) -> y (ldy apart). blockDim >= max(256, NL*8), multiple of 32. With `staged`, the row is
// first copied with w to dynamic shared memory (8n bytes) by coalesced loads, so the summation chains wait on shared
// memory, not on global latency. With q (n a multiple of 32): each row also quantised for the experts, q (rows, n)
// int8 and d (rows, n / 32) (the launch the experts' quantisation would otherwise take).
