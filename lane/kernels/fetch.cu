// fetch_experts: a decode step's experts that no card holds, copied from where they are (the page-locked arena, read
// over the bus) into staging slots on the card, so that the expert kernels then read them from device memory.
//
// Why a copy first: the SMs read host memory fastest as one grid-wide stream of 16-byte words, consecutive threads
// on consecutive words (scripts/gpu_bus_read.py); the expert kernels' own staging (a block's rows, a warp's range)
// reads it at about half that rate (docs/perf-notes.md). The copy moves bytes only, so the experts computed from
// the staging slots give the same bits as computed in place.
//
// Pair p's expert (pairs[p] = (token, expert)) goes to staging slot slot_base + p; pairs_out[p] = (token, its slot),
// the list the expert kernels then take with the staging slots' layout. Words [w_lo, w_hi) of each expert's gate, up
// and down words (in that order) are copied: all of them, or gate and up first and down by a second launch while
// gate/up computes; the launch that copies word 0 writes pairs_out. n_slots caps the pairs (a decode step's arena
// pairs are one token's, at most k). staged (or null): the pairs of an earlier fetch into slots 0 .. n_staged - 1
// (n_staged = min(*n_staged_p, staged_cap) <= slot_base: the experts fetched a layer ahead on a prediction); a pair
// whose expert is among them takes that slot and is not copied again. Every matrix is a whole number of 16-byte
// words, at 16-byte aligned addresses; n_slots experts' words fit an int (fetch.py checks).
#include "common.cuh"

// loads in flight a thread; fetch.py launches half as many blocks as the card has SMs, so that the card's own expert
// kernels, launched beside the fetch on the main stream, keep most of their blocks' room
#define DEPTH 4
#define MAX_FETCH 32  // pairs one launch takes at most: a token's k (route_pairs' bound)

extern "C" __global__ void __launch_bounds__(512)
fetch_experts(const int* __restrict__ pairs, const int* __restrict__ n_pairs_p, int n_slots,
              const u8* __restrict__ src, i64 src_stride, i64 src_up, const u8* __restrict__ src_down,
              i64 src_down_stride, u8* __restrict__ dst, i64 dst_stride, i64 dst_up, u8* __restrict__ dst_down,
              i64 dst_down_stride, int gate_words, int down_words, int w_lo, int w_hi,
              const int* __restrict__ staged, const int* __restrict__ n_staged_p, int staged_cap, int slot_base,
              int* __restrict__ pairs_out) {
    __shared__ int todo_e[MAX_FETCH], todo_at[MAX_FETCH];  // what this launch copies (not staged): expert, slot
    __shared__ int n_todo;
    PDL_ENTRY();
    int n = *n_pairs_p;
    n = n < 0 ? 0 : (n > n_slots ? n_slots : n);
    if (threadIdx.x < 32) {  // one warp: each pair's slot, and the list of those to copy
        const int p = threadIdx.x;
        int ns = staged ? *n_staged_p : 0;
        ns = ns < 0 ? 0 : (ns > staged_cap ? staged_cap : ns);
        int at = slot_base + p, e = -1;
        if (p < n) {
            e = pairs[2 * p + 1];
            for (int j = 0; j < ns; ++j)
                if (staged[2 * j + 1] == e) {
                    at = j;
                    break;
                }
        }
        const unsigned copy = __ballot_sync(0xffffffffu, p < n && at >= slot_base);
        if (p < n) {
            if (at >= slot_base) {
                const int t = __popc(copy & ((1u << p) - 1u));
                todo_e[t] = e;
                todo_at[t] = at;
            }
            if (blockIdx.x == 0 && w_lo == 0) {
                pairs_out[2 * p] = pairs[2 * p];
                pairs_out[2 * p + 1] = at;
            }
        }
        if (p == 0) n_todo = __popc(copy);
    }
    __syncthreads();
    const int per = w_hi - w_lo;  // an expert's words this launch copies
    const int total = n_todo * per, S = gridDim.x * blockDim.x;
    for (int w0 = blockIdx.x * blockDim.x + threadIdx.x; w0 < total; w0 += DEPTH * S) {
        uint4 v[DEPTH];
        u8* d[DEPTH];
#pragma unroll
        for (int i = 0; i < DEPTH; ++i) {  // DEPTH loads in flight a thread, then their stores
            const int w = w0 + i * S;
            if (w >= total) break;
            const int t = w / per, r = w_lo + (w - t * per);
            const i64 e = todo_e[t], at = todo_at[t];
            const u8* s;
            if (r < gate_words) {
                s = src + e * src_stride + 16 * (i64)r;
                d[i] = dst + at * dst_stride + 16 * (i64)r;
            } else if (r < 2 * gate_words) {
                s = src + src_up + e * src_stride + 16 * (i64)(r - gate_words);
                d[i] = dst + dst_up + at * dst_stride + 16 * (i64)(r - gate_words);
            } else {
                s = src_down + e * src_down_stride + 16 * (i64)(r - 2 * gate_words);
                d[i] = dst_down + at * dst_down_stride + 16 * (i64)(r - 2 * gate_words);
            }
            v[i] = __ldg(reinterpret_cast<const uint4*>(s));
        }
#pragma unroll
        for (int i = 0; i < DEPTH; ++i)
            if (w0 + i * S < total) *reinterpret_cast<uint4*>(d[i]) = v[i];
    }
}
