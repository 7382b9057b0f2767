// fetch_experts: a decode step's experts that no card holds, copied from where they are (the page-locked arena, read
// over the bus) into staging slots on the card, so that the expert kernels then read them from device memory.
//
// Why a copy first: the SMs read host memory fastest as one grid-wide stream of 16-byte words, consecutive threads
// on consecutive words (scripts/gpu_bus_read.py); the expert kernels' own staging (a block's rows, a warp's range)
// reads it at about half that rate (docs/perf-notes.md). The copy moves bytes only, so the experts computed from
// the staging slots give the same bits as computed in place.
//
// Pair p's expert (pairs[p] = (token, expert)) goes to staging slot p; pairs_out[p] = (token, p), the list the expert
// kernels then take with the staging slots' layout. Words [w_lo, w_hi) of each expert's gate, up and down words
// (in that order) are copied: all of them, or gate and up first and down by a second launch while gate/up computes;
// the launch that copies word 0 writes pairs_out. n_slots caps the pairs (a decode step's arena pairs are one
// token's, at most k). Every matrix is a whole number of 16-byte words, at 16-byte aligned addresses; n_slots
// experts' words fit an int (fetch.py checks).
#include "common.cuh"

// loads in flight a thread; fetch.py launches half as many blocks as the card has SMs, so that the card's own expert
// kernels, launched beside the fetch on the main stream, keep most of their blocks' room
#define DEPTH 4

extern "C" __global__ void __launch_bounds__(512)
fetch_experts(const int* __restrict__ pairs, const int* __restrict__ n_pairs_p, int n_slots,
              const u8* __restrict__ src, i64 src_stride, i64 src_up, const u8* __restrict__ src_down,
              i64 src_down_stride, u8* __restrict__ dst, i64 dst_stride, i64 dst_up, u8* __restrict__ dst_down,
              i64 dst_down_stride, int gate_words, int down_words, int w_lo, int w_hi, int* __restrict__ pairs_out) {
    PDL_ENTRY();
    int n = *n_pairs_p;
    n = n < 0 ? 0 : (n > n_slots ? n_slots : n);
    if (blockIdx.x == 0 && w_lo == 0)
        for (int p = threadIdx.x; p < n; p += blockDim.x) {
            pairs_out[2 * p] = pairs[2 * p];
            pairs_out[2 * p + 1] = p;
        }
    const int per = w_hi - w_lo;  // an expert's words this launch copies
    const int total = n * per, S = gridDim.x * blockDim.x;
    for (int w0 = blockIdx.x * blockDim.x + threadIdx.x; w0 < total; w0 += DEPTH * S) {
        uint4 v[DEPTH];
        u8* d[DEPTH];
#pragma unroll
        for (int i = 0; i < DEPTH; ++i) {  // DEPTH loads in flight a thread, then their stores
            const int w = w0 + i * S;
            if (w >= total) break;
            const int p = w / per, r = w_lo + (w - p * per);
            const i64 e = __ldg(pairs + 2 * p + 1);
            const u8* s;
            if (r < gate_words) {
                s = src + e * src_stride + 16 * (i64)r;
                d[i] = dst + p * dst_stride + 16 * (i64)r;
            } else if (r < 2 * gate_words) {
                s = src + src_up + e * src_stride + 16 * (i64)(r - gate_words);
                d[i] = dst + dst_up + p * dst_stride + 16 * (i64)(r - gate_words);
            } else {
                s = src_down + e * src_down_stride + 16 * (i64)(r - 2 * gate_words);
                d[i] = dst_down + p * dst_down_stride + 16 * (i64)(r - 2 * gate_words);
            }
            v[i] = __ldg(reinterpret_cast<const uint4*>(s));
        }
#pragma unroll
        for (int i = 0; i < DEPTH; ++i)
            if (w0 + i * S < total) *reinterpret_cast<uint4*>(d[i]) = v[i];
    }
}
