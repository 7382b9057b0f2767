// What dense.cu and experts.cu share: integer types, exact float32 arithmetic, byte permute, cp.async, and the
// programmatic-dependent-launch entry every kernel begins with. compile.py inlines this file where a .cu says
// #include "common.cuh" (so the cubin cache key covers it); nvcc finds it beside the source.
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

// Programmatic dependent launch (lane/kernels/launch.py): a kernel may be resident before its predecessor in the
// stream has finished. PDL_WAIT: until the predecessor has completed and its writes are visible (nothing the
// predecessor writes may be read before it); PDL_TRIGGER: this kernel's dependent may launch. A kernel can issue
// loads of what no predecessor writes (weights) before its PDL_WAIT. Under a normal launch both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_WAIT() do { } while (0)
#define PDL_TRIGGER() do { } while (0)
#endif
#define PDL_ENTRY() do { PDL_WAIT(); PDL_TRIGGER(); } while (0)

// exact float32 arithmetic: IEEE round-to-nearest-even as explicit PTX, so --fmad / -ftz cannot change a bit
__device__ __forceinline__ float f_add(float a, float b) { float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float f_sub(float a, float b) { float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float f_mul(float a, float b) { float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float f_div(float a, float b) { float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) { u32 r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s)); return r; }

__device__ __forceinline__ void cp_async16(u32 saddr, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
