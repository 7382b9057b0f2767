// embedding: out[t] = dequantised row tokens[t] of the table (a bad token id gives a NaN row).
#include "common.cuh"
#include "dense_common.cuh"

extern "C" __global__ void __launch_bounds__(256) embed_rows(const u8* __restrict__ table, int qt, int vocab,
                                                             int d, i64 row_bytes, const int* __restrict__ tokens,
                                                             float* __restrict__ out) {
    PDL_ENTRY();
    const int t = blockIdx.x;
    const int tok = tokens[t];
    float* o = out + (i64)t * d;
    if (tok < 0 || tok >= vocab) {
        for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const u8* rp = table + (i64)tok * row_bytes;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = load_elem(qt, rp, i);
}

// =============================================================================================================
