// The grid barrier (grid_sync.cuh) tested, and what measures it against the kernel boundary it would replace.
// compile.py inlines the .cuh files.
#include "common.cuh"
#include "grid_sync.cuh"

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
