// argmax (np.argmax: first index of the maximum; a NaN counts as the maximum) and top-k / top-p sampling.
// Keys: u64 (order(x) << 32) | (0xffffffff - index), larger = better; order(): -0 -> +0, NaN above +inf.
#include "common.cuh"
#include "dense_common.cuh"

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

// The largest of a 256-thread block's keys, in two steps: every thread (tid) calls warp_maxes_u64 with its key v,
// which leaves each warp's largest in red (8 words of shared memory) and waits at the barrier; then red_max8(red)
__device__ __forceinline__ void warp_maxes_u64(u64 v, u64* red, int tid) {
    v = warp_max_u64(v);
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
}
__device__ __forceinline__ u64 red_max8(const u64* red) {
    u64 b = red[0];
    for (int i = 1; i < 8; ++i) b = red[i] > b ? red[i] : b;
    return b;
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
    warp_maxes_u64(best, red, tid);
    if (tid == 0) {
        part[blockIdx.x] = red_max8(red);
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
    warp_maxes_u64(b, red, tid);
    if (tid == 0) {
        out[0] = key_index(red_max8(red));
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
