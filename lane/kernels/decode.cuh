// Weight decoding for every GGUF tensor type stratad reads: one decode per quantised type of a block's canonical
// 32-value sub-block (docs/quant-types.md: value = scale * q - minimum * mweight, q = fold * code), and from it
// the float decode, equal bit for bit to stratad.model.quants.dequantize. Written once as __host__ __device__
// code: the GPU kernels include it (matvec.cu, gemm.cu, embedding.cu), and tests/test_decode_cuh.py compiles it
// for the host with g++ and compares it with the numpy units on every type. It depends on nothing else.
//
// The IQ types' tables (grids, ksigns, the IQ4 values) are one byte blob `tab` passed by pointer (device memory
// on the GPU, a host array in the test), laid out as the DQ_TAB_* offsets say; lane/kernels/decode_tables.py
// builds it from the gguf package's copies of the tables (the format's own), reading these offsets.
#ifndef STRATAD_DECODE_CUH
#define STRATAD_DECODE_CUH

#ifndef __CUDACC__  // a host compiler: the qualifiers mean nothing there
#define __host__
#define __device__
#define __forceinline__ inline
#endif
#define DQ_FN __host__ __device__ __forceinline__

// GGML type codes (gguf's GGMLQuantizationType) and the names the per-type kernels carry (X(name, code))
#define DQ_QUANT_TYPES(X)                                                                                        \
    X(q4_0, 2) X(q4_1, 3) X(q5_0, 6) X(q5_1, 7) X(q8_0, 8) X(q2_k, 10) X(q3_k, 11) X(q4_k, 12) X(q5_k, 13)          \
    X(q6_k, 14) X(iq2_xxs, 16) X(iq2_xs, 17) X(iq3_xxs, 18) X(iq1_s, 19) X(iq4_nl, 20) X(iq3_s, 21) X(iq2_s, 22)   \
    X(iq4_xs, 23) X(iq1_m, 29) X(mxfp4, 39)
#define DQ_FLOAT_TYPES(X) X(f32, 0) X(f16, 1) X(bf16, 30)
#define DQ_ALL_TYPES(X) DQ_FLOAT_TYPES(X) DQ_QUANT_TYPES(X)

// the table blob: int8 grids (entries x values), ggml's ksigns_iq2xs, the IQ4 values, MXFP4's doubled E2M1 values
// (IQ1_S and IQ1_M share a grid)
#define DQ_TAB_IQ2XXS 0      // 256 x 8
#define DQ_TAB_IQ2XS 2048    // 512 x 8
#define DQ_TAB_IQ2S 6144     // 1024 x 8
#define DQ_TAB_IQ3XXS 14336  // 256 x 4
#define DQ_TAB_IQ3S 15360    // 512 x 4
#define DQ_TAB_IQ1 17408     // 2048 x 8
#define DQ_TAB_KSIGNS 33792  // 128
#define DQ_TAB_IQ4NL 33920   // 16
#define DQ_TAB_MXFP4 33936   // 16
#define DQ_TAB_BYTES 33952

typedef unsigned char dq_u8;
typedef unsigned short dq_u16;
typedef unsigned int dq_u32;

// ---- exact float32 arithmetic: explicit round-to-nearest PTX on the device (no --fmad / -ftz effect), plain
// IEEE float on the host (the test compiles with -ffp-contract=off) --------------------------------------------
DQ_FN float dq_bits(dq_u32 u) {
#ifdef __CUDA_ARCH__
    return __int_as_float((int)u);
#else
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
#endif
}
DQ_FN dq_u32 dq_fbits(float f) {
#ifdef __CUDA_ARCH__
    return (dq_u32)__float_as_int(f);
#else
    dq_u32 u;
    __builtin_memcpy(&u, &f, 4);
    return u;
#endif
}
// one float32 operation, rounded on its own (never fused into an FMA)
#ifdef __CUDA_ARCH__
#define DQ_RN_OP(name, ptx, op)                                             \
    DQ_FN float name(float a, float b) {                                    \
        float r;                                                            \
        asm(ptx " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                 \
        return r;                                                           \
    }
#else
#define DQ_RN_OP(name, ptx, op) \
    DQ_FN float name(float a, float b) { return a op b; }
#endif
DQ_RN_OP(dq_mul, "mul.rn.f32", *)
DQ_RN_OP(dq_sub, "sub.rn.f32", -)
DQ_RN_OP(dq_add, "add.rn.f32", +)
// f16 bits -> float32 (exact: every f16 is a float32; NaN stays NaN)
DQ_FN float dq_h2f(dq_u16 h) {
#ifdef __CUDA_ARCH__
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
#else
    const dq_u32 s = (dq_u32)(h >> 15) << 31, e = (h >> 10) & 31;
    dq_u32 m = h & 1023;
    if (e == 31) return dq_bits(s | 0x7f800000u | (m << 13));
    if (e) return dq_bits(s | ((e + 112) << 23) | (m << 13));
    if (!m) return dq_bits(s);
    int k = 113;  // a subnormal: shift the leading one to the implicit bit
    while (!(m & 1024)) { m <<= 1; --k; }
    return dq_bits(s | ((dq_u32)k << 23) | ((m & 1023) << 13));
#endif
}
DQ_FN float dq_i2f(int v) { return (float)v; }  // |v| <= 4096 here: exact either way

// little-endian fields of a block (blocks are only byte-aligned)
DQ_FN dq_u32 dq_rd16(const dq_u8* p) { return (dq_u32)p[0] | ((dq_u32)p[1] << 8); }
DQ_FN dq_u32 dq_rd32(const dq_u8* p) { return dq_rd16(p) | (dq_rd16(p + 2) << 16); }
DQ_FN float dq_f16(const dq_u8* p) { return dq_h2f((dq_u16)dq_rd16(p)); }
// a u16 / u32 at p aligned to its size: one load on the device
template <class T> DQ_FN dq_u32 dq_aligned(const dq_u8* p) {
#ifdef __CUDA_ARCH__
    return *(const T*)p;
#else
    return sizeof(T) == 2 ? dq_rd16(p) : dq_rd32(p);
#endif
}
DQ_FN int dq_grid(const dq_u8* tab, int off) { return (int)(signed char)tab[off]; }
DQ_FN int dq_sign8(const dq_u8* tab, int sidx, int bit) {  // ksigns[sidx]'s bit: -1 where set
    return ((tab[DQ_TAB_KSIGNS + sidx] >> bit) & 1) ? -1 : 1;
}

// ---- one canonical sub-block ----------------------------------------------------------------------------------
// q_v = fold[v / 16] * code[v] (decode_int's q); value_v = scale * q_v [- minimum [* mw[v / 16]]]. fold and mw are
// the per-16 integer factors of the types with 16-value scales (else 1); FOLD_FLOAT types (Q3_K, Q6_K) decode
// floats as ggml does, (scale * fold) * code.
struct DqSub {
    int code[32];
    int fold[2];
    int mw[2];
    float scale, minimum;
};

enum { DQ_NO_MIN = 0, DQ_MIN = 1, DQ_MIN_WEIGHTED = 2 };

// BV / BB: values / bytes per block; MIN: the minimum's kind; FOLD_FLOAT: the float decode's order (above)
template <int QT> struct DqTraits;
#define DQ_TRAITS(QT, BV_, BB_, MIN_, FF_)                                                                      \
    template <> struct DqTraits<QT> {                                                                           \
        static constexpr int BV = BV_, BB = BB_, NSUB = BV_ / 32, MIN = MIN_;                                   \
        static constexpr bool FOLD_FLOAT = FF_, QUANT = true;                                                   \
    };
DQ_TRAITS(2, 32, 18, DQ_NO_MIN, false)         // Q4_0
DQ_TRAITS(3, 32, 20, DQ_MIN, false)            // Q4_1
DQ_TRAITS(6, 32, 22, DQ_NO_MIN, false)         // Q5_0
DQ_TRAITS(7, 32, 24, DQ_MIN, false)            // Q5_1
DQ_TRAITS(8, 32, 34, DQ_NO_MIN, false)         // Q8_0
DQ_TRAITS(10, 256, 84, DQ_MIN_WEIGHTED, false) // Q2_K
DQ_TRAITS(11, 256, 110, DQ_NO_MIN, true)       // Q3_K
DQ_TRAITS(12, 256, 144, DQ_MIN, false)         // Q4_K
DQ_TRAITS(13, 256, 176, DQ_MIN, false)         // Q5_K
DQ_TRAITS(14, 256, 210, DQ_NO_MIN, true)       // Q6_K
DQ_TRAITS(16, 256, 66, DQ_NO_MIN, false)       // IQ2_XXS
DQ_TRAITS(17, 256, 74, DQ_NO_MIN, false)       // IQ2_XS
DQ_TRAITS(18, 256, 98, DQ_NO_MIN, false)       // IQ3_XXS
DQ_TRAITS(19, 256, 50, DQ_NO_MIN, false)       // IQ1_S
DQ_TRAITS(20, 32, 18, DQ_NO_MIN, false)        // IQ4_NL
DQ_TRAITS(21, 256, 110, DQ_NO_MIN, false)      // IQ3_S
DQ_TRAITS(22, 256, 82, DQ_NO_MIN, false)       // IQ2_S
DQ_TRAITS(23, 256, 136, DQ_NO_MIN, false)      // IQ4_XS
DQ_TRAITS(29, 256, 56, DQ_NO_MIN, false)       // IQ1_M
DQ_TRAITS(39, 32, 17, DQ_NO_MIN, false)        // MXFP4
#undef DQ_TRAITS
// float element types: BB bytes a value, decoded one value at a time
#define DQ_FLOAT_TRAITS(QT, BB_)                                                                                \
    template <> struct DqTraits<QT> {                                                                           \
        static constexpr int BV = 1, BB = BB_;                                                                  \
        static constexpr bool QUANT = false;                                                                    \
    };
DQ_FLOAT_TRAITS(0, 4)   // F32
DQ_FLOAT_TRAITS(1, 2)   // F16
DQ_FLOAT_TRAITS(30, 2)  // BF16
#undef DQ_FLOAT_TRAITS

template <class S> DQ_FN void dq_plain(S& s, float scale) {  // S: DqSub, or expert_term.cuh's XtW
    s.scale = scale;
    s.minimum = 0.f;
    s.fold[0] = s.fold[1] = s.mw[0] = s.mw[1] = 1;
}

// decode sub-block j (0 .. NSUB - 1) of the block at b: one specialisation per type, the layouts of
// ggml-common.h as stratad/model/quants unpacks them (the comments name the numpy view each follows)
template <int QT> DQ_FN void dq_sub(const dq_u8* b, int j, const dq_u8* tab, DqSub& s);

// ggml's 4-bit layout in 32-value blocks: value v < 16 the low nibble of byte v, else the high nibble of v - 16
DQ_FN int dq_nib32(const dq_u8* qs, int v) { return (qs[v & 15] >> (v & 16 ? 4 : 0)) & 15; }

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL: the block's scale d, and (Q4_1, Q5_1) its minimum, -m (also
// expert_term.cuh's word decoders')
template <class S> DQ_FN void dq_legacy_head(const dq_u8* b, bool has_min, S& s) {
    dq_plain(s, dq_f16(b));
    if (has_min) s.minimum = -dq_f16(b + 2);
}
template <> DQ_FN void dq_sub<2>(const dq_u8* b, int, const dq_u8*, DqSub& s) {  // Q4_0: code - 8
    dq_legacy_head(b, false, s);
    for (int v = 0; v < 32; ++v) s.code[v] = dq_nib32(b + 2, v) - 8;
}
template <> DQ_FN void dq_sub<3>(const dq_u8* b, int, const dq_u8*, DqSub& s) {  // Q4_1: minimum = -m
    dq_legacy_head(b, true, s);
    for (int v = 0; v < 32; ++v) s.code[v] = dq_nib32(b + 4, v);
}
template <> DQ_FN void dq_sub<6>(const dq_u8* b, int, const dq_u8*, DqSub& s) {  // Q5_0: 5-bit code - 16
    dq_legacy_head(b, false, s);
    const dq_u32 qh = dq_rd32(b + 2);
    for (int v = 0; v < 32; ++v) s.code[v] = (dq_nib32(b + 6, v) | (((qh >> v) & 1) << 4)) - 16;
}
template <> DQ_FN void dq_sub<7>(const dq_u8* b, int, const dq_u8*, DqSub& s) {  // Q5_1
    dq_legacy_head(b, true, s);
    const dq_u32 qh = dq_rd32(b + 4);
    for (int v = 0; v < 32; ++v) s.code[v] = dq_nib32(b + 8, v) | (((qh >> v) & 1) << 4);
}
template <> DQ_FN void dq_sub<8>(const dq_u8* b, int, const dq_u8*, DqSub& s) {  // Q8_0
    dq_plain(s, dq_f16(b));
    for (int v = 0; v < 32; ++v) s.code[v] = (signed char)b[2 + v];
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and minimum (kquants._scale_min_k4), scale = d sc, minimum = dmin m
DQ_FN void dq_k4_scale_min(const dq_u8* b, int j, int& sc, int& mn) {
    const dq_u8* q = b + 4;
    if (j < 4) {
        sc = q[j] & 63;
        mn = q[4 + j] & 63;
    } else {
        sc = (q[4 + j] & 15) | ((q[j - 4] >> 2) & 0x30);
        mn = (q[4 + j] >> 4) | ((q[j] >> 2) & 0x30);
    }
}
template <class S> DQ_FN void dq_k4_scales(const dq_u8* b, int j, S& s) {  // Q4_K / Q5_K (expert_term.cuh's too)
    int sc, mn;
    dq_k4_scale_min(b, j, sc, mn);
    dq_plain(s, dq_mul(dq_f16(b), dq_i2f(sc)));
    s.minimum = dq_mul(dq_f16(b + 2), dq_i2f(mn));
}
// K-quants' 4-bit codes: in 64-value groups over 32 bytes, the low nibbles then the high ones
DQ_FN int dq_knib(const dq_u8* qs, int j, int i) { return (qs[(j >> 1) * 32 + i] >> (4 * (j & 1))) & 15; }
template <> DQ_FN void dq_sub<12>(const dq_u8* b, int j, const dq_u8*, DqSub& s) {  // Q4_K
    dq_k4_scales(b, j, s);
    for (int i = 0; i < 32; ++i) s.code[i] = dq_knib(b + 16, j, i);
}
template <> DQ_FN void dq_sub<13>(const dq_u8* b, int j, const dq_u8*, DqSub& s) {  // Q5_K: high bit j of byte i
    dq_k4_scales(b, j, s);
    for (int i = 0; i < 32; ++i) s.code[i] = dq_knib(b + 48, j, i) | (((b[16 + i] >> j) & 1) << 4);
}
// 2-bit fields in 128-value groups over 32 bytes: field (j % 4) of byte i of group j / 4
DQ_FN int dq_k2(const dq_u8* qs, int j, int i) { return (qs[(j >> 2) * 32 + i] >> (2 * (j & 3))) & 3; }
template <class S> DQ_FN void dq_q2k_head(const dq_u8* b, int j, S& s) {  // Q2_K's scales, minimum weights
    dq_plain(s, dq_f16(b + 80));
    s.minimum = dq_f16(b + 82);
    for (int h = 0; h < 2; ++h) {
        s.fold[h] = b[2 * j + h] & 15;
        s.mw[h] = b[2 * j + h] >> 4;
    }
}
template <> DQ_FN void dq_sub<10>(const dq_u8* b, int j, const dq_u8*, DqSub& s) {  // Q2_K: q = sc * code
    dq_q2k_head(b, j, s);
    for (int i = 0; i < 32; ++i) s.code[i] = dq_k2(b + 16, j, i);
}
template <class S> DQ_FN void dq_q3k_head(const dq_u8* b, int j, S& s) {  // Q3_K's scale and 6-bit folds (also
    dq_plain(s, dq_f16(b + 108));                                          // expert_term.cuh's word decoder's)
    const dq_u8* sc = b + 96;
    for (int h = 0; h < 2; ++h) {
        const int k = 2 * j + h;
        const int lo = (sc[k & 7] >> (k & 8 ? 4 : 0)) & 15, hi = (sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
        s.fold[h] = (lo | (hi << 4)) - 32;
    }
}
template <> DQ_FN void dq_sub<11>(const dq_u8* b, int j, const dq_u8*, DqSub& s) {  // Q3_K: q = (sc - 32) * code
    dq_q3k_head(b, j, s);
    for (int i = 0; i < 32; ++i) s.code[i] = dq_k2(b + 32, j, i) - ((((b[i] >> j) & 1) ^ 1) << 2);
}
template <class S> DQ_FN void dq_q6k_head(const dq_u8* b, int j, S& s) {  // Q6_K's scale and int8 folds
    dq_plain(s, dq_f16(b + 208));
    for (int h = 0; h < 2; ++h) s.fold[h] = (signed char)b[192 + 2 * j + h];
}
template <> DQ_FN void dq_sub<14>(const dq_u8* b, int j, const dq_u8*, DqSub& s) {  // Q6_K: q = sc * (code - 32)
    dq_q6k_head(b, j, s);
    const int g = j >> 2, r = j & 3;
    for (int i = 0; i < 32; ++i) {
        const int lo = (b[g * 64 + (r & 1) * 32 + i] >> (4 * (r >> 1))) & 15;
        const int hi = (b[128 + g * 32 + i] >> (2 * r)) & 3;
        s.code[i] = (lo | (hi << 4)) - 32;
    }
}

template <> DQ_FN void dq_sub<20>(const dq_u8* b, int, const dq_u8* tab, DqSub& s) {  // IQ4_NL: kvalues[code]
    dq_legacy_head(b, false, s);
    for (int v = 0; v < 32; ++v) s.code[v] = dq_grid(tab, DQ_TAB_IQ4NL + dq_nib32(b + 2, v));
}
// MXFP4: scale 2^(e - 128) from its bits (e < 2: a subnormal), q = the doubled E2M1 value of the code
template <class S> DQ_FN void dq_mxfp4_head(const dq_u8* b, S& s) {
    const dq_u32 e = b[0];
    dq_plain(s, dq_bits(e < 2u ? 0x00200000u << e : (e - 1u) << 23));
}
template <> DQ_FN void dq_sub<39>(const dq_u8* b, int, const dq_u8* tab, DqSub& s) {
    dq_mxfp4_head(b, s);
    for (int v = 0; v < 32; ++v) s.code[v] = dq_grid(tab, DQ_TAB_MXFP4 + dq_nib32(b + 1, v));
}
template <class S> DQ_FN void dq_iq4xs_head(const dq_u8* b, int j, S& s) {  // IQ4_XS: d (ls - 32), ls of 6 bits
    const int lo = (b[4 + (j >> 1)] >> (4 * (j & 1))) & 15, hi = (dq_rd16(b + 2) >> (2 * j)) & 3;
    dq_plain(s, dq_mul(dq_f16(b), dq_i2f((lo | (hi << 4)) - 32)));
}
template <> DQ_FN void dq_sub<23>(const dq_u8* b, int j, const dq_u8* tab, DqSub& s) {  // IQ4_XS: d (ls - 32)
    dq_iq4xs_head(b, j, s);
    for (int v = 0; v < 32; ++v) s.code[v] = dq_grid(tab, DQ_TAB_IQ4NL + dq_nib32(b + 8 + 16 * j, v));
}
// The scale (and folds) of sub-block j of the IQ types: their dq_sub's, and expert_term.cuh's word decoders'
// (each returns the field its codes read too)
template <class S> DQ_FN dq_u32 dq_iq3xxs_head(const dq_u8* b, int j, S& s) {
    const dq_u32 w = dq_rd32(b + 66 + 4 * j);  // 4 x 7 sign bits, then the 4-bit scale
    dq_plain(s, dq_mul(dq_mul(dq_f16(b), dq_add(0.5f, dq_i2f((int)(w >> 28)))), 0.5f));
    return w;
}
template <class S> DQ_FN dq_u32 dq_iq2xxs_head(const dq_u8* b, int j, S& s) {
    const dq_u32 w1 = dq_rd32(b + 2 + 8 * j + 4);  // after the 4 grid index bytes: signs, then the scale
    dq_plain(s, dq_mul(dq_mul(dq_f16(b), dq_add(0.5f, dq_i2f((int)(w1 >> 28)))), 0.25f));
    return w1;
}
// IQ2_XS / IQ2_S: scale d / 8, fold 2 ls + 1 (ls the 4-bit scale at `scales`, one nibble per 16 values)
template <class S> DQ_FN void dq_iq2_scales(const dq_u8* b, int j, const dq_u8* scales, S& s) {
    dq_plain(s, dq_mul(dq_f16(b), 0.125f));
    for (int h = 0; h < 2; ++h) s.fold[h] = 2 * ((scales[j] >> (4 * h)) & 15) + 1;
}
template <class S> DQ_FN dq_u32 dq_iq1s_head(const dq_u8* b, int j, S& s) {
    // (IQ1's fields, read as aligned 16-bit words: IQ1_S / IQ1_M blocks are 50 / 56 bytes, rows start even)
    const dq_u32 qh = dq_aligned<dq_u16>(b + 34 + 2 * j);  // 4 x 3 index bits, the 3-bit scale, the delta's sign
    dq_plain(s, dq_mul(dq_mul(dq_h2f((dq_u16)dq_aligned<dq_u16>(b)), dq_i2f(2 * ((qh >> 12) & 7) + 1)), 0.125f));
    return qh;
}
template <class S> DQ_FN void dq_iq1m_head(const dq_u8* b, int j, S& s) {
    // d: the top nibbles of the four scale words (iquants._iq1m_d)
    const dq_u32 w0 = dq_aligned<dq_u16>(b + 48), w1 = dq_aligned<dq_u16>(b + 50), w2 = dq_aligned<dq_u16>(b + 52),
                 w3 = dq_aligned<dq_u16>(b + 54);
    const dq_u32 h = (w0 >> 12) | ((w1 >> 8) & 0x00F0) | ((w2 >> 4) & 0x0F00) | (w3 & 0xF000);
    dq_plain(s, dq_mul(dq_h2f((dq_u16)h), 0.125f));
    for (int hh = 0; hh < 2; ++hh) {
        const int k = 2 * j + hh;  // 3-bit scale t of word w: k = 4 w + t
        s.fold[hh] = 2 * ((dq_aligned<dq_u16>(b + 48 + 2 * (k >> 2)) >> (3 * (k & 3))) & 7) + 1;
    }
}

template <> DQ_FN void dq_sub<18>(const dq_u8* b, int j, const dq_u8* tab, DqSub& s) {  // IQ3_XXS
    const dq_u32 w = dq_iq3xxs_head(b, j, s);
    for (int v = 0; v < 32; ++v)
        s.code[v] = dq_grid(tab, DQ_TAB_IQ3XXS + 4 * b[2 + 8 * j + (v >> 2)] + (v & 3)) *
                    dq_sign8(tab, (w >> (7 * (v >> 3))) & 127, v & 7);
}
template <class S> DQ_FN void dq_iq3s_head(const dq_u8* b, int j, S& s) {  // IQ3_S: d (1 + 2 nibble)
    dq_plain(s, dq_mul(dq_f16(b), dq_i2f(1 + 2 * ((b[106 + (j >> 1)] >> (4 * (j & 1))) & 15))));
}
template <> DQ_FN void dq_sub<21>(const dq_u8* b, int j, const dq_u8* tab, DqSub& s) {  // IQ3_S
    dq_iq3s_head(b, j, s);
    for (int v = 0; v < 32; ++v) {
        const int k = 8 * j + (v >> 2);  // grid entry: index bit 8 is bit k % 8 of qh byte k / 8
        const int idx = b[2 + k] | (((b[66 + (k >> 3)] >> (k & 7)) & 1) << 8);
        const int t = 32 * j + v;  // sign bit t % 8 of byte t / 8
        s.code[v] = dq_grid(tab, DQ_TAB_IQ3S + 4 * idx + (v & 3)) * (((b[74 + (t >> 3)] >> (t & 7)) & 1) ? -1 : 1);
    }
}
template <> DQ_FN void dq_sub<16>(const dq_u8* b, int j, const dq_u8* tab, DqSub& s) {  // IQ2_XXS
    const dq_u32 w1 = dq_iq2xxs_head(b, j, s);
    for (int v = 0; v < 32; ++v)
        s.code[v] = dq_grid(tab, DQ_TAB_IQ2XXS + 8 * b[2 + 8 * j + (v >> 3)] + (v & 7)) *
                    dq_sign8(tab, (w1 >> (7 * (v >> 3))) & 127, v & 7);
}
template <> DQ_FN void dq_sub<17>(const dq_u8* b, int j, const dq_u8* tab, DqSub& s) {  // IQ2_XS
    dq_iq2_scales(b, j, b + 66, s);
    for (int v = 0; v < 32; ++v) {
        const dq_u32 w = dq_rd16(b + 2 + 2 * (4 * j + (v >> 3)));  // 9-bit grid index, 7-bit sign index
        s.code[v] = dq_grid(tab, DQ_TAB_IQ2XS + 8 * (w & 511) + (v & 7)) * dq_sign8(tab, w >> 9, v & 7);
    }
}
template <> DQ_FN void dq_sub<22>(const dq_u8* b, int j, const dq_u8* tab, DqSub& s) {  // IQ2_S
    dq_iq2_scales(b, j, b + 74, s);
    for (int v = 0; v < 32; ++v) {
        const int k = 4 * j + (v >> 3);  // index bits 8-9: field k % 4 of qh byte k / 4
        const int idx = b[2 + k] | (((b[66 + (k >> 2)] >> (2 * (k & 3))) & 3) << 8);
        const int t = 32 * j + v;
        s.code[v] = dq_grid(tab, DQ_TAB_IQ2S + 8 * idx + (v & 7)) * (((b[34 + (t >> 3)] >> (t & 7)) & 1) ? -1 : 1);
    }
}
template <> DQ_FN void dq_sub<19>(const dq_u8* b, int j, const dq_u8* tab, DqSub& s) {  // IQ1_S: q = 8 g +- 1
    const dq_u32 qh = dq_iq1s_head(b, j, s);
    const int delta = (qh & 0x8000) ? -1 : 1;
    for (int v = 0; v < 32; ++v) {
        const int e = v >> 3, idx = b[2 + 4 * j + e] | (((qh >> (3 * e)) & 7) << 8);
        s.code[v] = 8 * dq_grid(tab, DQ_TAB_IQ1 + 8 * idx + (v & 7)) + delta;
    }
}
template <> DQ_FN void dq_sub<29>(const dq_u8* b, int j, const dq_u8* tab, DqSub& s) {  // IQ1_M
    dq_iq1m_head(b, j, s);
    for (int v = 0; v < 32; ++v) {
        const int k = 4 * j + (v >> 3);  // 8-value group: 3 index bits and the delta's sign in a nibble
        const int qh = (b[32 + (k >> 1)] >> (4 * (k & 1))) & 15, idx = b[k] | ((qh & 7) << 8);
        s.code[v] = 8 * dq_grid(tab, DQ_TAB_IQ1 + 8 * idx + (v & 7)) + ((qh & 8) ? -1 : 1);
    }
}

// ---- what the kernels use --------------------------------------------------------------------------------------

// decode_int's q of value v of a decoded sub-block
DQ_FN int dq_q(const DqSub& s, int v) { return s.fold[v >> 4] * s.code[v]; }

// the float decode of value v of a decoded sub-block (quants.dequantize's bits: each operation rounded on its own)
template <int QT> DQ_FN float dq_value(const DqSub& s, int v) {
    typedef DqTraits<QT> Tr;
    if (Tr::FOLD_FLOAT) return dq_mul(dq_mul(s.scale, dq_i2f(s.fold[v >> 4])), dq_i2f(s.code[v]));
    const float r = dq_mul(s.scale, dq_i2f(dq_q(s, v)));
    if (Tr::MIN == DQ_MIN) return dq_sub(r, s.minimum);
    if (Tr::MIN == DQ_MIN_WEIGHTED) return dq_sub(r, dq_mul(s.minimum, dq_i2f(s.mw[v >> 4])));
    return r;
}

// Sub-block s of a row packed for the mat-vec (matvec.cuh RqBlk, weights.RQ_FORMATS): ns float32 scales (one for
// the 32 values, or one a 16-value half), nm float32 minimums (none, or one a scale), then the 32 codes as int8;
// value v = scale[h] * code_v - minimum[h] (h: v's half where ns = 2). scale[h] = scale * fold[h] and
// minimum[h] = minimum * mw[h] are exact in float32, so these are dq_value's numbers (a -0.0 of Q3_K / Q6_K reads
// as +0.0). (ns, nm) is the type's own format or a wider one (a stack of types packed alike).
template <int QT> DQ_FN void rq_pack(const dq_u8* row, int s, const dq_u8* tab, int ns, int nm, dq_u8* out) {
    typedef DqTraits<QT> Tr;
    DqSub d;
    dq_sub<QT>(row + (s / Tr::NSUB) * Tr::BB, s % Tr::NSUB, tab, d);
    float f[4];
    for (int h = 0; h < ns; ++h) f[h] = dq_mul(d.scale, dq_i2f(d.fold[h]));
    for (int h = 0; h < nm; ++h)
        f[ns + h] = Tr::MIN == DQ_MIN_WEIGHTED ? dq_mul(d.minimum, dq_i2f(d.mw[nm == 2 ? h : 0])) : d.minimum;
    for (int k = 0; k < ns + nm; ++k) {
        const dq_u32 u = dq_fbits(f[k]);
        for (int i = 0; i < 4; ++i) out[4 * k + i] = (dq_u8)(u >> (8 * i));
    }
    for (int v = 0; v < 32; ++v) out[4 * (ns + nm) + v] = (dq_u8)d.code[v];
}

// ---- a part of a packed block, read from the file's block -----------------------------------------------------
// Part p (values 8p .. 8p + 7) of sub-block j of the block at b with rq_pack's numbers in the type's own format:
// the scale of the part's 16-value half, its minimum (0 where the format has none) and its 8 codes as int8 in two
// little-endian words. The mat-vec that reads these types' rows as the file holds them (matvec.cuh FileBlk) runs
// the packed rows' term on them, so it gives the packed mat-vec's bits while reading the file's bytes (0.43-0.82 a
// weight against 1.125-1.25 packed). Blocks are 2-byte aligned there (rows of 110- and 210-byte blocks staged from
// a 16-byte boundary; Q4_K's and Q5_K's 144- and 176-byte blocks 16-byte aligned), and no word read passes a
// block's end.
#define RQ_PART_TYPES(X) X(q4_k, 12) X(q5_k, 13) X(q6_k, 14) X(iq3_s, 21)  // the types with an rq_part
struct RqPart {
    float scale, minimum;
    dq_u32 qa, qb;
};
// tab: the type's table (RqTab: none, or IQ3_S's grid, a part of the blob), which the mat-vec copies to shared
// memory: a warp's 32 grid reads at random spread over ~14 cache lines, ~14 L1 wavefronts from global memory
// against ~3.5 bank-conflict ways from shared memory
template <int QT> DQ_FN RqPart rq_part(const dq_u8* b, int j, int p, const dq_u8* tab);
template <int QT> struct RqTab {
    static constexpr int OFF = 0, BYTES = 0;
};
template <> struct RqTab<21> {
    static constexpr int OFF = DQ_TAB_IQ3S, BYTES = 512 * 4;
};

// the u32 at 2-byte aligned p: two aligned words and a funnel shift on the device (the second word is read even
// where p is 4-byte aligned, so 4 bytes past the field must be in the block)
DQ_FN dq_u32 dq_w32(const dq_u8* p) {
#ifdef __CUDA_ARCH__
    const dq_u32 off = (dq_u32)(unsigned long long)p & 3u;  // stepping back keeps the pointer's state space
    const dq_u32* a = (const dq_u32*)(p - off);
    return __funnelshift_r(a[0], a[1], 8u * off);
#else
    return dq_rd32(p);
#endif
}
// bits 0-3 of s as the low bits of bytes 0-3 (bit i to bit 8 i): one multiply spreads them, a mask keeps them
DQ_FN dq_u32 dq_bit_bytes(dq_u32 s) { return ((s & 15u) * 0x00204081u) & 0x01010101u; }
// the int8 of g (magnitudes 1..127) negated where bits 0-3 of s say (bit i: byte i): two's complement (v ^ 0xff) + 1
// a byte, which cannot carry out of it
DQ_FN dq_u32 dq_neg4(dq_u32 g, dq_u32 s) {
    const dq_u32 m = dq_bit_bytes(s) * 0xffu;
    return (g ^ m) + (m & 0x01010101u);
}

template <> DQ_FN RqPart rq_part<21>(const dq_u8* b, int j, int p, const dq_u8* tab) {  // IQ3_S: tab its grid
    RqPart o;
    const int nib = (b[106 + (j >> 1)] >> (4 * (j & 1))) & 15;
    o.scale = dq_mul(dq_h2f((dq_u16)dq_aligned<dq_u16>(b)), dq_i2f(1 + 2 * nib));
    o.minimum = 0.f;
    const dq_u32 qs = dq_aligned<dq_u16>(b + 2 + 8 * j + 2 * p);  // the part's two grid entries, index bit 8 from qh
    const dq_u32 qh = (dq_u32)b[66 + j] >> (2 * p);
    const dq_u32 sg = b[74 + 4 * j + p];  // the part's 8 sign bits
    o.qa = dq_neg4(dq_aligned<dq_u32>(tab + 4 * ((qs & 255u) | ((qh & 1u) << 8))), sg & 15u);
    o.qb = dq_neg4(dq_aligned<dq_u32>(tab + 4 * ((qs >> 8) | ((qh & 2u) << 7))), sg >> 4);
    return o;
}
// Q4_K / Q5_K: scale = d sc, minimum = dmin m (dq_k4_scales' numbers)
DQ_FN RqPart dq_k4_part(const dq_u8* b, int j) {
    RqPart o;
    int sc, mn;
    dq_k4_scale_min(b, j, sc, mn);
    o.scale = dq_mul(dq_h2f((dq_u16)dq_rd16(b)), dq_i2f(sc));
    o.minimum = dq_mul(dq_h2f((dq_u16)dq_rd16(b + 2)), dq_i2f(mn));
    return o;
}
template <> DQ_FN RqPart rq_part<12>(const dq_u8* b, int j, int p, const dq_u8*) {  // Q4_K
    RqPart o = dq_k4_part(b, j);
    const dq_u8* q = b + 16 + 32 * (j >> 1) + 8 * p;
    const int sh = 4 * (j & 1);
    o.qa = (dq_aligned<dq_u32>(q) >> sh) & 0x0f0f0f0fu;
    o.qb = (dq_aligned<dq_u32>(q + 4) >> sh) & 0x0f0f0f0fu;
    return o;
}
template <> DQ_FN RqPart rq_part<13>(const dq_u8* b, int j, int p, const dq_u8*) {  // Q5_K: high bit j of byte i
    RqPart o = dq_k4_part(b, j);
    const dq_u8* q = b + 48 + 32 * (j >> 1) + 8 * p;
    const dq_u8* h = b + 16 + 8 * p;
    const int sh = 4 * (j & 1);
    const dq_u32 lo = 0x0f0f0f0fu, bit = 0x01010101u;  // a 16-byte aligned block: word loads
    o.qa = ((dq_aligned<dq_u32>(q) >> sh) & lo) | (((dq_aligned<dq_u32>(h) >> j) & bit) << 4);
    o.qb = ((dq_aligned<dq_u32>(q + 4) >> sh) & lo) | (((dq_aligned<dq_u32>(h + 4) >> j) & bit) << 4);
    return o;
}
// Q6_K's code - 32 a byte from 4 low bits and 2 high ones: c ^ 32 is it where c >= 32; below, bits 6 and 7 are set
DQ_FN dq_u32 dq_q6(dq_u32 lo, dq_u32 hi, int r) {
    const dq_u32 c = ((lo >> (4 * (r >> 1))) & 0x0f0f0f0fu) | (((hi >> (2 * r)) & 0x03030303u) << 4);
    const dq_u32 x = c ^ 0x20202020u;
    return x | ((x & 0x20202020u) * 6u);
}
template <> DQ_FN RqPart rq_part<14>(const dq_u8* b, int j, int p, const dq_u8*) {  // Q6_K
    RqPart o;
    const int g = j >> 2, r = j & 3;
    o.scale = dq_mul(dq_h2f((dq_u16)dq_aligned<dq_u16>(b + 208)), dq_i2f((signed char)b[192 + 2 * j + (p >> 1)]));
    o.minimum = 0.f;
    const dq_u8* lo = b + 64 * g + 32 * (r & 1) + 8 * p;
    const dq_u8* hi = b + 128 + 32 * g + 8 * p;
    o.qa = dq_q6(dq_w32(lo), dq_w32(hi), r);
    o.qb = dq_q6(dq_w32(lo + 4), dq_w32(hi + 4), r);
    return o;
}

// a float element type's value at byte p
template <int QT> DQ_FN float dq_float_elem(const dq_u8* p);
template <> DQ_FN float dq_float_elem<0>(const dq_u8* p) { return dq_bits(dq_rd32(p)); }
template <> DQ_FN float dq_float_elem<1>(const dq_u8* p) { return dq_f16(p); }
template <> DQ_FN float dq_float_elem<30>(const dq_u8* p) { return dq_bits(dq_rd16(p) << 16); }

// Values [SPAN s, SPAN s + SPAN) of a row (row: its first byte) as floats: SPAN = 32 (one sub-block) for the
// quantised types, 1 for the float types.
template <int QT, bool Q = DqTraits<QT>::QUANT> struct DqSpan;
template <int QT> struct DqSpan<QT, true> {
    static constexpr int SPAN = 32;
    static DQ_FN void decode(const dq_u8* row, long long s, const dq_u8* tab, float* out) {
        typedef DqTraits<QT> Tr;
        DqSub d;
        dq_sub<QT>(row + (s / Tr::NSUB) * Tr::BB, (int)(s % Tr::NSUB), tab, d);
        for (int v = 0; v < 32; ++v) out[v] = dq_value<QT>(d, v);
    }
};
template <int QT> struct DqSpan<QT, false> {
    static constexpr int SPAN = 1;
    static DQ_FN void decode(const dq_u8* row, long long s, const dq_u8*, float* out) {
        out[0] = dq_float_elem<QT>(row + s * DqTraits<QT>::BB);
    }
};

#endif  // STRATAD_DECODE_CUH
