// Grid-wide barrier for persistent kernels (docs/perf-notes.md, "the persistent-layer plan"), and what measures it
// against the kernel boundary it would replace. compile.py inlines common.cuh.
#include "common.cuh"

// Every block of a cooperative launch (all resident at once) arrives; the last resets the count and advances the
// generation the others spin on. The pattern of cooperative groups' grid sync: the block's writes are ordered
// before thread 0's device-scope fence by the barrier, and thread 0's fence after the spin orders what the block
// reads next after every other block's writes. count starts at 0 and is back at 0 after every barrier.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned* vgen = gen;
        const unsigned g = *vgen;  // before arriving: the last block advances it only after everyone has
        __threadfence();
        const unsigned n = gridDim.x * gridDim.y * gridDim.z;
        if (atomicAdd(count, 1u) == n - 1) {
            atomicExch(count, 0u);
            __threadfence();
            atomicAdd(gen, 1u);
        } else {
            while (*vgen == g) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// `rounds` rounds of: block b publishes r * nb + b in slots[b]; barrier; it adds the slot of block (b + r + 1) % nb
// to out[b]; barrier (the slot is not rewritten before everyone has read it). barrier_rounds_ref computes out.
extern "C" __global__ void __launch_bounds__(256) barrier_rounds(unsigned* count, unsigned* gen, int* slots,
                                                                 long long* out, int rounds) {
    PDL_ENTRY();
    const int nb = gridDim.x, b = blockIdx.x;
    long long acc = 0;
    for (int r = 0; r < rounds; ++r) {
        if (threadIdx.x == 0) slots[b] = r * nb + b;
        grid_barrier(count, gen);
        if (threadIdx.x == 0) acc += ((volatile int*)slots)[(b + r + 1) % nb];
        grid_barrier(count, gen);
    }
    if (threadIdx.x == 0) out[b] = acc;
}

// A launch that does nothing but the PDL handshake: N of them in a graph time a kernel boundary.
extern "C" __global__ void __launch_bounds__(256) boundary_only(int* x) {
    PDL_ENTRY();
    if (threadIdx.x == 0 && blockIdx.x == 0) x[0] += 1;
}
