// What every kernel source shares (the dense ops and experts.cu): integer types, exact float32 arithmetic, the
// experts' input quantisation (rms_norm_rows can produce it), byte permute, cp.async, and the
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

__device__ __forceinline__ float f_rint(float a) { float r; asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a)); return r; }
__device__ __forceinline__ float f_max(float a, float b) { float r; asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float f_abs(float a) { return __int_as_float(__float_as_int(a) & 0x7fffffff); }

// canonical.quantize_act's arithmetic for a group whose largest |value| is m: the scale d = m / 127, its inverse
// (0 where d is 0, or where 1 / d overflows: a subnormal d), and a value's code rint(v / d) as v * inverse
__device__ __forceinline__ float quant_scale(float m) { return f_div(m, 127.0f); }
__device__ __forceinline__ float quant_inv(float dd) {
    const float i1 = (__float_as_int(dd) > 0) ? f_div(1.0f, dd) : 0.0f;  // dd >= 0: positive bits <=> dd > 0
    return __float_as_int(i1) == 0x7f800000 ? 0.0f : i1;
}
__device__ __forceinline__ signed char quant_code(float v, float inv) { return (signed char)(int)f_rint(f_mul(v, inv)); }

// Quantise 32 values held one per lane (canonical.quantize_act on one group): the experts' int8 input. Writes
// q[lane], and *d from lane 0, where `store` (the whole warp runs the shuffles either way: a warp-uniform loop
// whose trip count the compiler cannot see would otherwise get them as divergent collectives)
__device__ __forceinline__ void quant32(float v, int lane, signed char* q, float* d, bool store = true) {
    float m = f_abs(v);
#pragma unroll
    for (int o = 16; o; o >>= 1) m = f_max(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float dd = quant_scale(m);
    if (store) {
        q[lane] = quant_code(v, quant_inv(dd));
        if (lane == 0) *d = dd;
    }
}

// quant32's codes and scale for 4 groups at once: 8 lanes a group, 4 consecutive values a lane (v, at 4 * (lane & 7)
// of group lane / 8). Its maximum is quant32's (max is exact and order-free), so are its bits; 3 shuffles, not 5
__device__ __forceinline__ void quant32x4(float4 v, int lane, signed char* q, float* d, bool store = true) {
    float m = f_max(f_max(f_abs(v.x), f_abs(v.y)), f_max(f_abs(v.z), f_abs(v.w)));
#pragma unroll
    for (int o = 4; o; o >>= 1) m = f_max(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float dd = quant_scale(m);
    if (store) {
        const float inv = quant_inv(dd);
        *reinterpret_cast<char4*>(q + 4 * (lane & 7)) =
            make_char4(quant_code(v.x, inv), quant_code(v.y, inv), quant_code(v.z, inv), quant_code(v.w, inv));
        if ((lane & 7) == 0) *d = dd;
    }
}

// numpy's float32 pairwise sum of one leaf of L <= 128 values (SQ: of their squares) by the 8 lanes j0..j0+7 of a
// warp (j = lane & 7): L < 8 sequentially from 0; else 8 accumulators r[j] = a[j] + a[j+8] + ... over the first
// L - L%8 values, ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)) by xor shuffles (float addition commutes, so every lane holds
// those bits), then the L%8 leftovers in order. Returns the leaf sum in every one of the 8 lanes. L must be the same
// side of 8 across the warp (the shuffles take every lane).
template <bool SQ>
__device__ __forceinline__ float leaf_sum(const float* a, int L, int j) {
    auto v = [&](int i) { return SQ ? f_mul(a[i], a[i]) : a[i]; };
    if (L < 8) {
        float s = 0.f;
        for (int i = 0; i < L; ++i) s = f_add(s, v(i));
        return s;
    }
    const int m = L - (L & 7);
    float r = v(j);
    for (int i = j + 8; i < m; i += 8) r = f_add(r, v(i));
    r = f_add(r, __shfl_xor_sync(0xffffffffu, r, 1));
    r = f_add(r, __shfl_xor_sync(0xffffffffu, r, 2));
    r = f_add(r, __shfl_xor_sync(0xffffffffu, r, 4));
    for (int i = m; i < L; ++i) r = f_add(r, v(i));
    return r;
}

#define NEG_INF __int_as_float(0xff800000)
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) { u32 r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s)); return r; }

// the shared-memory address of a generic pointer to shared memory (for cp.async and st.shared)
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"((u64)p));
    return r;
}
__device__ __forceinline__ void cp_async16(u32 saddr, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 saddr, const void* g) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(saddr), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
