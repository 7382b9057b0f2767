// q/k RMSNorm + RoPE + KV append (rope.cuh), and the device position's advance.
#include "common.cuh"
#include "dense_common.cuh"
#include "norm.cuh"
#include "rope.cuh"

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
