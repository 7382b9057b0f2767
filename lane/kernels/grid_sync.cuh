// Grid-wide barrier for persistent kernels (docs/perf-notes.md, "the persistent-layer plan"); grid_sync.cu tests
// and measures it, dense.cu's persistent kernels use it. compile.py inlines this file after common.cuh.
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
