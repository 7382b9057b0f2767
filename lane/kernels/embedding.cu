// embedding: out[t] = dequantised row tokens[t] of the table (a bad token id gives a NaN row).
#include "common.cuh"
#include "decode.cuh"
#include "dense_common.cuh"

// a block a token, its threads over the row's spans (decode.cuh: 32 values of a quantised type, 1 of a float type)
template <int QT>
__device__ __forceinline__ void embed_rows_body(const u8* __restrict__ table, int vocab, int d, i64 row_bytes,
                                                const u8* __restrict__ tab, const int* __restrict__ tokens,
                                                float* __restrict__ out) {
    typedef DqSpan<QT> S;
    PDL_ENTRY();
    const int t = blockIdx.x;
    const int tok = tokens[t];
    float* o = out + (i64)t * d;
    if (tok < 0 || tok >= vocab) {
        for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const u8* rp = table + (i64)tok * row_bytes;
    for (int s = threadIdx.x; s < d / S::SPAN; s += blockDim.x) {
        float v[S::SPAN];
        S::decode(rp, s, tab, v);
#pragma unroll
        for (int i = 0; i < S::SPAN; ++i) o[(i64)s * S::SPAN + i] = v[i];
    }
}
#define EMBED_ROWS(name, code)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) embed_rows_##name(                                         \
        const u8* __restrict__ table, int vocab, int d, i64 row_bytes, const u8* __restrict__ tab,               \
        const int* __restrict__ tokens, float* __restrict__ out) {                                               \
        embed_rows_body<code>(table, vocab, d, row_bytes, tab, tokens, out);                                     \
    }
DQ_ALL_TYPES(EMBED_ROWS)

// =============================================================================================================
