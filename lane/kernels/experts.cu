// stratad GPU expert kernels: bit-exact CUDA versions of stratad/engine/canonical.py.
//
// Exactness (docs/design.md): every float32 operation whose result reaches an output is written as inline PTX with an
// explicit rounding mode and no .ftz (add.rn / sub.rn / mul.rn / div.rn / cvt.rni), so neither --fmad nor -ftz
// nor --prec-div can change a bit. Integer block dots use dp4a (exact). Terms of a row are summed in the
// canonical lane order: virtual lane l adds the terms of sub-blocks l, l+32, ... to 0.0f in order, then lane l +=
// lane l + o for o = 16, 8, 4, 2, 1, which is numpy's half-split fold in canonical.lane_sum. Where the virtual lanes
// live is the kernels' choice (gate/up: a warp's lanes, their sums folded together by fold_many; down: DN_G lanes
// a row, DN_VL virtual lanes each): the same pairs are added, so the bits are the same.
//
// Kernels (persistent: fixed grids whose blocks/warps loop over work items; n_pairs is read on the device, so the
// launches are CUDA-graph safe and blocks past the count do nothing):
//   expert_gateup : warp item = (pair, GU_R rows of d_ff), dealt warp-major over the blocks (H_IN_DOWN); the warp
//                   stages its rows of gate and up in shared memory (cp.async, GU_STAGES items deep), decodes and
//                   dots them with the pair's activation, folds the sums together (fold_many) and writes
//                   h = silu(gate) * up, a lane a row. (H_IN_DOWN 0: block item = (pair, 32-row group), and the
//                   block then quantises the group: qh, dh.) No atomics.
//   expert_down   : block item = (pair, DN_WPB chunks of DN_R rows of d_model): the block quantises the pair's h
//                   into shared memory (H_IN_DOWN; else a warp item, qh read as the gate/up block wrote it), then a
//                   warp a chunk, 32 / DN_R lanes a row; out[p, r] = canonical dot of down row r with qh[p]. With
//                   a decode step's combine folded in (DnCombine): block item = DN_WPB / k chunks of each of the
//                   token's k pairs, whose rows the block's first warp adds to the residual after one barrier.
//   expert_gateup_tiled, expert_down_tiled : the same with an item per tile of up to TILE_P pairs of one expert
//                   (prompt chunks): a staged weight sub-block is decoded once for all of the tile's tokens.
//   expert_gateup_mma, expert_down_mma (experts_mma.cuh): prompt tiles of up to 64 pairs on int8 tensor cores.
//   quantize_rows : x (groups of 32 floats) -> q int8, d float (canonical.quantize_act).
//   combine_k     : out[t, i] = sum_j w[t, j] * y[t, j, i] in router order from 0.0f (canonical.combine).
//   combine_rows  : the same into the residual, rows found through a row map (card results or host rows).
//   build_pairs   : a layer's routed ids -> pair lists per source (card, peers, staging), row map, CPU miss list,
//                   tiles (expert_pairs.cuh, with route_pairs: a decode step's router and pair lists in one warp).
//   ring          : the doorbell the host waits on before serving the CPU misses.
// Within a warp, several rows are decoded and summed as independent chains (ILP); the activation sub-blocks are
// loaded once per item, before waiting for the weights. IQ3_S weights are looked up in a table at shared offset 0
// (each block copies it from grid_g): the decode kernels (IQ3_FAST) read a group of 4 weights with its signs already
// applied from the 32 KB signed grid (16 sign patterns x 512 grid entries: experts.py's signed_grid), one load a
// group; decode_sub, the tiled kernels and experts_mma.cuh read the plain grid (its first 2 KB) and negate bytes.
// The kernels' grid_g argument is that grid for IQ3_S and decode.cuh's table blob for a generic IQ type, of which a
// block copies the type's own part (fill_tab).
//
// Weight formats (GGML type numbers): every expert type of stratad.model.quants. 21 = IQ3_S (110 B / 256), 12 = Q4_K
// (144 B / 256) and 8 = Q8_0 (34 B / 32) have tuned decoders (expert_decode.cuh); every other type takes the generic
// path of expert_term.cuh (dq_sub's codes decoded four a word as int8, or int16 for the float view, the same
// canonical term): the same kernels. Tensor-core prompt tiles for every quantised type (experts_mma.cuh), SIMT
// ones for the float types. Generic types that read decode.cuh's table blob (the IQ types) copy their part of it to
// shared offset 0, where IQ3_S keeps its grid.

#include "common.cuh"
#include "route.cuh"
#include "decode.cuh"
#include "expert_term.cuh"

// ---- compile-time configuration (experts.py passes all of these; defaults allow a standalone nvcc check) ----
#ifndef GU_QT
#define GU_QT 21
#endif
#ifndef GU_KIN
#define GU_KIN 2048
#endif
#ifndef GU_ROWS
#define GU_ROWS 768
#endif
#ifndef DN_QT
#define DN_QT 21
#endif
#ifndef DN_KIN
#define DN_KIN 768
#endif
#ifndef DN_ROWS
#define DN_ROWS 2048
#endif
#ifndef GU_WPB
#define GU_WPB 16
#endif
#ifndef DN_WPB
#define DN_WPB 16
#endif
#ifndef GU_STAGES
#define GU_STAGES 1
#endif
#ifndef DN_STAGES
#define DN_STAGES 2
#endif
#ifndef GU_MINB
#define GU_MINB 2
#endif
#ifndef DN_MINB
#define DN_MINB 2
#endif
#ifndef DN_R
#define DN_R 4
#endif
#ifndef IQ3_FAST
#define IQ3_FAST 1
#endif
// canonical.exp constants (experts.py passes the values of canonical.py; these defaults are the same bits)
#ifndef EXP_LOG2E
#define EXP_LOG2E 0x1.7154760000000p+0f
#endif
#ifndef EXP_LN2_HI
#define EXP_LN2_HI 0x1.62e4000000000p-1f
#endif
#ifndef EXP_LN2_LO
#define EXP_LN2_LO 0x1.7f7d1c0000000p-20f
#endif
#ifndef EXP_C0
#define EXP_C0 0x1.a01a020000000p-13f
#endif
#ifndef EXP_C1
#define EXP_C1 0x1.6c16c20000000p-10f
#endif
#ifndef EXP_C2
#define EXP_C2 0x1.1111120000000p-7f
#endif
#ifndef EXP_C3
#define EXP_C3 0x1.5555560000000p-5f
#endif
#ifndef EXP_C4
#define EXP_C4 0x1.5555560000000p-3f
#endif
#ifndef EXP_C5
#define EXP_C5 0x1.0000000000000p-1f
#endif
#ifndef EXP_C6
#define EXP_C6 0x1.0000000000000p+0f
#endif
#ifndef EXP_C7
#define EXP_C7 0x1.0000000000000p+0f
#endif
#ifndef EXP_LO
#define EXP_LO (-87.0f)
#endif
#ifndef EXP_HI
#define EXP_HI 88.0f
#endif

#define FULL_MASK 0xffffffffu
#define QT_Q8_0 8
#define QT_Q4_K 12
#define QT_Q6_K 14
#define QT_IQ3_S 21

// ---- exact float32 arithmetic (IEEE round-to-nearest-even, subnormals kept, never contracted) ----------------
// an integer with |a| < 2^22 (every integer sum and scale here: a sub-block's isum is at most 32 * 127 * 128) as a
// float, exactly as cvt.rn.f32.s32 gives it, from an integer add and a float subtract (1.5 * 2^23 + a is an exact
// float) instead of the conversion unit's quarter-rate I2F
__device__ __forceinline__ float small_i2f(int a) {
    float r;
    asm("sub.rn.f32 %0, %1, 0f4B400000;" : "=f"(r) : "f"(__int_as_float(a + 0x4B400000)));
    return r;
}
__device__ __forceinline__ float h2f(u32 bits16) {
    float r;
    unsigned short h = (unsigned short)bits16;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}
__device__ __forceinline__ float f_neg(float a) { return __int_as_float(__float_as_int(a) ^ 0x80000000); }

// canonical.exp: clip, n = rint(x log2e), two-part ln2 reduction, Horner polynomial, times 2^n
__device__ __forceinline__ float c_exp(float x) {
    x = (x < EXP_LO) ? EXP_LO : x;  // np.clip keeps NaN: so do these compares
    x = (x > EXP_HI) ? EXP_HI : x;
    const float n = f_rint(f_mul(x, EXP_LOG2E));
    const float r = f_sub(f_sub(x, f_mul(n, EXP_LN2_HI)), f_mul(n, EXP_LN2_LO));
    float p = EXP_C0;
    p = f_add(f_mul(p, r), EXP_C1);
    p = f_add(f_mul(p, r), EXP_C2);
    p = f_add(f_mul(p, r), EXP_C3);
    p = f_add(f_mul(p, r), EXP_C4);
    p = f_add(f_mul(p, r), EXP_C5);
    p = f_add(f_mul(p, r), EXP_C6);
    p = f_add(f_mul(p, r), EXP_C7);
    const int ni = (int)n;  // n is integral, |n| <= 127
    return f_mul(p, __int_as_float((ni + 127) << 23));
}

__device__ __forceinline__ float c_silu(float g) { return f_div(g, f_add(1.0f, c_exp(f_neg(g)))); }

// The canonical lane fold (lane l += lane l + o for o = 16, 8, 4, 2, 1) of N values a lane at once (N a power of two
// <= 32). While a lane holds more than one value, at offset o the lanes with bit o set keep the second half of their
// values and the others the first, each adding what its partner (lane ^ o) sends of the half it keeps: the pairs of
// lanes the canonical fold adds, in an order addition ignores, with N - 1 + 5 - log2 N shuffles instead of 5 N.
// Value v's fold ends on lane v * (32 / N).
template <int N> __device__ __forceinline__ float fold_many(const float (&v)[N], int lane) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "a power of two values, at most a lane each");
    float a[N];
#pragma unroll
    for (int j = 0; j < N; ++j) a[j] = v[j];
#pragma unroll
    for (int k = 0; k < 5; ++k) {
        const int o = 16 >> k, n = N >> k;
        if (n > 1) {
            const bool hi = lane & o;
#pragma unroll
            for (int j = 0; j < n / 2; ++j) {
                const float keep = hi ? a[j + n / 2] : a[j], send = hi ? a[j] : a[j + n / 2];
                a[j] = f_add(keep, __shfl_xor_sync(FULL_MASK, send, o));
            }
        } else {
            a[0] = f_add(a[0], __shfl_down_sync(FULL_MASK, a[0], o));
        }
    }
    return a[0];
}

// ---- shared memory and cp.async --------------------------------------------------------------------------------
extern __shared__ __align__(16) u8 g_smem[];

__device__ __forceinline__ u32 smem_base() {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"((u64)g_smem));
    return r;
}
__device__ __forceinline__ u32 sm_u8(u32 off) { return g_smem[off]; }
__device__ __forceinline__ u32 sm_u16(u32 off) { return *reinterpret_cast<const u16*>(g_smem + off); }
__device__ __forceinline__ u32 sm_u32(u32 off) { return *reinterpret_cast<const u32*>(g_smem + off); }
__device__ __forceinline__ uint4 sm_u128(u32 off) { return *reinterpret_cast<const uint4*>(g_smem + off); }


#include "expert_decode.cuh"

// Cooperative 16-byte cp.async of the aligned chunks covering [g, g + rb) into shared address sdst, by threads
// `lane` of `step` (a warp's lanes, or a block's threads). Returns g's offset inside its 16-byte chunk (where the
// row starts in the staged copy).
__device__ __forceinline__ u32 stage_row(u32 sdst, const u8* g, int rb, int lane, int step = 32) {
    const u64 ga = (u64)g, a0 = ga & ~(u64)15, a1 = (ga + (u64)rb + 15) & ~(u64)15;
    const int n = (int)((a1 - a0) >> 4);
    for (int c = lane; c < n; c += step) cp_async16(sdst + 16u * c, (const void*)(a0 + 16u * (u64)c));
    return (u32)(ga & 15);
}

__device__ __forceinline__ int clamp_pairs(const int* __restrict__ n_pairs_p, int max_pairs) {
    int n = *n_pairs_p;
    return n < 0 ? 0 : (n > max_pairs ? max_pairs : n);
}


// =====================================================================================================================
// gate + up + SwiGLU + quantisation of h, and the down projection
// =====================================================================================================================
// Both kernels work on tiles: a tile is TP pairs of one expert, consecutive in the pair list. TP = 1 (decode: the
// tile is the pair itself, its activation loaded while its weights land, the IQ3_S terms taken on the fast path);
// TP = TILE_P (prompt chunks: build_pairs groups pairs by expert and cuts them into tiles (first pair, count), and
// each staged weight sub-block is decoded once for all of the tile's tokens). Per (token, row) the canonical terms
// are added in the same lane order (sub-block lane, lane + 32, ... from 0.0f) and folded the same way, so both
// give the same bits.
#ifndef TILE_P
#define TILE_P 8
#endif

template <int TP> struct Tile {  // tile t -> (first pair, count)
    static __device__ __forceinline__ void get(const int* __restrict__ tiles, int t, int& p0, int& cnt) {
        p0 = __ldg(tiles + 2 * t);
        cnt = min(max(__ldg(tiles + 2 * t + 1), 0), TP);
    }
};
template <> struct Tile<1> {
    static __device__ __forceinline__ void get(const int* __restrict__, int t, int& p0, int& cnt) {
        p0 = t;
        cnt = 1;
    }
};

template <int TP>
__device__ __forceinline__ int tile_slot(const int* __restrict__ pairs, const int* __restrict__ tiles, int t) {
    int p0, cnt;
    Tile<TP>::get(tiles, t, p0, cnt);
    return __ldg(pairs + 2 * p0 + 1);
}

// Block item = (tile, 32-row group g of d_ff). Warp w owns rows g*32 + w*GU_R .. + GU_R - 1 (GU_R = 32 / GU_WPB):
// it stages those gate rows and up rows (two contiguous byte ranges) with cp.async, then for each of its sub-blocks
// decodes all 2*GU_R rows and accumulates the canonical terms of each token in independent chains, folds them
// and lane 0 computes the values of h. The group's values meet in shared memory; after one __syncthreads warps
// quantise them (qh, dh), a token each.
// H_IN_DOWN (experts.py: Tuning.h_in_down; the default but for the gate/up types of H_GROUP_TYPES, where the down
// kernel's block items tile d_model), decode (TP = 1) only: an item is one warp's GU_R rows of one pair, items
// dealt to the warps warp-major (warp w of block b takes items w * blocks + b, + all warps, ...) so that every
// block, and so every SM, gets an even share (a3b decode: 8 pairs x 24 groups = 192 block items on 132 SMs leave 60
// SMs with two and 72 with one, and each block waits at its barrier for its slowest warp); h goes out as floats and
// the down kernel quantises it (down_body).
#ifndef H_IN_DOWN
#define H_IN_DOWN 1
#endif
typedef Geom<GU_QT, GU_KIN> GUG;
constexpr int GU_R = 32 / GU_WPB;
static_assert(GU_R * GU_WPB == 32 && GU_R <= 16, "GU_WPB must divide 32, at least 2 (a warp folds its 2 GU_R sums)");
// GU_DIRECT (experts.py, where a block's 64 staged rows would not fit in shared memory: F16 / BF16 / F32 gate and up
// at d_model 2048): a generic type's rows are decoded where they are (global memory), nothing is staged
#ifndef GU_DIRECT
#define GU_DIRECT 0
#endif
static_assert(!GU_DIRECT || !Tuned<GU_QT>::value, "the tuned decoders read staged rows only");
constexpr int GU_RANGE = GU_DIRECT ? 0 : GU_R * GUG::RB;        // bytes of one warp's rows of one matrix
constexpr int GU_CHB = (GU_RANGE + 14 + 15) / 16 * 16 + 16;    // staged bytes per matrix (+16: decoder over-read)
constexpr int GU_TBL = (GU_QT == QT_IQ3_S) ? GRID_TABLE_BYTES : TabSmem<GU_QT>::BYTES;
constexpr int GU_STG = 2 * GU_CHB;
template <int TP> struct GuSmem {
    static constexpr int HS = 2 * TP * 32 * 4;  // h of the group's tokens, double-buffered by item parity
    static constexpr int BYTES = GU_TBL + HS + GU_WPB * GU_STAGES * GU_STG + 16;
};
constexpr int GU_SMEM = GuSmem<1>::BYTES;
constexpr int GUT_SMEM = GuSmem<TILE_P>::BYTES;
static_assert(GU_ROWS % 32 == 0, "d_ff must be a multiple of 32");

// stage this warp's GU_R gate and up rows from row0 of the expert in `slot`: its gate rows start at
// pool + slot * slot_bytes, its up rows up_off bytes after them (a multiple of 16, so both ranges share one
// alignment offset): GU_ROWS * RB in a slot; in the arena, the distance between the layer's two GGUF tensors
__device__ __forceinline__ void gu_stage(u32 sdst, const u8* __restrict__ pool, i64 slot_bytes, i64 up_off, int slot,
                                         int row0, int lane) {
    const u8* g = pool + (i64)slot * slot_bytes + (i64)row0 * GUG::RB;
    stage_row(sdst, g, GU_RANGE, lane);
    stage_row(sdst + GU_CHB, g + up_off, GU_RANGE, lane);
}

template <int TP>
__device__ __forceinline__ void gateup_body(const u8* __restrict__ pool, i64 slot_bytes, i64 up_off,
                                            const int* __restrict__ pairs,
                                            const int* __restrict__ tiles, const int* __restrict__ n_tiles_p,
                                            int max_tiles, const signed char* __restrict__ qa,
                                            const float* __restrict__ da, const u32* __restrict__ grid_g,
                                            float* __restrict__ hbuf, signed char* __restrict__ qhbuf,
                                            float* __restrict__ dhbuf) {
    constexpr int NG = GU_ROWS / 32;
    constexpr int SPL = GUG::SPL, NSUB = GUG::NSUB;
    constexpr bool WI = TP == 1 && H_IN_DOWN;  // items of a warp's rows (H_IN_DOWN)
    constexpr int NI = WI ? GU_ROWS / GU_R : NG;  // items a tile
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int NB = gridDim.x;
    const int first = WI ? warp * NB + blockIdx.x : blockIdx.x, step = WI ? NB * GU_WPB : NB;  // this warp's items
    // item it's first row (of gate and of up) for this warp
    auto row0_of = [&](int it) { return WI ? (it % NI) * GU_R : (it % NI) * 32 + warp * GU_R; };
    // one pair a tile (TP = 1): the first stages' slots are read with the count, not after it (the list has room
    // for max_tiles entries; a slot past the count is read and dropped), one dependent L2 round trip less
    // (token, slot) of the first stages' pairs, read in one load each
    int2 pair0[GU_STAGES];
#pragma unroll
    for (int k = 0; k < GU_STAGES; ++k) {
        const int p = (first + k * step) / NI;
        pair0[k] = (TP == 1 && p < max_tiles) ? __ldg(reinterpret_cast<const int2*>(pairs) + p) : make_int2(0, 0);
    }
    const int n_tiles = clamp_pairs(n_tiles_p, max_tiles);
    const int items = n_tiles * NI;
    const u32 sb = smem_base();
    const u32 wst = GU_TBL + GuSmem<TP>::HS + warp * GU_STAGES * GU_STG;  // this warp's stages (shared offset)

#pragma unroll
    for (int k = 0; k < GU_STAGES; ++k) {  // rows in flight before anything else
        const int it = first + k * step;
        if (it < items) gu_stage(sb + wst + k * GU_STG, pool, slot_bytes, up_off,
                                 TP == 1 ? pair0[k].y : tile_slot<TP>(pairs, tiles, it / NI), row0_of(it), lane);
        cp_commit();
    }
    if (GU_QT == QT_IQ3_S && TP != 1) fill_grid<512>(grid_g);  // TP = 1: expert_gateup, before its wait
    if (TP != 1) fill_tab<GU_QT>(grid_g);
    __syncthreads();
    // One pair a tile, rows staged: the first item's activation sub-blocks loaded here, before the loop. ptxas
    // places the loop's cp.async wait ahead of the loads the source puts before it (SASS of the NVRTC build), so
    // loads in the loop go out only once the rows have landed: two dependent L2 round trips (the pair's token, then
    // its row) after them. Not for Q4_K, whose activation carries its sum (ASUM): held into the loop it spills at
    // 64 registers.
    constexpr bool ACT_AHEAD = TP == 1 && !GU_DIRECT && !ActNeeds<GU_QT>::ASUM;
    typename Sub<GU_QT>::A A[TP == 1 ? SPL : 1];
    if (ACT_AHEAD && first < items) load_row_act<GU_QT, GU_KIN>(qa, da, pair0[0].x, lane, A);

#pragma unroll 1
    for (int k = 0;; ++k) {
        const int it = first + k * step;
        if (it >= items) break;  // block-uniform (WI: warp-uniform, and no block barrier below)
        const int st = k % GU_STAGES;
        const int tile = it / NI, grp = it - tile * NI;
        int p0, cnt;
        Tile<TP>::get(tiles, tile, p0, cnt);
        const int slot = __ldg(pairs + 2 * p0 + 1);
        const int row0 = row0_of(it);

        if (TP == 1 && (k > 0 || !ACT_AHEAD)) load_row_act<GU_QT, GU_KIN>(qa, da, __ldg(pairs + 2 * p0), lane, A);
        cp_wait<GU_STAGES - 1>();
        __syncwarp();

        const u32 Rg = wst + st * GU_STG +
                       (u32)(((u64)pool + (u64)((i64)slot * slot_bytes + (i64)row0 * GUG::RB)) & 15);
        const u32 Ru = Rg + GU_CHB;
        const u8* Gg = pool + (i64)slot * slot_bytes + (i64)row0 * GUG::RB;  // GU_DIRECT: the gate rows themselves
        float ag[TP][GU_R], au[TP][GU_R];
#pragma unroll
        for (int t = 0; t < TP; ++t)
#pragma unroll
            for (int r = 0; r < GU_R; ++r) ag[t][r] = au[t][r] = 0.0f;
#pragma unroll
        for (int i = 0; i < SPL; ++i) {
            const int s = lane + 32 * i;
#pragma unroll
            for (int r = 0; r < GU_R; ++r) {
                if (TP == 1) {
                    float tg = 0.0f, tu = 0.0f;
                    if (s < NSUB) {
                        if constexpr (GU_DIRECT) {
                            tg = sub_dot_at<GU_QT>(Gg + r * GUG::RB, s, A[i % (TP == 1 ? SPL : 1)]);
                            tu = sub_dot_at<GU_QT>(Gg + up_off + r * GUG::RB, s, A[i % (TP == 1 ? SPL : 1)]);
                        } else {
                            tg = sub_dot<GU_QT>(Rg + r * GUG::RB, s, A[i % (TP == 1 ? SPL : 1)]);
                            tu = sub_dot<GU_QT>(Ru + r * GUG::RB, s, A[i % (TP == 1 ? SPL : 1)]);
                        }
                    }
                    ag[0][r] = f_add(ag[0][r], tg);
                    au[0][r] = f_add(au[0][r], tu);
                } else {
                    typename Sub<GU_QT>::W wg, wu;
                    if (s < NSUB) {
                        if constexpr (GU_DIRECT) {
                            decode_at<GU_QT>(Gg + r * GUG::RB, s, wg);
                            decode_at<GU_QT>(Gg + up_off + r * GUG::RB, s, wu);
                        } else {
                            decode_sub<GU_QT>(Rg + r * GUG::RB, s, wg);
                            decode_sub<GU_QT>(Ru + r * GUG::RB, s, wu);
                        }
                    }
#pragma unroll
                    for (int t = 0; t < TP; ++t) {
                        if (t < cnt) {  // warp-uniform
                            float tg = 0.0f, tu = 0.0f;
                            if (s < NSUB) {
                                const int tok = __ldg(pairs + 2 * (p0 + t));
                                typename Sub<GU_QT>::A B;
                                load_act<GU_QT>(qa + (i64)tok * GU_KIN, da + (i64)tok * NSUB, s, B);
                                tg = sub_term<GU_QT>(wg, B);
                                tu = sub_term<GU_QT>(wu, B);
                            }
                            ag[t][r] = f_add(ag[t][r], tg);
                            au[t][r] = f_add(au[t][r], tu);
                        }
                    }
                }
            }
        }
        // each token's gate and up sums folded together (gate row r's on lane r * 16 / GU_R, up row r's 16 lanes
        // further on); those lanes compute h
        float* hs = reinterpret_cast<float*>(g_smem + GU_TBL + (k & 1) * TP * 128);
        constexpr int SPREAD = 16 / GU_R;
        const int r = lane / SPREAD;
#pragma unroll
        for (int t = 0; t < TP; ++t) {
            float v[2 * GU_R];
#pragma unroll
            for (int j = 0; j < GU_R; ++j) {
                v[j] = ag[t][j];
                v[GU_R + j] = au[t][j];
            }
            const float gate = fold_many(v, lane), up = __shfl_down_sync(FULL_MASK, gate, 16);
            if (t < cnt && lane < 16 && lane % SPREAD == 0) {
                const float hv = f_mul(c_silu(gate), up);
                if (!WI) hs[t * 32 + warp * GU_R + r] = hv;
                hbuf[(i64)(p0 + t) * GU_ROWS + row0 + r] = hv;
            }
        }
        __syncwarp();  // every lane is done reading stage st
        {
            const int nx = it + GU_STAGES * step;
            if (nx < items) gu_stage(sb + wst + st * GU_STG, pool, slot_bytes, up_off,
                                     tile_slot<TP>(pairs, tiles, nx / NI), row0_of(nx), lane);
            cp_commit();
        }
        if (WI) continue;  // h is quantised by the down kernel
        __syncthreads();  // the group's values of h are in hs
        for (int t = warp; t < cnt; t += GU_WPB)  // warp-uniform
            quant32(hs[t * 32 + lane], lane, qhbuf + (i64)(p0 + t) * GU_ROWS + grp * 32,
                    dhbuf + (i64)(p0 + t) * NG + grp);
    }
    cp_wait<0>();
}

// The prompt tiles' kernels take one parameter list a phase, SIMT here and on tensor cores (experts_mma.cuh)
#define GU_TILED_PARAMS                                                                                           \
    const u8 *__restrict__ pool, i64 slot_bytes, i64 up_off, const int *__restrict__ pairs,                       \
        const int *__restrict__ tiles, const int *__restrict__ n_tiles_p, int max_tiles,                          \
        const signed char *__restrict__ qa, const float *__restrict__ da, const u32 *__restrict__ grid_g,         \
        float *__restrict__ hbuf, signed char *__restrict__ qhbuf, float *__restrict__ dhbuf
#define DN_TILED_PARAMS                                                                                           \
    const u8 *__restrict__ pool, i64 slot_bytes, const int *__restrict__ pairs, const int *__restrict__ tiles,    \
        const int *__restrict__ n_tiles_p, int max_tiles, const signed char *__restrict__ qhbuf,                  \
        const float *__restrict__ dhbuf, const u32 *__restrict__ grid_g, float *__restrict__ out

extern "C" __global__ void __launch_bounds__(GU_WPB * 32, GU_MINB)
expert_gateup(const u8* __restrict__ pool, i64 slot_bytes, i64 up_off, const int* __restrict__ pairs,
              const int* __restrict__ n_pairs_p, int max_pairs, const signed char* __restrict__ qa,
              const float* __restrict__ da, const u32* __restrict__ grid_g, float* __restrict__ hbuf,
              signed char* __restrict__ qhbuf, float* __restrict__ dhbuf) {
    if (GU_QT == QT_IQ3_S) fill_grid<GRID_TABLE_WORDS>(grid_g);  // a constant: while route_pairs runs
    fill_tab<GU_QT>(grid_g);
    PDL_ENTRY();
    gateup_body<1>(pool, slot_bytes, up_off, pairs, nullptr, n_pairs_p, max_pairs, qa, da, grid_g, hbuf, qhbuf, dhbuf);
}

extern "C" __global__ void __launch_bounds__(GU_WPB * 32, 1)
expert_gateup_tiled(GU_TILED_PARAMS) {
    PDL_ENTRY();
    gateup_body<TILE_P>(pool, slot_bytes, up_off, pairs, tiles, n_tiles_p, max_tiles, qa, da, grid_g, hbuf, qhbuf, dhbuf);
}

// Warp item = (tile, DN_R consecutive rows of d_model): stage the rows (one contiguous range), each row's canonical
// sums per token on DN_G of the warp's lanes (below), folded; the first lane of each row writes its outputs.
typedef Geom<DN_QT, DN_KIN> DNG;
static_assert(DN_ROWS % DN_R == 0, "DN_R must divide d_model");
constexpr int DN_RANGE = DN_R * DNG::RB;
constexpr int DN_CHB = (DN_RANGE + 14 + 15) / 16 * 16 + 16;
constexpr int DN_TBL = (DN_QT == QT_IQ3_S) ? GRID_TABLE_BYTES : TabSmem<DN_QT>::BYTES;
constexpr int DN_STG = DN_CHB;
// a pair's h quantised (DN_KIN codes, then DN_KIN / 32 scales); H_IN_DOWN: twice (by block item parity)
constexpr int DN_ACT1 = (DN_KIN + DN_KIN / 8 + 15) / 16 * 16;
constexpr int DN_ACT = H_IN_DOWN ? DN_ACT1 : 0;
constexpr int DN_SMEM = DN_TBL + 2 * DN_ACT + DN_WPB * DN_STAGES * DN_STG + 16;
// the folded combine's shared memory past DN_SMEM (DnCombine): the item's rows of every pair, twice (by item parity),
// the router's row map and weights (32 each), then (H_IN_DOWN) the k pairs' h quantised, DN_ACT1 bytes each
// (experts.py: ExpertKernels.fold_smem)
constexpr int DN_YS = 2 * DN_WPB * DN_R * 4, DN_FOLD = DN_YS + 2 * 32 * 4;
static_assert(DN_KIN == GU_ROWS, "down rows take d_ff values");
static_assert(DN_ROWS == GU_KIN, "down has d_model rows");

// Lanes of an item: DN_G lanes a row (lane = row * DN_G + g), each holding the canonical order's virtual lanes g,
// g + DN_G, ... (DN_VL of them) of its row, so that rows of fewer than 32 sub-blocks a lane (d_ff 768: 24) leave no
// lane idle and a row's fold is DN_VL - 1 adds in the lane and log2(DN_G) shuffles, not five shuffles a row
constexpr int DN_G = 32 / DN_R, DN_VL = DN_R;
static_assert(DN_G * DN_R == 32, "DN_R must divide 32");
// whether sub-block g + DN_G m + 32 i of virtual lane g + DN_G m is in the row (a constant where DN_G divides NSUB)
__device__ __forceinline__ bool dn_busy(int m, int i, int g) {
    return DN_G * m + 32 * i < DNG::NSUB && (DNG::NSUB % DN_G == 0 || g + DN_G * m + 32 * i < DNG::NSUB);
}

// stage chunk c (DN_R rows) of the down rows of the expert in `slot`; they start at pool + slot * slot_bytes (the
// caller points pool at the first slot's down rows, which follow gate and up, or at the arena's down tensor)
__device__ __forceinline__ void dn_stage(u32 sdst, const u8* __restrict__ pool, i64 slot_bytes, int slot, int c,
                                         int lane) {
    stage_row(sdst, pool + (i64)slot * slot_bytes + (i64)c * DN_RANGE, DN_RANGE, lane);
}

// A decode step's combine folded into its down kernel (every routed expert of the token on this card: one source, its
// k pairs the launch's pairs): a block item is then C = DN_WPB / k chunks of each of the k pairs (warp = pair * C +
// the chunk's place), and after one barrier the block's first warp adds the item's C * DN_R rows to the residual x in
// router order, as combine_rows does, from shared memory: no count, fence or L2 round trip between blocks. The host
// folds only where k divides DN_WPB and C * DN_R <= 32 (ExpertKernels.fold_smem). x null: no combine.
struct DnCombine {
    const int* rowmap;
    const float* w;
    float* x;
    int k, c;  // c = DN_WPB / k (a kernel parameter: no register of its own)
};

// np pairs' h (hbuf rows p_first on) quantised by the block into shared memory at byte qoff, DN_ACT1 bytes a pair:
// 4 groups a warp at once (quant32x4), group q (pair q / NSUB, group q % NSUB) by warp (q / 4) % DN_WPB, QB such
// rounds a loop trip with their loads issued together
template <int QB>
__device__ __forceinline__ void dn_quantise(const float* __restrict__ hbuf, int p_first, int np, int qoff, int warp,
                                            int lane) {
    constexpr int NSUB = DNG::NSUB;
    const int nq = np * NSUB;
#pragma unroll 1
    for (int q0 = 4 * warp; q0 < nq; q0 += 4 * DN_WPB * QB) {  // warp-uniform
        float4 hv[QB];
#pragma unroll
        for (int j = 0; j < QB; ++j) {
            const int q = q0 + 4 * DN_WPB * j + (lane >> 3);
            hv[j] = q < nq ? __ldg(reinterpret_cast<const float4*>(hbuf + (i64)(p_first + q / NSUB) * DN_KIN +
                                                                   32 * (q % NSUB)) + (lane & 7))
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < QB; ++j) {
            const int q = q0 + 4 * DN_WPB * j + (lane >> 3);
            signed char* qs = reinterpret_cast<signed char*>(g_smem + qoff + (q / NSUB) * DN_ACT1);
            quant32x4(hv[j], lane, qs + 32 * (q % NSUB), reinterpret_cast<float*>(qs + DN_KIN) + q % NSUB, q < nq);
        }
    }
}

// `wait` (the PDL wait) runs once the first weight rows are in flight (cp.async, which ptxas keeps ahead of the
// wait) and the IQ3_S grid is in shared memory: the pair lists are no output of the gate/up kernel before this one
// (they were complete before that kernel passed its own wait, which it does before letting this one start); h, its
// output, is read after the wait.
// H_IN_DOWN, decode (TP = 1): a block item is one pair's DN_WPB chunks (a chunk a warp), and the block first
// quantises the pair's h (hbuf, floats) into shared memory with quant32, as the gate/up kernel does otherwise (the
// same bits); its warps read their activation sub-blocks there. a3b decode: 8 pairs x 32 block items on 264 blocks.
// With the combine folded (DnCombine), the block quantises the k pairs' h once, before its first item.
template <int TP, class Wait>
__device__ __forceinline__ void down_body(const u8* __restrict__ pool, i64 slot_bytes, const int* __restrict__ pairs,
                                          const int* __restrict__ tiles, const int* __restrict__ n_tiles_p,
                                          int max_tiles, const signed char* __restrict__ qhbuf,
                                          const float* __restrict__ dhbuf, const float* __restrict__ hbuf,
                                          const u32* __restrict__ grid_g, float* __restrict__ out, Wait wait,
                                          DnCombine cmb = DnCombine{}) {
    constexpr int NC = DN_ROWS / DN_R;
    constexpr int SPL = DNG::SPL, NSUB = DNG::NSUB;
    constexpr bool QD = TP == 1 && H_IN_DOWN;  // block items, h quantised here
    static_assert(!H_IN_DOWN || NC % DN_WPB == 0, "H_IN_DOWN: a block item is DN_WPB chunks of d_model");
    constexpr int NI = QD ? NC / DN_WPB : NC;  // items a tile
    const bool fold = TP == 1 && cmb.x != nullptr;  // the combine folded in (launch-uniform)
    const int C = fold ? cmb.c : 1, CR = C * DN_R;  // folded: chunks of each pair an item, and its rows
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = lane / DN_G, g = lane % DN_G;  // this lane's row of the item, and its place among the row's lanes
    const int n_tiles = clamp_pairs(n_tiles_p, max_tiles);
    const bool blk = QD || fold;  // block items: a block-uniform loop
    const int first = blk ? blockIdx.x : blockIdx.x * DN_WPB + warp, step = blk ? gridDim.x : gridDim.x * DN_WPB;
    // folded: nothing where the launch's pairs are not the token's k (the host never launches that)
    const int items = fold ? (n_tiles == cmb.k ? NC / C : 0) : n_tiles * NI;
    auto tile_of = [&](int it) { return fold ? warp / C : it / NI; };
    auto chunk_of = [&](int it) {  // item it's chunk for this warp
        return fold ? it * C + warp % C : QD ? (it % NI) * DN_WPB + warp : it % NI;
    };
    const u32 sb = smem_base();
    const u32 wst = DN_TBL + 2 * DN_ACT + warp * DN_STAGES * DN_STG;

    // the slot of the warp's first item, kept for the loop (folded: every item of a warp is one pair's), where a load
    // goes out after the quantisation's barrier: one L2 round trip on the path
    const int slot0 = first < items ? tile_slot<TP>(pairs, tiles, tile_of(first)) : 0;
#pragma unroll 1
    for (int k = 0; k < DN_STAGES; ++k) {
        const int it = first + k * step;
        if (it < items) dn_stage(sb + wst + k * DN_STG, pool, slot_bytes,
                                 k == 0 ? slot0 : tile_slot<TP>(pairs, tiles, tile_of(it)), chunk_of(it), lane);
        cp_commit();
    }
    if (DN_QT == QT_IQ3_S) fill_grid<TP == 1 ? GRID_TABLE_WORDS : 512>(grid_g);
    fill_tab<DN_QT>(grid_g);
    __syncthreads();
    wait();
    // folded: the router's rows of out and their weights, for the first warp's combine (its own stores)
    int* const rms = reinterpret_cast<int*>(g_smem + DN_SMEM + DN_YS);
    float* const ws = reinterpret_cast<float*>(rms + 32);
    if (fold && warp == 0) {
        rms[lane] = lane < cmb.k ? __ldg(cmb.rowmap + lane) : 0;
        ws[lane] = lane < cmb.k ? __ldg(cmb.w + lane) : 0.0f;
    }

    if constexpr (QD) {  // folded: the block quantises the k pairs' h once, past the folded rows
        constexpr int QB = (NSUB + 7) / 8;  // one loop trip where C >= 2
        if (fold && first < items) {  // block-uniform
            dn_quantise<QB>(hbuf, 0, cmb.k, DN_SMEM + DN_FOLD, warp, lane);
            __syncthreads();
        }
    }
#pragma unroll 1
    for (int k = 0;; ++k) {
        const int it = first + k * step;
        if (it >= items) break;  // blk: block-uniform
        const int st = k % DN_STAGES;
        const int tile = tile_of(it), c = chunk_of(it);
        int p0, cnt;
        Tile<TP>::get(tiles, tile, p0, cnt);
        const int slot = fold || k == 0 ? slot0 : __ldg(pairs + 2 * p0 + 1);
        // one pair's activation sub-blocks of this lane's virtual lanes
        typename Sub<DN_QT>::A A[TP == 1 ? DN_VL : 1][TP == 1 ? SPL : 1];
        auto act_from = [&](const signed char* qs, const float* ds) {
#pragma unroll
            for (int m = 0; m < DN_VL; ++m)
#pragma unroll
                for (int i = 0; i < SPL; ++i)
                    if (dn_busy(m, i, g)) load_act<DN_QT, QD>(qs, ds, g + DN_G * m + 32 * i, A[m][i]);
        };
        if constexpr (TP == 1) {  // loaded while the weights land
            if constexpr (QD) {  // the pair's h quantised, or (folded) the warp's pair's as the block did before
                const signed char* qs;
                if (fold) {
                    qs = reinterpret_cast<const signed char*>(g_smem + DN_SMEM + DN_FOLD) + p0 * DN_ACT1;
                } else {  // into buffer k % 2 (the other may still be read: item k - 1)
                    constexpr int QJ = (NSUB + 4 * DN_WPB - 1) / (4 * DN_WPB);  // one loop trip
                    dn_quantise<QJ>(hbuf, p0, 1, DN_TBL + (k & 1) * DN_ACT, warp, lane);
                    __syncthreads();
                    qs = reinterpret_cast<const signed char*>(g_smem + DN_TBL + (k & 1) * DN_ACT);
                }
                act_from(qs, reinterpret_cast<const float*>(qs + DN_KIN));
            } else {
                act_from(qhbuf + (i64)p0 * DN_KIN, dhbuf + (i64)p0 * NSUB);
            }
        }
        cp_wait<DN_STAGES - 1>();
        __syncwarp();

        const u32 R = wst + st * DN_STG + r * DNG::RB +
                      (u32)(((u64)pool + (u64)((i64)slot * slot_bytes + (i64)c * DN_RANGE)) & 15);
        float acc[TP][DN_VL];  // virtual lane g + DN_G m's canonical sum, for each token
#pragma unroll
        for (int t = 0; t < TP; ++t)
#pragma unroll
            for (int m = 0; m < DN_VL; ++m) acc[t][m] = 0.0f;
#pragma unroll
        for (int i = 0; i < SPL; ++i) {
#pragma unroll
            for (int m = 0; m < DN_VL; ++m) {
                const int s = g + DN_G * m + 32 * i;
                const bool busy = dn_busy(m, i, g);
                if (TP == 1) {
                    if (busy) acc[0][m] = f_add(acc[0][m], sub_dot<DN_QT>(R, s, A[m % DN_VL][i % SPL]));
                } else {
                    typename Sub<DN_QT>::W w;
                    if (busy) decode_sub<DN_QT>(R, s, w);
#pragma unroll
                    for (int t = 0; t < TP; ++t) {
                        if (t < cnt && busy) {
                            typename Sub<DN_QT>::A B;
                            load_act<DN_QT>(qhbuf + (i64)(p0 + t) * DN_KIN, dhbuf + (i64)(p0 + t) * NSUB, s, B);
                            acc[t][m] = f_add(acc[t][m], sub_term<DN_QT>(w, B));
                        }
                    }
                }
            }
        }
        // the canonical fold: offsets 16 .. DN_G join virtual lanes of this lane, the rest are shuffles in the row's
        // lanes; a virtual lane past the row (no term at all: +0.0, which adding would not change) is left out
#pragma unroll
        for (int t = 0; t < TP; ++t) {
#pragma unroll
            for (int o = 16; o >= DN_G; o >>= 1)
#pragma unroll
                for (int m = 0; m < o / DN_G; ++m)
                    if (DN_G * (m + o / DN_G) < NSUB) acc[t][m] = f_add(acc[t][m], acc[t][m + o / DN_G]);
#pragma unroll
            for (int o = DN_G / 2; o; o >>= 1) acc[t][0] = f_add(acc[t][0], __shfl_down_sync(FULL_MASK, acc[t][0], o));
        }
        if (g == 0) {
#pragma unroll
            for (int t = 0; t < TP; ++t)
                if (t < cnt) out[(i64)(p0 + t) * DN_ROWS + (i64)c * DN_R + r] = acc[t][0];
        }
        if (fold) {  // combine_rows' sum for the item's rows, the pairs' rows from shared memory in router order
            float* ys = reinterpret_cast<float*>(g_smem + DN_SMEM) + (k & 1) * DN_WPB * DN_R;  // [pair][CR]
            // the item's rows of x as they came in, read by the first warp while the others finish
            const float xv = warp == 0 && lane < CR ? __ldcg(cmb.x + (i64)it * CR + lane) : 0.0f;
            if (g == 0) ys[warp * DN_R + r] = acc[0][0];
            __syncthreads();  // (the other parity's rows, item k - 1's, were read before this barrier's arrivals)
            if (warp == 0 && lane < CR) {
                float a = 0.0f;
                for (int j = 0; j < cmb.k; ++j) a = f_add(a, f_mul(ws[j], ys[rms[j] * CR + lane]));
                cmb.x[(i64)it * CR + lane] = f_add(xv, a);
            }
        }
        __syncwarp();
        const int nx = it + DN_STAGES * step;
        if (nx < items) dn_stage(sb + wst + st * DN_STG, pool, slot_bytes, tile_slot<TP>(pairs, tiles, tile_of(nx)),
                                 chunk_of(nx), lane);
        cp_commit();
    }
    cp_wait<0>();
}

extern "C" __global__ void __launch_bounds__(DN_WPB * 32, DN_MINB)
expert_down(const u8* __restrict__ pool, i64 slot_bytes, const int* __restrict__ pairs,
            const int* __restrict__ n_pairs_p, int max_pairs, const signed char* __restrict__ qhbuf,
            const float* __restrict__ dhbuf, const float* __restrict__ hbuf, const u32* __restrict__ grid_g,
            float* __restrict__ out, const int* __restrict__ rowmap, const float* __restrict__ w, float* x, int k,
            int c) {
    down_body<1>(pool, slot_bytes, pairs, nullptr, n_pairs_p, max_pairs, qhbuf, dhbuf, hbuf, grid_g, out,
                 [] { PDL_ENTRY(); }, DnCombine{rowmap, w, x, k, c});
}

extern "C" __global__ void __launch_bounds__(DN_WPB * 32, 1)
expert_down_tiled(DN_TILED_PARAMS) {
    down_body<TILE_P>(pool, slot_bytes, pairs, tiles, n_tiles_p, max_tiles, qhbuf, dhbuf, nullptr, grid_g, out,
                      [] { PDL_ENTRY(); });
}

#include "experts_mma.cuh"

// =====================================================================================================================
// activation quantisation, combine, layout query
// =====================================================================================================================
// x: n_groups groups of 32 floats -> q (same layout, int8), d (one per group). One warp per group.
extern "C" __global__ void quantize_rows(const float* __restrict__ x, signed char* __restrict__ q,
                                         float* __restrict__ d, int n_groups) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31;
    const int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (g >= n_groups) return;  // whole warps leave together
    quant32(x[(i64)g * 32 + lane], lane, q + (i64)g * 32, d + g);
}

// y: (T, K, D) router order, w: (T, K) -> out (T, D)
extern "C" __global__ void combine_k(const float* __restrict__ y, const float* __restrict__ w,
                                     float* __restrict__ out, int T, int K, int D) {
    PDL_ENTRY();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * D) return;
    const int t = (int)(idx / D), i = (int)(idx - (i64)t * D);
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) acc = f_add(acc, f_mul(w[t * K + j], y[((i64)t * K + j) * D + i]));
    out[idx] = acc;
}

// combine_k into the residual with rows found through a row map (the MoE step's last launch):
// x[t, i] += sum_j w[t, j] * row(rowmap[t*K + j])[i], in router order from 0.0f (canonical.combine, then the
// residual add). rowmap r >= 0: rows[r] (a card's results); r < 0: host_rows[-1 - r] (the CPU pool's results in
// mapped pinned host memory).
extern "C" __global__ void combine_rows(const float* __restrict__ rows, const float* __restrict__ host_rows,
                                        const int* __restrict__ rowmap, const float* __restrict__ w,
                                        float* __restrict__ x, int T, int K, int D) {
    PDL_ENTRY();
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)T * D) return;
    const int t = (int)(idx / D), i = (int)(idx - (i64)t * D);
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) {
        const int r = rowmap[t * K + j];
        const float v = r >= 0 ? rows[(i64)r * D + i] : host_rows[(i64)(-1 - r) * D + i];
        acc = f_add(acc, f_mul(w[t * K + j], v));
    }
    x[idx] = f_add(x[idx], acc);
}

#include "expert_pairs.cuh"

// The doorbell: everything before it in the stream is done and visible to the host when *bell changes to the
// next value of *counter (device memory, so replays of a captured graph ring with increasing values).
extern "C" __global__ void ring(unsigned int* __restrict__ counter, volatile unsigned int* __restrict__ bell) {
    PDL_ENTRY();
    __threadfence_system();
    const unsigned int v = *counter + 1u;
    *counter = v;
    __threadfence_system();
    *bell = v;
}

// What the host needs to size launches (one source of truth for the layout).
extern "C" __global__ void layout_info(int* __restrict__ o) {
    PDL_ENTRY();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const int v[] = {GU_SMEM, DN_SMEM, GUG::RB, DNG::RB, GU_STG, DN_STG, GU_R, DN_R, GRID_TABLE_BYTES, GUG::SPL,
                         DNG::SPL, GUT_SMEM, TILE_P, MMA_GU_SMEM, MMA_DN_SMEM};
        for (int i = 0; i < (int)(sizeof(v) / sizeof(v[0])); ++i) o[i] = v[i];
    }
}
