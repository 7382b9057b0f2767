// What the dense ops share: GGML type codes of the fast paths, exact float helpers, streaming loads, int8 lanes as
// exact floats, warp sums. Every dense .cu includes it after common.cuh (compile.py inlines both); the weight
// decoding of every type is decode.cuh's.
#define QT_F32 0
#define QT_F16 1
#define QT_Q8_0 8
#define QT_BF16 30


// ---- exact float helpers (explicit rounding; --fmad cannot touch them) --------------------------------------
__device__ __forceinline__ float f_sqrt(float a) { float r; asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a)); return r; }
__device__ __forceinline__ float f_fma(float a, float b, float c) { float r; asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c)); return r; }
__device__ __forceinline__ float f_ex2(float a) { float r; asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(a)); return r; }
__device__ __forceinline__ float h2f(u16 h) { float r; asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h)); return r; }
__device__ __forceinline__ u16 f2h(float f) { u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
__device__ __forceinline__ u16 f2bf(float f) { u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
__device__ __forceinline__ float bf2f(u32 b) { return __int_as_float(b << 16); }
// pack two floats into f16x2: lo in bits 0..15
__device__ __forceinline__ u32 pack_h2(float lo, float hi) { u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r; }
__device__ __forceinline__ u32 shf_r_clamp(u32 lo, u32 hi, u32 sh) { u32 r; asm("shf.r.clamp.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sh)); return r; }

// streaming 16- and 8-byte loads that leave L1 alone (weights and KV, read once): NC on the non-coherent path (data
// no kernel writes meanwhile), else on the coherent one (data the kernel itself may have written: the fused decode
// step's KV append, which the non-coherent path need not see)
template <bool NC = true>
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    if (NC)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    else
        asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
template <bool NC = true>
__device__ __forceinline__ uint2 ld_stream_u2(const void* p) {
    uint2 r;
    if (NC) asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    else asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ void st_shared_v4(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// int8 lane k of word u (already xor 0x80808080) as an exact float: 2^23 + (q + 128) - (2^23 + 128)
#define MAGIC_BIAS 8388736.0f
__device__ __forceinline__ float i8f(u32 u, u32 k) { return f_sub(__int_as_float(prmt(u, 0x4B000000u, 0x7440u + k)), MAGIC_BIAS); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = f_add(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
