"""CuPy wrappers of the dense-path GPU kernels (dense.cu), each beside its numpy reference.

One sequence per lane; all activations float32; every launch has a fixed grid and reads positions / lengths /
tokens from device memory, so a decode step can be captured once in a CUDA graph and replayed. Wrappers allocate
nothing when their outputs (and the plan objects' scratch) are passed in, except `dense_batched`'s cuBLAS methods
without a cached dequantised copy (see there).

Buffer layouts (the lane engine is written against these):
  weights   DenseWeight: the GGUF rows as they are, cupy uint8 (rows, row_bytes); qtype F32/F16/BF16/Q8_0.
            Fuse q/k/v by concatenating rows: DenseWeight.concat([wq, wk, wv]) -> one launch, y = [q | k | v].
  qkv       float32 (T, n_head*hd + 2*n_kv*hd), rows [q | k | v] (the fused mat-vec's output)
  q_out     float32 (T, n_head, hd): q after q_norm + RoPE
  K cache   float16 (n_kv, max_ctx, hd) per layer          (alloc_kv_cache; zero-filled once)
  V cache   float16 (n_kv, max_ctx / 16, hd, 16) per layer: V^T (attention reads it as mma B fragments) in blocks of
            16 positions, so that a tile's V^T is one contiguous piece (v_cache_shape, v_blocked, v_unblocked)
  pos       int32 (1,) on the device: position of the step's first token; token t of a step is at pos + t and
            attends to positions [0, pos + t]. advance_pos(pos, T) adds T (capture it at the end of a step).
  attn out  float32 (T, n_head * hd), ready for the o-projection mat-vec
  router    ids int32 (T, k), weights float32 (T, k), descending
  sampling  params float64 (4,) = [temperature, top_k, top_p, u]; token int32 (1,)
  embed     tokens int32 (T,) -> float32 (T, d_model)

Functions / classes (numpy reference beside each):
  matvec(W, x, y, residual)           matvec_ref(raw, qtype, x, residual)
  dense_batched(W, X, Y, residual)    dense_batched_ref(raw, qtype, X, residual)
  rms_norm(x, w, eps, y)              rms_norm_ref = reference.rms_norm
  qk_norm_rope_kv(...)                qk_norm_rope_kv_ref(...)
  DecodeAttention(...)(q, K, V, pos, out)   attention_ref(q, K, V, pos0)
  route(logits, k, ids, weights)      route_ref = reference.route
  Argmax(n)(x, out)                   argmax_ref = np.argmax
  DeviceSampler(n)(logits, params, out)  sample_ref(logits, temperature, top_k, top_p, u)
  embed(table, tokens, out)           embed_ref(raw, qtype, tokens)
"""
from __future__ import annotations

import contextlib
import math
import os
import threading

import numpy as np
from gguf import GGMLQuantizationType as T

from stratad.engine import canonical, reference
from stratad.model import quants
from stratad.model import rope as rope_math
from stratad.model.rope import RopeScaling

from .compile import load_module
from .launch import launch

SOURCE = "dense.cu"
F32 = np.float32
QNAME = {T.F32: "f32", T.F16: "f16", T.BF16: "bf16", T.Q8_0: "q8_0"}
# (rows per warp, warps per row group). With KS > 1 and R > 1 a warp reads its K slice of x once for R rows: the
# activation's shared-memory / L1 traffic (4 bytes a weight at R = 1, against 1 byte of weights) falls by R.
PLANS = ((4, 1), (2, 1), (1, 1), (1, 2), (1, 4), (1, 8), (4, 2), (4, 4), (2, 2), (2, 4))
SAMPLE_KMAX = 256       # candidates kept by the sampler (dense.cu SAMPLE_KMAX)
SAMPLE_CHUNK = 4096     # logits per stage-1 block (dense.cu SAMPLE_CHUNK)
CDF_CHUNK = 4096        # logits per block of the whole-vocabulary sampler (dense.cu CDF_CHUNK)
Q8_SMEM_BYTES = 8 * 8 * 1088  # Q8_0 mat-vec cp.async ring (dense.cu Q8_SMEM_BYTES)
NORM_MV_MAX_N = 4096  # RMSNorm folded into a mat-vec: the row staged in shared memory (dense.cu section 2b)
NORM_MV_Q8_SMEM = 8 * 6 * 1088 + 4 * NORM_MV_MAX_N  # dense.cu NORM_MV_Q8_SMEM
BATCHED_METHODS = ("kernel", "f16", "bf16", "tf32", "sgemm")
# defaults chosen from the H200 measurements (docs/perf-notes.md, "dense kernels"); the alternatives are kept,
# tested and benchmarked beside them
DEFAULT_BATCHED_METHOD = "f16"   # dense_batched: cuBLAS fp16 tensor cores on a dequantised copy
Q8_VARIANT = "q8_0"              # Q8_0 mat-vec: "q8_0" (4 lanes per block) or "q8_0v1" (a lane per block)
# decode attention's split kernel, how its warps load K / V tiles: plainly (the default), prefetching the next
# 16-position tile into registers (ATTN_PIPELINED) or through a per-warp cp.async ring of shared memory (ATTN_RING,
# ATTN_RING_STAGES - 1 tiles in flight, 165 registers instead of 247). H200, a3b, one
# layer (µs, 1K / 8K / 32K / 128K context): plain 7.65 / 11.5 / 25.6 / 80.6, register prefetch 8.35 / 14.4 / 28.1 /
# 85.6, ring 8.81 / 14.9 / 29.4 / 84.9 (docs/bench/2026-12-03-h200-dense-attn-ring.json): once full tiles skipped
# the mask and the unmoved rescale, the plain loop's two blocks an SM hide the loads best. (The decode step's fused
# kernel, attn_split_*_qkv, has the prefetch form or the ring only.) STRATAD_ATTN_LOAD=pipe / ring picks another
# load path for an A/B run.
ATTN_LOAD = os.environ.get("STRATAD_ATTN_LOAD", "plain")
if ATTN_LOAD not in ("plain", "pipe", "ring"):
    raise ValueError(f"STRATAD_ATTN_LOAD={ATTN_LOAD!r}: plain, pipe or ring")
ATTN_PIPELINED = ATTN_LOAD == "pipe"
ATTN_RING = ATTN_LOAD == "ring"
ATTN_RING_STAGES = {False: 3, True: 2}  # by group > 8 (dense.cu AttnRing): two blocks an SM either way
# the split combine: "attn_combine_1p" (one pass with a running maximum), "attn_combine" (three passes: maxima,
# weights, outputs) or "attn_combine_v1" (thread per dim); STRATAD_ATTN_COMBINE for an A/B run. H200, a3b, all
# resident, tok/s at 1K / 32K: one pass 382.3 / 290.2, three 378.4 / 287.9 (docs/perf-notes.md, session 14)
ATTN_COMBINES = ("attn_combine_1p", "attn_combine", "attn_combine_v1")
ATTN_COMBINE = os.environ.get("STRATAD_ATTN_COMBINE", "attn_combine_1p")
# The decode step's Q8_0 mat-vecs on x quantised to 8 bits a value (canonical.quantize_act, the experts' input
# form) by the launch that writes x, with integer dot products (dp4a) on a quarter of the bytes of x: "o" (the
# attention output, quantised by the one-pass combine), "head" (the LM head's input, by the final RMSNorm).
# STRATAD_DENSE_QX: a comma-separated list of those ("" for none); default "o" (H200, 2026-12-04: 1K decode +1.6 %,
# 32K +0.6 %). "head" adds +0.6 % / +0.4 % more but moved a decode-vs-chunk greedy token on tiny-Q4_K
# (test_prefix_cache_on_the_card), so it stays opt-in. The logits move against the float reference
# (tests/test_gpu_card.py bounds them).
DENSE_QX_NAMES = ("o", "head")
DENSE_QX = frozenset(n for n in os.environ.get("STRATAD_DENSE_QX", "o").split(",") if n)
if not DENSE_QX <= set(DENSE_QX_NAMES):
    raise ValueError(f"STRATAD_DENSE_QX={','.join(sorted(DENSE_QX))!r}: names from {', '.join(DENSE_QX_NAMES)}")
if ATTN_COMBINE not in ATTN_COMBINES:
    raise ValueError(f"STRATAD_ATTN_COMBINE={ATTN_COMBINE!r}: one of {', '.join(ATTN_COMBINES)}")
# prompt attention: the Q tile in shared memory and two blocks an SM (False: Q in registers, one block an SM). H200,
# a3b, one layer's 1024-token chunk: 2467 -> 2223 us after 31K cached tokens, 760 -> 700 after 8K, 156 -> 158 first
FLASH_Q_SMEM = True
ATTN_COMBINE_COLS = 8            # attn_combine: float4 columns a block (hd / 32 blocks a head at hd 128: 4)
# Decode steps at this context or longer launch the split kernel without a PDL edge: on the H200 (a3b, all resident)
# the edge cost 0.83 ms a step at 32K (5.27 -> 4.44 ms; a fixed shared-memory carveout did not help) and saved
# 0.07 ms at 1K (3.44 -> 3.37); linear in the context between, the two cross near 3.4K.
ATTN_PDL_MAX_CTX = 4096
# The decode step's split kernel (attn_split_*_qkv*) by context, below ATTN_PDL_MAX_CTX and from it: its load path
# ("pipe": the register prefetch, "plain", "ring"). The prefetch where the PDL edge lets its loads start early, the
# plain loop (168 registers instead of 246 then, 137 / 212 with O^T = V^T P^T: three blocks an SM against two)
# where the context is long. H200, a3b, all resident,
# tok/s: plain 360.3 / 278.6 at 1K / 32K, prefetch 363.4 / 274.7 (docs/perf-notes.md, session 13). The split count
# follows the kernel, so the bits depend on the position only, never on the mode.
STEP_LOAD = {False: "pipe", True: "plain"}

_lock = threading.Lock()
_mods: dict[int, "_Module"] = {}


class _Module:
    def __init__(self, device_id: int):
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.module, self.build = load_module(SOURCE, (), device=device_id, return_info=True)
            attrs = self.device.attributes
            self.n_sm = int(attrs.get("MultiProcessorCount", 132))
            self.smem_optin = int(attrs.get("MaxSharedMemoryPerBlockOptin", 232448))
            self.smem_sm = int(attrs.get("MaxSharedMemoryPerMultiprocessor", 233472))
        self._fns: dict[str, object] = {}

    def fn(self, name: str):
        f = self._fns.get(name)
        if f is None:
            f = self.module.get_function(name)
            if name.startswith("matvec_q8_0"):
                f.max_dynamic_shared_size_bytes = Q8_SMEM_BYTES
            elif name.startswith("norm_matvec_q8_0"):
                f.max_dynamic_shared_size_bytes = NORM_MV_Q8_SMEM
            self._fns[name] = f
        return f

    def blocks_per_sm(self, name: str, threads: int, dyn_smem: int = 0) -> int:
        f = self.fn(name)
        try:
            regs = int(f.num_regs)
            smem = int(f.shared_size_bytes) + dyn_smem
        except Exception:  # noqa: BLE001
            return 2
        warps = (threads + 31) // 32
        per_warp = ((regs * 32 + 255) // 256) * 256
        by_regs = 65536 // max(1, per_warp * warps)
        by_smem = self.smem_sm // (smem + 1024) if smem else 32
        by_warps = 64 // warps
        return max(1, min(by_regs, by_smem, by_warps, 32))


def kernels(device=None) -> _Module:
    """The compiled dense.cu module for `device` (default: current), built once per process."""
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    with _lock:
        m = _mods.get(dev.id)
        if m is None:
            m = _mods[dev.id] = _Module(dev.id)
        return m


def _on(stream):
    return stream if stream is not None else contextlib.nullcontext()


def _ptr(a) -> np.uint64:
    return np.uint64(0 if a is None else a.data.ptr)


def _need(a, dtype, shape, name, align: int = 4):
    import cupy

    if not isinstance(a, cupy.ndarray) or a.dtype != np.dtype(dtype) or not a.flags.c_contiguous:
        raise TypeError(f"{name} must be a C-contiguous cupy {np.dtype(dtype).name} array")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if a.data.ptr % align:
        raise ValueError(f"{name} must be {align}-byte aligned")


def _qtype(q) -> T:
    t = quants.parse_type(q) if isinstance(q, str) else T(int(q))
    if t not in QNAME:
        raise ValueError(f"{t.name} is not a dense type ({[q.name for q in QNAME]})")
    return t


# =================================================================================================================
# weights
# =================================================================================================================
class DenseWeight:
    """A dense GGUF matrix on the device: rows x row_bytes raw bytes (cupy uint8), its type and column count."""

    def __init__(self, data, qtype, cols: int):
        import cupy

        self.qtype = _qtype(qtype)
        self.cols = int(cols)
        self.row_bytes = quants.fmt(self.qtype).row_bytes(self.cols)
        if not isinstance(data, cupy.ndarray):
            raise TypeError("data must be a cupy array (use DenseWeight.upload for host data)")
        data = data.view(cupy.uint8).reshape(-1, self.row_bytes)
        _need(data, np.uint8, None, "data", align=1)
        self.data = data
        self.rows = int(data.shape[0])
        granule = 256 if self.qtype == T.Q8_0 else 1
        self.fast = (self.row_bytes % 16 == 0 and data.data.ptr % 16 == 0 and self.cols % granule == 0)
        self._cache: dict[str, object] = {}

    @classmethod
    def upload(cls, raw: np.ndarray, qtype, cols: int | None = None) -> "DenseWeight":
        """From host rows: uint8 (rows, row_bytes) as ModelFile.raw gives them (or a float array of the type)."""
        import cupy

        qt = _qtype(qtype)
        u8 = np.ascontiguousarray(raw).view(np.uint8)
        u8 = u8.reshape(u8.shape[0] if u8.ndim > 1 else 1, -1)
        if cols is None:
            f = quants.fmt(qt)
            cols = u8.shape[1] // f.block_bytes * f.block_values
        return cls(cupy.asarray(u8), qt, cols)

    @classmethod
    def concat(cls, ws: list["DenseWeight"]) -> "DenseWeight":
        """Rows of several matrices of one type and width, stacked (e.g. q, k, v -> one launch)."""
        import cupy

        if len({(w.qtype, w.cols) for w in ws}) != 1:
            raise ValueError("concat needs matrices of one type and one column count")
        return cls(cupy.concatenate([w.data for w in ws], axis=0), ws[0].qtype, ws[0].cols)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def takes_qx(self) -> bool:
        """Whether matvec takes this weight on 8-bit x (qx): fast Q8_0."""
        return self.fast and self.qtype == T.Q8_0

    def plan(self) -> tuple[int, int]:
        """(R, KS): rows per warp, warps splitting a row group's K. Enough warps for the GPU, R=4 for tall ones."""
        return default_plan(self.qtype, self.rows, self.cols)

    def dequantized(self, kind: str = "f16", *, cache: bool = True, stream=None):
        """Dense (rows, cols) copy: kind f16 (cupy float16), bf16 (cupy uint16 holding bf16 bits) or f32."""
        if kind in self._cache:
            return self._cache[kind]
        m = kernels()
        cp = m.cp
        dtype, out_t = {"f16": (cp.float16, 1), "bf16": (cp.uint16, 30), "f32": (cp.float32, 0)}[kind]
        if self.cols % 8:
            raise ValueError("dequantized() needs cols % 8 == 0")
        out = cp.empty((self.rows, self.cols), dtype)
        n = self.rows * (self.cols // 8)
        with _on(stream):
            launch(m.fn("dequant_rows"), ((n + 255) // 256,), (256,),
                                 (self.data, np.int32(int(self.qtype)), np.int32(self.rows), np.int32(self.cols),
                                  np.int64(self.row_bytes), out, np.int32(out_t)))
        if cache:
            self._cache[kind] = out
        return out

    def drop_cache(self) -> None:
        self._cache.clear()


def default_plan(qtype, rows: int, cols: int) -> tuple[int, int]:
    qt = _qtype(qtype)
    f = quants.fmt(qt)
    if qt == T.Q8_0:
        ntiles = -(-(cols // 32) // 32)
    else:
        ntiles = -(-(f.row_bytes(cols) // 16) // 32)
    target = 4096  # warps: ~31 per SM on 132 SMs
    if qt == T.Q8_0:  # measured on the H200 (docs/perf-notes.md): best or within 0.3 us of it at every a3b shape
        if rows >= 16384:
            return (4, 1)
        if rows >= 4096:
            return (2, 1)
        if rows >= 1024:  # o (2048 x 4096): r4k4 took 0.120 ms off a 1K step against r1k1 (s16 plans sweep)
            return (4, 4) if ntiles >= 4 else (1, 1)
        return (1, 2)
    for R in (4, 2):
        if rows // R >= target:
            return (R, 1)
    ks = 1
    while ks < 8 and rows * ks < target and 2 * ks <= ntiles:
        ks *= 2
    return (1, ks)


# =================================================================================================================
# 1. mat-vec
# =================================================================================================================
def matvec(W: DenseWeight, x, y=None, residual=None, *, plan: tuple[int, int] | None = None,
           variant: str | None = None, qx: bool = False, stream=None):
    """y = W x (+ residual); x float32 (cols,), y/residual float32 (rows,) (may be the same array). Returns y.
    plan: (rows per warp, warps per row) from PLANS (default W.plan()); variant: Q8_0 kernel (Q8_VARIANT).
    qx (Q8_0 weights): x is a row quantised to 8 bits, int8 (q8_row_bytes(cols),): its cols codes, then its
    cols / 32 float32 scales (quantize_row, or DecodeAttention's out_q), multiplied in integers (matvec_q8x_ref)."""
    m = kernels()
    cp = m.cp
    if qx:
        if not W.takes_qx:
            raise ValueError(f"8-bit x takes fast Q8_0 weights (got {T(W.qtype).name})")
        _need(x, np.int8, (q8_row_bytes(W.cols),), "x (8-bit)", align=16)
    else:
        _need(x, np.float32, (W.cols,), "x", align=16)
    if y is None:
        y = cp.empty(W.rows, cp.float32)
    _need(y, np.float32, (W.rows,), "y")
    if residual is not None:
        _need(residual, np.float32, (W.rows,), "residual")
    with _on(stream):
        if W.fast:
            q8 = W.qtype == T.Q8_0
            _launch_matvec(m, f"matvec_{'q8_0x' if qx else (variant or Q8_VARIANT) if q8 else QNAME[W.qtype]}", W,
                           plan or W.plan(), (x, _ptr(residual), y), Q8_SMEM_BYTES if q8 else 0)
        else:
            launch(m.fn("matvec_generic"), (-(-W.rows // 8),), (256,),
                                   (W.data, np.int32(int(W.qtype)), np.int32(W.rows), np.int32(W.cols),
                                    np.int64(W.row_bytes), x, _ptr(residual), y))
    return y


def _launch_matvec(m, kernel: str, W: DenseWeight, plan: tuple[int, int], args: tuple, smem: int) -> None:
    """A fast mat-vec kernel (`kernel`_r{R}_k{KS}) over W's rows: (W, rows, ncu, row_bytes) + args."""
    R, KS = plan
    if (R, KS) not in PLANS:
        raise ValueError(f"plan {(R, KS)} not in {PLANS}")
    groups = -(-W.rows // R)  # a warp's R rows, 8 / KS row groups a block
    grid = -(-groups // (8 // KS))
    ncu = W.cols // 32 if W.qtype == T.Q8_0 else W.row_bytes // 16
    launch(m.fn(f"{kernel}_r{R}_k{KS}"), (grid,), (256,),
           (W.data, np.int32(W.rows), np.int32(ncu), np.int64(W.row_bytes)) + args, shared_mem=smem)


def norm_matvec_ok(W: DenseWeight) -> bool:
    """Whether norm_matvec takes W (else: rms_norm, then matvec)."""
    plan = pairwise_plan(W.cols)
    return W.fast and W.cols <= NORM_MV_MAX_N and (plan is None or plan[1] * 8 <= 256)


def norm_matvec(W: DenseWeight, x, norm_w, eps: float, y=None, residual=None, *, quant=None,
                plan: tuple[int, int] | None = None, stream=None):
    """y = W rms_norm(x, norm_w, eps) (+ residual) in one launch (x float32 (cols,)), with the bits of rms_norm then
    matvec; quant (q int8 (1, cols), d float32 (1, cols / 32)) also receives rms_norm's quantised row. The
    normalised row itself is not written. W must pass norm_matvec_ok. Returns y."""
    m = kernels()
    cp = m.cp
    if not norm_matvec_ok(W):
        raise ValueError(f"norm_matvec takes fast weights of at most {NORM_MV_MAX_N} columns (got {W.cols})")
    n = W.cols
    _need(x, np.float32, (n,), "x", align=16)  # staged in float4 (dense.cu stage_row)
    _need(norm_w, np.float32, (n,), "norm_w", align=16)
    if y is None:
        y = cp.empty(W.rows, cp.float32)
    _need(y, np.float32, (W.rows,), "y")
    if residual is not None:
        _need(residual, np.float32, (W.rows,), "residual")
    qd = (np.uint64(0), np.uint64(0))
    if quant is not None:
        if n % 32:
            raise ValueError("quantised output needs cols to be a multiple of 32")
        _need(quant[0], np.int8, (1, n), "q")
        _need(quant[1], np.float32, (1, n // 32), "d")
        qd = tuple(quant)
    R, KS = plan or W.plan()
    R = min(R, 2)  # no four-row variant: the ring is smaller beside the staged row
    L, NL = pairwise_plan(n) or (0, 0)
    q8 = W.qtype == T.Q8_0
    with _on(stream):
        _launch_matvec(m, f"norm_matvec_{QNAME[W.qtype]}", W, (R, KS),
                       (x, _ptr(residual), y, norm_w, np.int32(n), np.int32(L), np.int32(NL), np.float32(eps)) + qd,
                       NORM_MV_Q8_SMEM if q8 else 4 * NORM_MV_MAX_N)
    return y


def q8_row_bytes(n: int) -> int:
    """Bytes of a row of n values quantised to 8 bits (matvec qx's x): n int8 codes, then n / 32 float32 scales."""
    if n % 32:
        raise ValueError(f"an 8-bit row takes a multiple of 32 values (got {n})")
    return n + n // 8


def quantize_row(x: np.ndarray) -> np.ndarray:
    """numpy: x float32 (n,) as matvec qx reads it (canonical.quantize_act's codes, then its scales)."""
    q, d = canonical.quantize_act(np.asarray(x, F32))
    return np.concatenate([q.reshape(-1).view(np.int8), d.view(np.int8)])


def matvec_q8x_ref(raw: np.ndarray, x: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """numpy float64, returned as float32: Q8_0 rows times x quantised to 8 bits a value in groups of 32
    (canonical.quantize_act, the experts' input), each group's integer dot product scaled by both scales: the
    function the qx mat-vecs compute (they sum the scaled terms in float32, in their own order)."""
    raw = np.asarray(raw)
    blocks = raw.reshape(raw.shape[0], -1, 34)
    dw = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    qw = blocks[..., 2:].copy().view(np.int8).astype(np.int64)
    qa, da = canonical.quantize_act(np.asarray(x, F32)[None])
    isum = np.einsum("rbk,bk->rb", qw, qa[0].astype(np.int64))
    y = (dw * da[0].astype(np.float64) * isum).sum(axis=1)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return y.astype(F32)


def matvec_ref(raw: np.ndarray, qtype, x: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """numpy float32: dequantise the rows, W @ x (+ residual) (what ReferenceEngine computes, through BLAS)."""
    w = quants.dequantize(_qtype(qtype), np.asarray(raw))
    y = (w @ np.asarray(x, F32)).astype(F32)
    return y + residual if residual is not None else y


# =================================================================================================================
# 1b. batched (prefill chunk): Y (T, rows) = X (T, cols) W^T (+ residual)
# =================================================================================================================
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77


def dense_batched(W: DenseWeight, X, Y=None, residual=None, *, method: str | None = None, cache: bool = False,
                  stream=None):
    """Y = X W^T (+ residual), X float32 (T, cols), Y float32 (T, rows) (Y may be residual). Returns Y.

    method: "kernel" (own float32 SIMT GEMM on the raw rows: float32-accurate, slow), "f16" / "bf16" (dequantise
    W to fp16/bf16, round X to it, cuBLAS tensor-core GEMM with float32 accumulate and output), "tf32"
    (dequantise to f32, cuBLAS TF32), "sgemm" (dequantise to f32, cuBLAS float32). None: DEFAULT_BATCHED_METHOD.
    cache=True keeps the dequantised copy on W (2 or 4 bytes per weight, no dequantisation per call, no
    allocation: graph-capturable); cache=False dequantises into a pool allocation each call.
    """
    m = kernels()
    cp = m.cp
    method = method or DEFAULT_BATCHED_METHOD
    if method not in BATCHED_METHODS:
        raise ValueError(f"method must be one of {BATCHED_METHODS}")
    if X.ndim != 2 or X.shape[1] != W.cols:
        raise ValueError(f"X must be (T, {W.cols})")
    Tn = int(X.shape[0])
    _need(X, np.float32, None, "X", align=16)
    if Y is None:
        Y = cp.empty((Tn, W.rows), cp.float32)
    _need(Y, np.float32, (Tn, W.rows), "Y")
    if residual is not None:
        _need(residual, np.float32, (Tn, W.rows), "residual")
    if Tn == 0:
        return Y
    with _on(stream):
        if method == "kernel":
            if W.cols % 32:
                raise ValueError("the kernel method needs cols % 32 == 0")
            launch(m.fn("gemm_f32"), (-(-W.rows // 64), -(-Tn // 64)), (256,),
                             (W.data, np.int32(int(W.qtype)), np.int32(W.rows), np.int32(W.cols),
                              np.int64(W.row_bytes), X, np.int64(W.cols), np.int32(Tn), _ptr(residual),
                              np.int64(W.rows), Y, np.int64(W.rows)))
            return Y
        from cupy_backends.cuda.libs import cublas

        kind = {"f16": "f16", "bf16": "bf16", "tf32": "f32", "sgemm": "f32"}[method]
        Wd = W.dequantized(kind, cache=cache, stream=stream)
        if kind == "f32":
            Xc, xt = X, CUDA_R_32F
        else:
            Xc = cp.empty((Tn, W.cols), cp.float16 if kind == "f16" else cp.uint16)
            n = Tn * W.cols
            launch(m.fn("convert_f32"), ((n // 2 + 255) // 256,), (256,),
                                (X, np.int64(n), Xc, np.int32(1 if kind == "f16" else 30)))
            xt = CUDA_R_16F if kind == "f16" else CUDA_R_16BF
        wt = {"f16": CUDA_R_16F, "bf16": CUDA_R_16BF, "f32": CUDA_R_32F}[kind]
        compute = CUBLAS_COMPUTE_32F_FAST_TF32 if method == "tf32" else CUBLAS_COMPUTE_32F
        beta = 0.0
        if residual is not None:
            if residual.data.ptr != Y.data.ptr:
                Y[...] = residual
            beta = 1.0
        alpha_h, beta_h = np.array([1.0], np.float32), np.array([beta], np.float32)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(handle, 0)  # CUBLAS_POINTER_MODE_HOST
        # column-major: Y^T (rows x T) = W (as (cols x rows))^T  X^T (cols x T)
        cublas.gemmEx(handle, 1, 0, W.rows, Tn, W.cols, alpha_h.ctypes.data, Wd.data.ptr, wt, W.cols,
                      Xc.data.ptr, xt, W.cols, beta_h.ctypes.data, Y.data.ptr, CUDA_R_32F, W.rows, compute, -1)
    return Y


def dense_batched_ref(raw: np.ndarray, qtype, X: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    w = quants.dequantize(_qtype(qtype), np.asarray(raw))
    y = (np.asarray(X, F32) @ w.T).astype(F32)
    return y + residual if residual is not None else y


# =================================================================================================================
# 2. RMSNorm
# =================================================================================================================
def pairwise_plan(n: int) -> tuple[int, int] | None:
    """numpy's float32 pairwise-sum tree for a row of n as (leaf size L, leaves NL) when it is NL equal leaves
    in a balanced binary tree (n = L * 2^k with every split exact; L <= 128), else None."""
    if n < 1:
        return None
    m, nl = n, 1
    while m > 128:
        n2 = m // 2
        n2 -= n2 % 8
        if 2 * n2 != m:
            return None
        m, nl = n2, nl * 2
    if nl * 8 > 1024:
        return None
    return m, nl


def rms_norm(x, w, eps: float, y=None, *, quant=None, stream=None):
    """reference.rms_norm over the last axis of x (rows, n) or (n,) float32; w float32 (n,). Returns y.
    quant: (q int8 (rows, n), d float32 (rows, n / 32)) also receive canonical.quantize_act of y (the experts'
    input), in the same launch.

    Bit-identical to numpy when pairwise_plan(n) is not None (n = 64, 128, 256, 2048, 4096, ...)."""
    m = kernels()
    cp = m.cp
    n = int(x.shape[-1])
    rows = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    _need(x, np.float32, None, "x")
    _need(w, np.float32, (n,), "w")
    if y is None:
        y = cp.empty_like(x)
    _need(y, np.float32, x.shape, "y")
    plan = pairwise_plan(n)
    if plan is None:
        L, NL, threads = 0, 0, 256
    else:
        L, NL = plan
        threads = max(256, -(-NL * 8 // 32) * 32)
    staged = 8 * n <= 48 * 1024
    qd = (np.uint64(0), np.uint64(0))
    if quant is not None:
        if n % 32:
            raise ValueError("quantised output needs n to be a multiple of 32")
        _need(quant[0], np.int8, (rows, n), "q")
        _need(quant[1], np.float32, (rows, n // 32), "d")
        qd = tuple(quant)
    with _on(stream):
        launch(m.fn("rms_norm_rows"), (rows,), (threads,), (x, np.int64(n), w, y, np.int64(n), np.int32(n), np.int32(L),
                                                    np.int32(NL), np.float32(eps), np.int32(staged)) + qd,
                              shared_mem=8 * n if staged else 0)
    return y


rms_norm_ref = reference.rms_norm


# =================================================================================================================
# 3. q/k norm + RoPE + KV append
# =================================================================================================================
def rope_tables(max_ctx: int, head_dim: int, base: float,
                scaling: RopeScaling = rope_math.NONE) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 (max_ctx, head_dim/2) of positions 0..max_ctx-1: the reference's own table function (one
    definition; YaRN's mscale is in the table, so the kernels apply any scaling unchanged)."""
    return rope_math.tables(np.arange(max_ctx, dtype=np.int64), head_dim, base, scaling)


class RopeTable:
    """rope_tables uploaded once (a3b, 131072 x 64: 2 x 32 MB)."""

    def __init__(self, max_ctx: int, head_dim: int, base: float, scaling: RopeScaling = rope_math.NONE):
        import cupy

        c, s = rope_tables(max_ctx, head_dim, base, scaling)
        self.max_ctx, self.head_dim, self.base, self.scaling = int(max_ctx), int(head_dim), float(base), scaling
        self.cos, self.sin = cupy.asarray(c), cupy.asarray(s)


V_BLOCK = 16  # positions of a V cache block (dense.cu v_at)


def v_cache_shape(n_kv: int, head_dim: int, max_ctx: int) -> tuple:
    """The V cache's shape: (n_kv, max_ctx / 16, hd, 16), V^T in blocks of 16 positions."""
    if max_ctx % V_BLOCK:
        raise ValueError(f"max_ctx must be a multiple of {V_BLOCK} (the V cache's blocks)")
    return (n_kv, max_ctx // V_BLOCK, head_dim, V_BLOCK)


def v_blocked(vt):
    """V^T (n_kv, hd, max_ctx) -> the V cache's layout, numpy or cupy (a copy)."""
    n_kv, hd, max_ctx = vt.shape
    _, nb, _, blk = v_cache_shape(n_kv, hd, max_ctx)
    return vt.reshape(n_kv, hd, nb, blk).transpose(0, 2, 1, 3).copy()


def v_unblocked(vc):
    """The V cache's layout -> V^T (n_kv, hd, max_ctx), numpy or cupy (a copy)."""
    n_kv, nb, hd, _ = vc.shape
    return vc.transpose(0, 2, 1, 3).reshape(n_kv, hd, nb * V_BLOCK)


def alloc_kv_cache(n_kv: int, max_ctx: int, head_dim: int):
    """One layer's (K, V) caches, zero-filled: K float16 (n_kv, max_ctx, hd), V float16 v_cache_shape."""
    import cupy

    if max_ctx % 64:
        raise ValueError("max_ctx must be a multiple of 64")
    return (cupy.zeros((n_kv, max_ctx, head_dim), cupy.float16),
            cupy.zeros(v_cache_shape(n_kv, head_dim, max_ctx), cupy.float16))


def qk_norm_rope_kv(qkv, q_norm_w, k_norm_w, eps: float, rope: RopeTable, pos, q_out, k_cache, v_cache, *,
                    n_head: int, n_kv: int, stream=None) -> None:
    """qkv float32 (T, (n_head + 2 n_kv) hd) -> q_out (T, n_head, hd) = rope(rms_norm(q)); K cache[:, pos+t] =
    f16(rope(rms_norm(k))); V^T[:, :, pos+t] = f16(v) (v_unblocked's view). pos: device int32 (1,)."""
    m = kernels()
    hd = rope.head_dim
    if qkv.ndim != 2 or qkv.shape[1] != (n_head + 2 * n_kv) * hd:
        raise ValueError("qkv must be (T, (n_head + 2 n_kv) * head_dim)")
    Tn = int(qkv.shape[0])
    _need(qkv, np.float32, None, "qkv")
    _need(q_norm_w, np.float32, (hd,), "q_norm_w")
    _need(k_norm_w, np.float32, (hd,), "k_norm_w")
    _need(pos, np.int32, (1,), "pos")
    _need(q_out, np.float32, (Tn, n_head, hd), "q_out")
    max_ctx = int(k_cache.shape[1])
    _need(k_cache, np.float16, (n_kv, max_ctx, hd), "k_cache")
    _need(v_cache, np.float16, v_cache_shape(n_kv, hd, max_ctx), "v_cache")
    if hd % 2 or hd > 256 or max_ctx > rope.max_ctx:
        raise ValueError("head_dim must be even and <= 256, and the rope table must cover max_ctx")
    heads = n_head + 2 * n_kv
    with _on(stream):
        launch(m.fn("qk_norm_rope_kv"), (-(-heads // 4), Tn), (128,),
                                (qkv, np.int64(qkv.shape[1]), np.int32(Tn), q_norm_w, k_norm_w, np.float32(eps),
                                 rope.cos, rope.sin, pos, q_out, k_cache, v_cache, np.int32(n_head), np.int32(n_kv),
                                 np.int32(hd), np.int32(max_ctx)))


def qk_norm_rope_kv_ref(qkv: np.ndarray, pos0: int, q_norm_w, k_norm_w, eps: float, base: float, n_head: int,
                        n_kv: int, head_dim: int):
    """(q, k, v) float32 as ReferenceEngine.attention makes them: q (T, n_head, hd), k, v (T, n_kv, hd)."""
    Tn = qkv.shape[0]
    qd, kd = n_head * head_dim, n_kv * head_dim
    q = qkv[:, :qd].reshape(Tn, n_head, head_dim)
    k = qkv[:, qd:qd + kd].reshape(Tn, n_kv, head_dim)
    v = qkv[:, qd + kd:].reshape(Tn, n_kv, head_dim)
    q = reference.rms_norm(q, q_norm_w, eps)
    k = reference.rms_norm(k, k_norm_w, eps)
    pos = np.arange(pos0, pos0 + Tn)
    return reference.rope(q, pos, base), reference.rope(k, pos, base), v.astype(F32)


def advance_pos(pos, T_: int = 1, *, stream=None) -> None:
    """pos[0] += T on the device (capture it at the end of a decode step)."""
    m = kernels()
    with _on(stream):
        launch(m.fn("advance_pos"), (1,), (1,), (pos, np.int32(T_)))


# =================================================================================================================
# 4. decode attention
# =================================================================================================================
class DecodeAttention:
    """Split-K GQA attention over one layer's fp16 KV cache for T <= max_T tokens at positions pos + t.

    __call__(q (T, n_head, hd) f32, K cache, V cache, pos, out (T, n_head*hd) f32). Two launches (split, combine).
    ring / pipelined: how the split kernel's warps load their K / V tiles (ATTN_RING, ATTN_PIPELINED); the same bits
    on the same splits.
    head_dim 64 or 128; group = n_head / n_kv <= 16. For T > 1 every token re-reads its own prefix (correct, fine
    for short prompts; a query-tiled prefill kernel is future work).
    """

    def __init__(self, n_head: int, n_kv: int, head_dim: int, max_ctx: int, max_T: int = 1, *, chunk_min: int = 64,
                 nsplit: int | None = None, pipelined: bool | None = None, ring: bool | None = None,
                 combine: str | None = None, combine_cols: int | None = None, device=None):
        m = self.m = kernels(device)
        cp = m.cp
        if head_dim not in (64, 128):
            raise ValueError("head_dim must be 64 or 128")
        if n_head % n_kv or n_head // n_kv > 16:
            raise ValueError("n_head must be a multiple of n_kv, group <= 16")
        self.n_head, self.n_kv, self.hd, self.max_ctx = n_head, n_kv, head_dim, int(max_ctx)
        self.group = n_head // n_kv
        self.max_T, self.chunk_min = int(max_T), int(chunk_min)
        pipelined = ATTN_PIPELINED if pipelined is None else pipelined
        v_cache_shape(n_kv, head_dim, max_ctx)  # max_ctx in whole V blocks
        self.ring = ATTN_RING if ring is None else ring
        g16 = self.group > 8
        base = f"attn_split_hd{head_dim}_g{16 if g16 else 8}"
        self.name = base + ("_ring" if self.ring else "_pipe" if pipelined else "")
        # decode steps: the split kernel with qk_norm_rope_kv's work, the same load path
        self.qkv_name = base + "_qkv" + ("_ring" if self.ring else "" if pipelined else "_plain")
        # the ring: STAGES tiles of K and V^T (16 positions) for each of the 4 warps
        self.smem = 4 * ATTN_RING_STAGES[g16] * 16 * head_dim * 2 * 2 if self.ring else 0
        self.combine = combine or ATTN_COMBINE
        if self.combine not in ATTN_COMBINES:
            raise ValueError(f"combine must be one of {', '.join(ATTN_COMBINES)}")
        self.cols = min(head_dim // 4, combine_cols or ATTN_COMBINE_COLS)
        if 128 % self.cols or (head_dim // 4) % self.cols:
            raise ValueError(f"combine_cols must divide 128 and head_dim / 4 (got {self.cols})")
        with m.device:
            # one split geometry for both kernels (the same registers today), so that step() has attention's bits
            self.capacity = m.n_sm * min(m.blocks_per_sm(self.name, 128, self.smem),
                                         m.blocks_per_sm(self.qkv_name, 128, self.smem))
            for name in (self.name, self.qkv_name):
                if self.smem:
                    m.fn(name).max_dynamic_shared_size_bytes = self.smem
            self._nsplit_fixed = nsplit
            cap = max(self.nsplit(t) * t for t in range(1, self.max_T + 1))
            self.part_o = cp.empty(cap * n_kv * self.group * head_dim, cp.float32)
            self.part_ml = cp.empty(cap * n_kv * self.group * 2, cp.float32)
        self.scale_log2 = np.float32(math.log2(math.e) / math.sqrt(head_dim))

    def nsplit(self, T_: int = 1) -> int:
        if self._nsplit_fixed:
            return int(self._nsplit_fixed)
        return max(1, self.capacity // (self.n_kv * T_))

    def step(self, qkv, q_norm_w, k_norm_w, eps: float, rope: RopeTable, pos, k_cache, v_cache, out, *,
             out_q=None, pdl: bool = True, stream=None) -> None:
        """A decode step's qk_norm_rope_kv (T = 1; q_out not written) and attention in one split launch and the
        combine: qkv float32 (1, (n_head + 2 n_kv) hd); the same bits as the two calls. out_q: as __call__'s."""
        m, hd = self.m, self.hd
        _need(qkv, np.float32, (1, (self.n_head + 2 * self.n_kv) * hd), "qkv")
        _need(q_norm_w, np.float32, (hd,), "q_norm_w")
        _need(k_norm_w, np.float32, (hd,), "k_norm_w")
        if rope.head_dim != hd or rope.max_ctx < self.max_ctx:
            raise ValueError("the rope table must have this head_dim and cover max_ctx")
        self._launch(m.fn(self.qkv_name), (qkv, q_norm_w, k_norm_w, np.float32(eps), rope.cos, rope.sin, k_cache,
                                           v_cache), k_cache, v_cache, pos, out, 1, pdl, stream, out_q)

    def __call__(self, q, k_cache, v_cache, pos, out, T_: int = 1, *, out_q=None, pdl: bool = True,
                 stream=None) -> None:
        """pdl: the split kernel may start under its predecessor's tail (in a graph; see ATTN_PDL_MAX_CTX).
        out_q (T = 1, the one-pass combine; int8 (q8_row_bytes(n_head hd),)): the output row quantised to 8 bits
        as well, by the combine (quantize_row's layout), for matvec qx."""
        _need(q, np.float32, (T_, self.n_head, self.hd), "q")
        self._launch(self.m.fn(self.name), (q, k_cache, v_cache), k_cache, v_cache, pos, out, T_, pdl, stream,
                     out_q)

    def quantizes(self) -> bool:
        """Whether the combine can write out_q (the one-pass combine; groups of 32 values within a block)."""
        return self.combine == "attn_combine_1p" and self.cols % 8 == 0

    def _launch(self, split, first: tuple, k_cache, v_cache, pos, out, T_: int, pdl: bool, stream,
                out_q=None) -> None:
        """The split kernel (its own leading arguments `first`) and the combine."""
        m = self.m
        if not 1 <= T_ <= self.max_T:
            raise ValueError(f"T must be in [1, {self.max_T}]")
        _need(k_cache, np.float16, (self.n_kv, self.max_ctx, self.hd), "k_cache", align=16)
        _need(v_cache, np.float16, v_cache_shape(self.n_kv, self.hd, self.max_ctx), "v_cache", align=16)
        _need(pos, np.int32, (1,), "pos")
        _need(out, np.float32, (T_, self.n_head * self.hd), "out")
        n = self.n_head * self.hd
        qd = (np.uint64(0), np.uint64(0))
        if out_q is not None:
            if T_ != 1 or not self.quantizes():
                raise ValueError("out_q takes one token and the one-pass combine with a multiple of 8 columns")
            _need(out_q, np.int8, (q8_row_bytes(n),), "out_q", align=16)
            qd = (out_q, out_q[n:])
        ns = self.nsplit(T_)
        common = (np.int32(self.n_head), np.int32(self.n_kv), np.int32(self.max_ctx), np.int32(ns),
                  np.int32(self.chunk_min))
        with _on(stream):
            launch(split, (ns, self.n_kv, T_), (128,), first + (pos,) + common +
                   (self.scale_log2, self.part_o, self.part_ml), shared_mem=self.smem, pdl=pdl)
            cargs = (self.part_o, self.part_ml, pos, np.int32(self.n_head), np.int32(self.n_kv), np.int32(self.hd),
                      np.int32(self.max_ctx), np.int32(ns), np.int32(self.chunk_min))
            if self.combine != "attn_combine_v1":  # blocks of self.cols float4 columns
                extra = qd if self.combine == "attn_combine_1p" else ()
                launch(m.fn(self.combine), (self.n_head, T_, self.hd // 4 // self.cols), (128,),
                       cargs + (np.int32(self.cols), out) + extra,
                       shared_mem=4 * ns if self.combine == "attn_combine" else 0)
            else:
                launch(m.fn(self.combine), (self.n_head, T_), (128,), cargs + (out,), shared_mem=4 * ns)


class PrefillAttention:
    """GQA attention for a prompt chunk of T tokens at positions pos0 + t over the whole cached prefix, flash style
    on tensor cores (dense.cu section 5): fp16 Q and P, float32 accumulation, the scores never leave the chip, so
    memory stays O(T) at any context. Same arguments as DecodeAttention but pos0 is a host int: prompts are read
    eagerly, not in graphs. Measured error against attention_ref: tests/test_gpu_dense.py."""

    BLOCK_ROWS, KEY_TILE = 128, 64  # FA_BM, FA_BN in dense.cu (16 rows a warp)

    def __init__(self, n_head: int, n_kv: int, head_dim: int, max_ctx: int, *, q_smem: bool | None = None,
                 device=None):
        """q_smem: Q's tile in shared memory, two blocks an SM (FaShape<HD, true>); default FLASH_Q_SMEM."""
        self.m = kernels(device)
        if n_head % n_kv:
            raise ValueError("n_head must be a multiple of n_kv")
        if head_dim not in (64, 128):
            raise ValueError("head_dim must be 64 or 128")
        if max_ctx % self.KEY_TILE:
            raise ValueError(f"max_ctx must be a multiple of {self.KEY_TILE} (key tiles are read whole)")
        self.n_head, self.n_kv, self.hd, self.max_ctx = n_head, n_kv, head_dim, int(max_ctx)
        self.group = n_head // n_kv
        self.scale = np.float32(1.0 / math.sqrt(head_dim))
        q_smem = FLASH_Q_SMEM if q_smem is None else q_smem
        self.fn = self.m.fn(f"attn_flash_prefill_{head_dim}" + ("_qs" if q_smem else ""))
        # FaShape: the Q tile's rows (hd + 8 halfs) where q_smem, then the stages of a key tile (3, or 2 with the Q
        # tile), each K rows (hd + 8 halfs) and V^T rows (64 + 8 halfs)
        stage = self.KEY_TILE * (head_dim + 8) + head_dim * (self.KEY_TILE + 8)
        self.smem = 2 * (self.BLOCK_ROWS * (head_dim + 8) + 2 * stage if q_smem else 3 * stage)
        self.fn.max_dynamic_shared_size_bytes = self.smem

    def __call__(self, q, k_cache, v_cache, pos0: int, out, *, stream=None) -> None:
        Tn, hd = int(q.shape[0]), self.hd
        if not (Tn >= 1 and int(pos0) >= 0 and int(pos0) + Tn <= self.max_ctx):
            raise ValueError(f"positions {pos0}..{int(pos0) + Tn - 1} outside the cache of {self.max_ctx}")
        _need(q, np.float32, (Tn, self.n_head, hd), "q")
        _need(k_cache, np.float16, (self.n_kv, self.max_ctx, hd), "k_cache")
        _need(v_cache, np.float16, v_cache_shape(self.n_kv, hd, self.max_ctx), "v_cache")
        _need(out, np.float32, (Tn, self.n_head * hd), "out")
        m = self.m
        cp = m.cp
        R, nkv = Tn * self.group, self.n_kv  # query rows per kv head
        n = Tn * self.n_head * hd
        with _on(stream):
            qp = cp.empty((nkv, R, hd), cp.float16)
            o = cp.empty((nkv, R, hd), cp.float32)
            launch(m.fn("attn_q_pack"), ((n + 255) // 256,), (256,), (q, np.int32(Tn), np.int32(self.n_head),
                                                               np.int32(nkv), np.int32(hd), self.scale, qp))
            launch(self.fn, ((R + self.BLOCK_ROWS - 1) // self.BLOCK_ROWS, nkv), (self.BLOCK_ROWS * 2,),
                   (qp, k_cache, v_cache, np.int32(R), np.int32(self.group), np.int32(pos0),
                    np.int32(self.max_ctx), o), shared_mem=self.smem)
            launch(m.fn("attn_o_unpack"), ((n + 255) // 256,), (256,), (o, np.int32(Tn), np.int32(self.n_head),
                                                                 np.int32(nkv), np.int32(hd), out))


def attention_ref(q: np.ndarray, K: np.ndarray, V: np.ndarray, pos0: int) -> np.ndarray:
    """ReferenceEngine.attention's core: q (T, n_head, hd) at positions pos0 + t, K/V (S, n_kv, hd) (S >= pos0+T)
    -> (T, n_head*hd). Computes in the inputs' float type (pass float64 for a high-precision oracle)."""
    Tn, n_head, hd = q.shape
    n_kv = K.shape[1]
    S = pos0 + Tn
    K, V = K[:S], V[:S]
    dt = np.result_type(q.dtype, K.dtype)
    g = n_head // n_kv
    pos = np.arange(pos0, pos0 + Tn)
    qg = q.reshape(Tn, n_kv, g, hd)
    s = np.einsum("tkgd,skd->kgts", qg, K) * dt.type(1 / np.sqrt(hd))
    s = np.where(pos[:, None] >= np.arange(S)[None, :], s, dt.type(-np.inf))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return np.einsum("kgts,skd->tkgd", p, V).reshape(Tn, n_head * hd).astype(dt)


# =================================================================================================================
# 5. router
# =================================================================================================================
def route(logits, k: int, ids=None, weights=None, *, stream=None):
    """logits float32 (T, n) -> ids int32 (T, k), weights float32 (T, k): softmax, top-k descending (ties to the
    lower index), renormalised. Ranked by the float32 probabilities as numpy ranks them (underflowed zeros tie and
    go by index, as in numpy); ids equal reference.route's unless CUDA's expf and numpy's exp round two nearly
    equal logits into a different order or tie (<= 2 ulp apart). n <= 1024, k <= 32; the softmax sums use numpy's
    pairwise order (exact for n <= 512). Returns (ids, weights)."""
    m = kernels()
    cp = m.cp
    if logits.ndim == 1:
        logits = logits.reshape(1, -1)
    Tn, n = logits.shape
    if n > 1024 or k > 32 or k > n:
        raise ValueError("route supports n <= 1024 and k <= min(32, n)")
    _need(logits, np.float32, None, "logits")
    if ids is None:
        ids = cp.empty((Tn, k), cp.int32)
    if weights is None:
        weights = cp.empty((Tn, k), cp.float32)
    _need(ids, np.int32, (Tn, k), "ids")
    _need(weights, np.float32, (Tn, k), "weights")
    with _on(stream):
        launch(m.fn("route_topk"), (Tn,), (32,), (logits, np.int64(n), np.int32(n), np.int32(k), ids, weights))
    return ids, weights


route_ref = reference.route


# =================================================================================================================
# 6. argmax and sampling
# =================================================================================================================
class Argmax:
    """np.argmax on the device (first index of the maximum; NaN counts as the maximum; -0 == +0), one launch."""

    def __init__(self, n: int, *, blocks: int | None = None, device=None):
        m = self.m = kernels(device)
        cp = m.cp
        self.n = int(n)
        self.blocks = int(blocks or max(1, min(2 * m.n_sm, -(-self.n // 1024))))
        with m.device:
            self.part = cp.empty(self.blocks, cp.uint64)
            self.counter = cp.zeros(1, cp.uint32)

    def __call__(self, x, out, *, stream=None) -> None:
        _need(x, np.float32, (self.n,), "x")
        _need(out, np.int32, (1,), "out")
        with _on(stream):
            launch(self.m.fn("argmax_k"), (self.blocks,), (256,), (x, np.int32(self.n), self.part, self.counter, out))


def argmax_ref(x: np.ndarray) -> int:
    return int(np.argmax(x))


def sampling_params(temperature: float, top_k: int, top_p: float, u: float) -> np.ndarray:
    """The device sampler's params array (float64 [temperature, top_k, top_p, u]); upload with cupy.asarray or
    copy into a resident (4,) float64 buffer before each graph replay."""
    return np.array([temperature, top_k, top_p, u], np.float64)


def _need_sample(n: int, logits, params, out) -> None:
    """A sampler's arguments: logits float32 (n,), params float64 (4,) (sampling_params), out int32 (1,)."""
    _need(logits, np.float32, (n,), "logits")
    _need(params, np.float64, (4,), "params")
    _need(out, np.int32, (1,), "out")


class DeviceSampler:
    """Temperature / top-k / top-p sampling with a given uniform u, two launches; the algorithm is exactly
    sample_ref's (see there). Greedy (temperature <= 0) gives np.argmax's token."""

    def __init__(self, n: int, *, device=None):
        m = self.m = kernels(device)
        cp = m.cp
        self.n = int(n)
        self.nb = -(-self.n // SAMPLE_CHUNK)
        P = 1
        while P < self.nb:
            P <<= 1
        self.smem = P * SAMPLE_KMAX * 8
        if self.smem > m.smem_optin - 4096:
            raise ValueError(f"vocabulary of {n} too large for the one-block merge ({self.smem} bytes)")
        with m.device:
            self.cand = cp.empty(self.nb * SAMPLE_KMAX, cp.uint64)
            f = m.fn("topk_sample")
            f.max_dynamic_shared_size_bytes = self.smem

    def __call__(self, logits, params, out, *, stream=None) -> None:
        _need_sample(self.n, logits, params, out)
        m = self.m
        with _on(stream):
            launch(m.fn("topk_stage1"), (self.nb,), (1024,), (logits, np.int32(self.n), self.cand))
            launch(m.fn("topk_sample"), (1,), (1024,), (self.cand, np.int32(self.nb), logits, np.int32(self.n), params, out),
                                shared_mem=self.smem)


def candidate_order(x: np.ndarray) -> np.ndarray:
    """Indices by (logit descending, index ascending), NaN above +inf and -0 == +0 (the device's sort key)."""
    b = np.ascontiguousarray(x, F32).view(np.uint32).copy()
    b[b == 0x80000000] = 0
    neg = (b & 0x80000000) != 0
    key = np.where(neg, ~b, b | np.uint32(0x80000000)).astype(np.int64)
    key[np.isnan(np.asarray(x, F32))] = 0xFFFFFFFF
    return np.lexsort((np.arange(b.size), -key))


class CdfSampler:
    """Temperature sampling over the whole vocabulary (no top-k or top-p): the host Sampler's inverse CDF in
    vocabulary order, in float64 with the sums in another order (the same token but where u falls within float64
    rounding of a boundary). Two launches; params as for DeviceSampler (temperature > 0 and u are read)."""

    def __init__(self, n: int, *, device=None):
        m = self.m = kernels(device)
        cp = m.cp
        self.n = int(n)
        self.nb = -(-self.n // CDF_CHUNK)
        with m.device:
            self.pmax = cp.empty(self.nb, cp.float32)
            self.psum = cp.empty(self.nb, cp.float64)
            self.counter = cp.zeros(1, cp.uint32)

    def __call__(self, logits, params, out, *, stream=None) -> None:
        _need_sample(self.n, logits, params, out)
        m = self.m
        with _on(stream):
            launch(m.fn("cdf_max"), (self.nb,), (256,), (logits, np.int32(self.n), self.pmax))
            launch(m.fn("cdf_sample"), (self.nb,), (256,), (logits, np.int32(self.n), self.pmax, params, self.psum,
                                                            self.counter, out))


def sample_ref(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The device sampler's algorithm in numpy (float64):
      K = top_k if 0 < top_k <= 256 else 256 (and <= n): the candidates are the K largest logits, ties to the
      lower index, in that order (so top_k = 0 keeps the 256 most likely tokens, not the whole vocabulary).
      temperature <= 0: the first candidate (= np.argmax).
      z_j = logit_j / temperature; e_j = exp(z_j - z_0); S = cumsum(e);
      keep = K if top_p >= 1 else 1 + first j with S_j >= top_p * T, T = S_{K-1}, or without a top-k (top_k <= 0
      or >= n) T = the sum of exp(logit / temperature - z_0) over the whole vocabulary (the host's top-p), and
      -1 if the nucleus is wider than the K candidates (S_{K-1} < top_p * T: left to the host);
      token = candidate i, i = first j < keep with S_j > u * S_{keep-1} (keep-1 if none).
    Same distribution as stratad.engine.sampling.Sampler on the kept candidates; the device gives the same token
    for the same u except when u falls within float64 rounding (~1e-16) of a boundary."""
    x = np.asarray(logits, F32)
    n = x.shape[0]
    K = top_k if 0 < top_k <= SAMPLE_KMAX else SAMPLE_KMAX
    K = min(K, n)
    order = candidate_order(x)[:K]
    if not temperature > 0:
        return int(order[0])
    z = x[order].astype(np.float64) / temperature
    S = np.cumsum(np.exp(z - z[0]))
    keep = K
    if top_p < 1:
        total = S[K - 1]
        if top_k <= 0 or top_k >= n:
            total = np.exp(x.astype(np.float64) / temperature - z[0]).sum()
            if S[K - 1] < top_p * total:
                return -1
        keep = int(np.argmax(S >= top_p * total)) + 1
    r = u * S[keep - 1]
    hit = np.flatnonzero(S[:keep] > r)
    return int(order[hit[0] if hit.size else keep - 1])


# =================================================================================================================
# 7. embedding
# =================================================================================================================
def embed(table: DenseWeight, tokens, out=None, *, stream=None):
    """out[t] = dequantised row tokens[t] of the table (tokens: device int32 (T,)); a bad id gives a NaN row."""
    m = kernels()
    cp = m.cp
    _need(tokens, np.int32, None, "tokens")
    Tn = int(tokens.shape[0])
    if out is None:
        out = cp.empty((Tn, table.cols), cp.float32)
    _need(out, np.float32, (Tn, table.cols), "out")
    with _on(stream):
        launch(m.fn("embed_rows"), (Tn,), (256,), (table.data, np.int32(int(table.qtype)), np.int32(table.rows),
                                           np.int32(table.cols), np.int64(table.row_bytes), tokens, out))
    return out


def embed_ref(raw: np.ndarray, qtype, tokens) -> np.ndarray:
    return quants.dequantize(_qtype(qtype), np.asarray(raw)[np.asarray(tokens, np.int64)])
