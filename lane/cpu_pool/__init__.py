"""The CPU pool: threads that compute the experts no card holds, straight from the arena's raw GGUF bytes.

Every output bit equals `stratad.engine.canonical.expert` on `decode_int` of the same rows (docs/design.md, exactness),
for every expert type. Every type has a kernel reading its raw GGUF blocks (gate / up / down may each be any type:
llama.cpp's mixes): IQ3_S / Q4_K / Q8_0 decode in vector registers; every other type, the float ones (F32 / F16 /
BF16) included, goes through one mechanism, a per-type decoder filling a block's integer view in small buffers and
one row loop over them (`_rows_dec`), where a block that one token reads is decoded in registers instead (a block
kernel per type: `_blk_*`). The kernels form exact integer sub-block dots, scale each term as
`(scale_b * d_b) * isum_b [- (minimum_b * d_b) * msum_b]` in float32 (every op rounded on its own: no fastmath, so
LLVM never contracts to FMA or reassociates), sum terms in the canonical warp order (virtual lane l adds terms
l, l+32, ... to 0.0, then folds 16, 8, 4, 2, 1), apply SwiGLU with the canonical float32 `exp`, quantise h
canonically and run the down dot the same way. Each output element is computed by one sequential piece of code
whatever the partitioning, so the bits do not depend on the thread count.

One `CpuPool.run(LayerJobs)` call computes a whole layer's CPU share for one or a few tokens as one numba parallel
call (gate/up + SwiGLU, quantise h, down), with no per-expert Python: the inputs are the layer's three expert
tensors as uint8 (n_expert, rows, row_bytes) views (file mapping or arena), an int32 (n_pairs, 2) array of
(token, expert) pairs and the tokens' quantised activations; the output is float32 (n_pairs, d_model). Pairs that
share an expert are grouped so that each weight row is read once for all of its tokens.

The integer parts (IQ3_S decode, sub-block dots, 8 sub-blocks' scaling at once) are LLVM vector IR emitted through
numba intrinsics; the float parts are plain IEEE float32 operations in the canonical order.
Its throughput (GB/s of expert bytes read) is measured by `stratad.bench.cpu_pool`; figures in docs/perf-notes.md.

Modules: tables (type codes, lookup tables), vector_ir and byte_ops (LLVM vector IR helpers), blocks,
blocks_legacy_iq and blocks_float (a block of each type in registers), decoders (a block into the buffers), scalar,
rows (row dots), layer_call (the parallel layer call) and pool (CpuPool, LayerJobs).
"""
from lane.cpu_pool.pool import CpuPool, LayerJobs

__all__ = ["CpuPool", "LayerJobs"]
