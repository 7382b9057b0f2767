// The fp16 tensor-core helpers both attention kernels use (mma.m16n8k16, fp32 accumulate) and online-softmax
// pieces.
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// max over the 4 lanes of a quad (the lanes holding one row of an mma C fragment)
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// an mma C fragment's rows rescaled (online softmax): row lane / 4 by a, row lane / 4 + 8 by b
__device__ __forceinline__ void rescale_c(float (&c)[4], float a, float b) {
    c[0] = f_mul(c[0], a);
    c[1] = f_mul(c[1], a);
    c[2] = f_mul(c[2], b);
    c[3] = f_mul(c[3], b);
}

// two probabilities exp2(s - m) rounded to an f16x2 (an mma A-fragment register); sum += the rounded values
__device__ __forceinline__ u32 p_h2(float s0, float s1, float m, float& sum) {
    const u32 h = pack_h2(f_ex2(f_sub(s0, m)), f_ex2(f_sub(s1, m)));
    sum = f_add(sum, f_add(h2f((u16)(h & 0xffff)), h2f((u16)(h >> 16))));
    return h;
}
