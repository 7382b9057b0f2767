// Pair lists: a layer's routed entries -> which source computes each (this card, a peer's slot pool, the CPU pool),
// as per-source (token, slot) lists grouped by expert, the row map the combine reads, the CPU miss list and the
// prompt tiles. build_pairs for any number of entries, route_pairs (router and pair lists of a decode step in one
// warp). experts.cu includes this file after route.cuh and its helpers.

// build_pairs for n <= 32 entries by one warp: lane i holds entry i's expert e (lanes past n: anything). Each
// entry's place in its source's list is the number of that source's entries before it by (expert, entry), or by
// entry alone (by_entry: a one-token step's lists in router order, the likeliest expert first).
__device__ __forceinline__ void pairs_warp(int e, int n, int K, const int* __restrict__ src,
                                           const int* __restrict__ slot, int n_expert, int n_src, int max_pairs,
                                           int* __restrict__ pairs, int* __restrict__ n_pairs,
                                           int* __restrict__ rowmap, int* __restrict__ miss, int* __restrict__ n_miss,
                                           int max_miss, bool by_entry) {
    const int i = threadIdx.x & 31;
    int s = -1;
    if (i < n) {
        s = (e >= 0 && e < n_expert) ? src[e] : -1;
        if (s >= n_src) s = -1;
    } else {
        e = -1;
    }
    int pos = 0, mine = 0;  // this entry's place in its source's list; the entries of source i
    for (int j = 0; j < n; ++j) {
        const int ej = __shfl_sync(FULL_MASK, e, j), sj = __shfl_sync(FULL_MASK, s, j);
        if (s >= 0 && sj == s && (by_entry ? j < i : (ej < e || (ej == e && j < i)))) ++pos;
        if (sj == i) ++mine;
    }
    const u32 missed = __ballot_sync(FULL_MASK, i < n && s < 0);
    if (i < n) {
        if (s >= 0) {
            const int r = s * max_pairs + pos;
            pairs[2 * r] = i / K;
            pairs[2 * r + 1] = slot[e];
            rowmap[i] = r;
        } else {
            const int m = __popc(missed & ((1u << i) - 1u));
            if (m < max_miss) {
                miss[2 * m] = i / K;
                miss[2 * m + 1] = e;
            }
            rowmap[i] = -1 - m;
        }
    }
    if (i < n_src) n_pairs[i] = mine;
    if (i == 0 && n_miss != nullptr) {  // null where no host serves misses: no system fence
        *n_miss = __popc(missed);
        __threadfence_system();
    }
}

// A decode step's router and pair lists in one launch (one warp): route.cuh's route of one token's logits (ids,
// wts: as route_topk writes them), then pairs_warp on its k experts (build_pairs' contract; by_weight: each list in
// router order instead of by expert, as a guess fetched ahead under a cap wants them).
extern "C" __global__ void __launch_bounds__(32) route_pairs(const float* __restrict__ logits, int n, int k,
                                                             int* __restrict__ ids, float* __restrict__ wts,
                                                             const int* __restrict__ src, const int* __restrict__ slot,
                                                             int n_src, int max_pairs, int* __restrict__ pairs,
                                                             int* __restrict__ n_pairs, int* __restrict__ rowmap,
                                                             int* __restrict__ miss, int* __restrict__ n_miss,
                                                             int max_miss, int by_weight) {
    __shared__ float e[1024];
    __shared__ float sel[32];
    // the layer's expert -> (source, slot) tables, copied while the router still runs (the host writes them on this
    // stream between steps; cp.async, which ptxas keeps ahead of the wait): pairs_warp then reads shared memory
    // instead of two dependent L2 round trips after the top-k
    __shared__ int tab[2][1024];
    for (int i = threadIdx.x; i < n; i += 32) {
        cp_async4(smem_addr(&tab[0][i]), src + i);
        cp_async4(smem_addr(&tab[1][i]), slot + i);
    }
    cp_commit();
    PDL_ENTRY();
    const int id = route_warp(logits, n, k, e, sel, threadIdx.x, ids, wts);
    cp_wait<0>();
    __syncwarp();
    pairs_warp(id, k, k, tab[0], tab[1], n, n_src, max_pairs, pairs, n_pairs, rowmap, miss, n_miss, max_miss,
               by_weight != 0);
}

// One layer's routed entries (ids: n = T*K expert ids, token = entry / K) -> where each is computed. src[e]: the
// source holding expert e (0 = this card, 1.. = peers' slot pools, -1 = none: the CPU pool), slot[e]: its slot
// there. Writes per source s a pair list pairs[s] = (token, slot) grouped by expert (tokens of one expert are
// neighbours, so its weights are read while still in L2) with its count n_pairs[s]; rowmap[entry] = s * max_pairs
// + pair (the row the expert kernels write) or -1 - m for the m-th CPU miss; miss[m] = (token, expert) and
// n_miss (mapped host memory: the host reads them after the doorbell). With tile_p > 0 also each source's tiles
// (first pair, count <= tile_p; an expert's pairs cut into tiles) for the tiled kernels. One block; pair order
// within an expert is whatever the atomics give (each row depends on its own pair only).
#define MAX_SOURCES 8
extern "C" __global__ void build_pairs(const int* __restrict__ ids, int n, int K, const int* __restrict__ src,
                                       const int* __restrict__ slot, int n_expert, int n_src, int max_pairs,
                                       int* __restrict__ pairs, int* __restrict__ n_pairs, int* __restrict__ rowmap,
                                       int* __restrict__ miss, int* __restrict__ n_miss, int max_miss, int tile_p,
                                       int* __restrict__ tiles, int* __restrict__ n_tiles, int max_tiles) {
    PDL_ENTRY();
    if (n <= 32 && tile_p == 0) {  // a decode step's few entries: one warp ranks them, no scan over the experts
        if (threadIdx.x < 32)
            pairs_warp(threadIdx.x < n ? ids[threadIdx.x] : -1, n, K, src, slot, n_expert, n_src, max_pairs, pairs,
                       n_pairs, rowmap, miss, n_miss, max_miss, false);
        return;
    }
    extern __shared__ int sh[];  // count[n_expert], cursor[n_expert], source[n_expert]
    int* count = sh;
    int* cursor = sh + n_expert;
    int* source = sh + 2 * n_expert;
    __shared__ int misses;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        count[e] = 0;
        source[e] = src[e];  // the serial scan below then reads shared memory only
    }
    if (threadIdx.x == 0) misses = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int e = ids[i];
        if (e >= 0 && e < n_expert && src[e] >= 0) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int base[MAX_SOURCES], nt[MAX_SOURCES];
        for (int s = 0; s < MAX_SOURCES; ++s) base[s] = nt[s] = 0;
        for (int e = 0; e < n_expert; ++e) {
            const int s = source[e];
            if (s >= 0 && s < n_src) {
                cursor[e] = base[s];
                for (int off = 0; tile_p > 0 && off < count[e]; off += tile_p) {  // tiles of tile_p pairs
                    if (nt[s] < max_tiles) {
                        int* tl = tiles + 2 * ((i64)s * max_tiles + nt[s]);
                        tl[0] = base[s] + off;
                        tl[1] = min(tile_p, count[e] - off);
                    }
                    ++nt[s];
                }
                base[s] += count[e];
            }
        }
        for (int s = 0; s < n_src; ++s) {
            n_pairs[s] = base[s];
            if (tile_p > 0) n_tiles[s] = min(nt[s], max_tiles);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int e = ids[i];
        const int s = (e >= 0 && e < n_expert) ? src[e] : -1;
        if (s >= 0 && s < n_src) {
            const int r = s * max_pairs + atomicAdd(&cursor[e], 1);
            pairs[2 * r] = i / K;
            pairs[2 * r + 1] = slot[e];
            rowmap[i] = r;
        } else {
            const int m = atomicAdd(&misses, 1);
            if (m < max_miss) {  // the host's list has room for max_miss; more is reported by the count
                miss[2 * m] = i / K;
                miss[2 * m + 1] = e;  // an id out of range reaches the CPU pool, which names it
            }
            rowmap[i] = -1 - m;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && n_miss != nullptr) {
        *n_miss = misses;
        __threadfence_system();
    }
}
