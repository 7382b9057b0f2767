"""Mat-vecs over GGUF rows (matvec.cu): a decode step's projections and LM head, the RMSNorm folded into the one
that reads it, and the o projection on an 8-bit x; numpy references beside them (a packed weight, weights.PackedRows,
holds the file's values: rq_values_ref).

  matvec(W, x, y, residual)               matvec_ref(raw, qtype, x, residual)
  matvec(W, xq, y, qx=True)               matvec_qx_ref(raw, qtype, x, residual)
  norm_matvec(W, x, norm_w, eps, y)       matvec_ref(raw, qtype, norm.rms_norm_ref(x, norm_w, eps))
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from stratad.engine import canonical
from stratad.model import quants

from .decode_tables import device_tables
from .device import FILE_BLK, QNAME, dense_qtype, module, need, on_stream, ptr
from .launch import launch
from .norm import pairwise_plan
from .weights import (DQ_PLANS, NORM_MV_MAX_N, PAIR_PLANS, PLANS, QX_TYPES, DenseWeight, PackedRows, StackedWeight,
                      blk_smem, dq_span, rq_smem)

SOURCE = "matvec.cu"
F32 = np.float32


def matvec(W: DenseWeight | StackedWeight, x, y=None, residual=None, *, plan: tuple[int, int] | None = None,
           qx: bool = False, stream=None):
    """y = W x (+ residual); x float32 (cols,), y/residual float32 (rows,) (may be the same array). Returns y.
    plan: (rows per warp, warps per row) from PLANS for a fast or packed weight, from DQ_PLANS for the others
    (decode.cuh's per-type mat-vec); default W.plan(). A StackedWeight that is not packed runs each part with its
    own plan.
    qx (weights.QX_TYPES): x is a row quantised to 8 bits, int8 (q8_row_bytes(cols),): its cols codes, then its
    cols / 32 float32 scales (quantize_row, or DecodeAttention's out_q), multiplied in integers (matvec_qx_ref)."""
    m = module(SOURCE)
    if qx:
        if not W.takes_qx:
            raise ValueError(f"8-bit x takes fast {' or '.join(t.name for t in QX_TYPES)} weights (got {_type_name(W)})")
        need(x, np.int8, (q8_row_bytes(W.cols),), "x (8-bit)", align=16)
    else:
        need(x, np.float32, (W.cols,), "x", align=16)
    if y is None:
        y = m.cp.empty(W.rows, m.cp.float32)
    need(y, np.float32, (W.rows,), "y")
    if residual is not None:
        need(residual, np.float32, (W.rows,), "residual")
    if isinstance(W, StackedWeight) and W.packed is None:
        if plan is not None:
            raise ValueError("a stack of float and quantised parts runs each part with its own plan")
        for p, r0 in W.row_slices():
            matvec(p, x, y[r0:r0 + p.rows], None if residual is None else residual[r0:r0 + p.rows], stream=stream)
        return y
    with on_stream(stream):
        tab = device_tables()
        if W.packed is not None:
            P = W.packed
            _launch_matvec(m, f"matvec_{P.name}{'x' if qx else ''}", P, P.cols // 32, plan or P.plan(),
                           (x, ptr(residual), y, tab), rq_smem(P.fmt, norm=False))
        elif W.fast:
            blk = W.qtype in FILE_BLK
            _launch_matvec(m, f"matvec_{QNAME[W.qtype]}{'x' if qx else ''}", W, _fast_ncu(W), plan or W.plan(),
                           (x, ptr(residual), y, tab), blk_smem(W.qtype, norm=False) if blk else 0)
        else:  # decode.cuh's mat-vec of this type: the weight's tables, then x, residual, y
            _launch_matvec(m, f"matvec_dq_{W.name}", W, W.cols // dq_span(W.qtype), plan or W.plan(),
                           (W.tab, x, ptr(residual), y), 0, plans=DQ_PLANS)
    return y


def _type_name(W) -> str:
    return T(W.qtype).name if isinstance(W, DenseWeight) else "a stack of types"


def _fast_ncu(W: DenseWeight) -> int:
    """What a fast row is counted in: 32-value sub-blocks of a block type, or 16-byte chunks of a float type."""
    return W.cols // 32 if W.qtype in FILE_BLK else W.row_bytes // 16


def _blocks(rows: int, plan: tuple[int, int]) -> int:
    """Blocks of a mat-vec launch over rows: a warp's R rows, 8 / KS row groups a block."""
    R, KS = plan
    return -(-(-(-rows // R)) // (8 // KS))


def _launch_matvec(m, kernel: str, W: DenseWeight | PackedRows, ncu: int, plan: tuple[int, int], args: tuple,
                   smem: int, *, plans=PLANS, extra_blocks: int = 0) -> None:
    """A mat-vec kernel (`kernel`_r{R}_k{KS}) over W's rows: (W, rows, ncu, row_bytes) + args. ncu: what a row is
    counted in (32-value sub-blocks, 16-byte chunks or decode.cuh spans). extra_blocks: a pair's second matrix's."""
    R, KS = plan
    if (R, KS) not in plans:
        raise ValueError(f"plan {(R, KS)} not in {plans}")
    launch(m.fn(f"{kernel}_r{R}_k{KS}", smem), (_blocks(W.rows, plan) + extra_blocks,), (256,),
           (W.data, np.int32(W.rows), np.int32(ncu), np.int64(W.row_bytes)) + args, shared_mem=smem)


def norm_matvec_ok(W: DenseWeight | StackedWeight) -> bool:
    """Whether norm_matvec takes W (else: rms_norm, then matvec)."""
    plan = pairwise_plan(W.cols)
    return ((W.fast or W.packed is not None or getattr(W, "pair", False)) and W.cols <= NORM_MV_MAX_N
            and (plan is None or plan[1] * 8 <= 256))


def norm_matvec(W: DenseWeight | StackedWeight, x, norm_w, eps: float, y=None, residual=None, *, quant=None,
                plan: tuple[int, int] | None = None, stream=None):
    """y = W rms_norm(x, norm_w, eps) (+ residual) in one launch (x float32 (cols,)), with the bits of rms_norm then
    matvec; quant (q int8 (1, cols), d float32 (1, cols / 32)) also receives rms_norm's quantised row. The
    normalised row itself is not written. W must pass norm_matvec_ok. Returns y."""
    m = module(SOURCE)
    cp = m.cp
    if not norm_matvec_ok(W):
        raise ValueError(f"norm_matvec takes fast or packed weights of at most {NORM_MV_MAX_N} columns "
                         f"(got {_type_name(W)}, {W.cols})")
    n = W.cols
    need(x, np.float32, (n,), "x", align=16)  # staged in float4 (matvec.cuh stage_row)
    need(norm_w, np.float32, (n,), "norm_w", align=16)
    if y is None:
        y = cp.empty(W.rows, cp.float32)
    need(y, np.float32, (W.rows,), "y")
    if residual is not None:
        need(residual, np.float32, (W.rows,), "residual")
    qd = (np.uint64(0), np.uint64(0))
    if quant is not None:
        if n % 32:
            raise ValueError("quantised output needs cols to be a multiple of 32")
        need(quant[0], np.int8, (1, n), "q")
        need(quant[1], np.float32, (1, n // 32), "d")
        qd = tuple(quant)
    R, KS = plan or W.plan()
    R = min(R, 2)  # no four-row variant: the ring is smaller beside the staged row
    L, NL = pairwise_plan(n) or (0, 0)
    with on_stream(stream):
        args = (x, ptr(residual), y, norm_w, np.int32(n), np.int32(L), np.int32(NL), np.float32(eps)) + qd + \
            (device_tables(),)
        if getattr(W, "pair", False):  # two file types: the first matrix's blocks, then the second's
            A, B = W.parts
            _launch_matvec(m, f"norm_matvec2_{A.name}_{B.name}", A, n // 32, (R, KS),
                           args + (B.data, np.int32(B.rows), np.int64(B.row_bytes), np.int32(_blocks(A.rows, (R, KS)))),
                           max(blk_smem(A.qtype, norm=True), blk_smem(B.qtype, norm=True)), plans=PAIR_PLANS,
                           extra_blocks=_blocks(B.rows, (R, KS)))
        elif W.packed is not None:
            P = W.packed
            _launch_matvec(m, f"norm_matvec_{P.name}", P, n // 32, (R, KS), args, rq_smem(P.fmt, norm=True))
        else:
            blk = W.qtype in FILE_BLK
            _launch_matvec(m, f"norm_matvec_{QNAME[W.qtype]}", W, _fast_ncu(W), (R, KS), args,
                           blk_smem(W.qtype, norm=True) if blk else 4 * NORM_MV_MAX_N)
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


def matvec_qx_ref(raw: np.ndarray, qtype, x: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """numpy float64, returned as float32: rows of a QX type (weights.QX_TYPES: int8 codes and a float32 scale a
    32-value sub-block, decode_int's view) times x quantised to 8 bits a value in groups of 32
    (canonical.quantize_act, the experts' input), each group's integer dot product scaled by both scales: the
    function the qx mat-vecs compute (they sum the scaled terms in float32, in their own order)."""
    qt = dense_qtype(qtype)
    if qt not in QX_TYPES:
        raise ValueError(f"8-bit x takes {[t.name for t in QX_TYPES]} rows (got {qt.name})")
    v = quants.decode_int(qt, np.asarray(raw))
    qa, da = canonical.quantize_act(np.asarray(x, F32)[None])
    isum = np.einsum("rbk,bk->rb", v.q.astype(np.int64), qa[0].astype(np.int64))
    y = (v.scale.astype(np.float64) * da[0].astype(np.float64) * isum).sum(axis=1)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return y.astype(F32)


def matvec_ref(raw: np.ndarray, qtype, x: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """numpy float32: dequantise the rows, W @ x (+ residual) (what ReferenceEngine computes, through BLAS)."""
    w = quants.dequantize(dense_qtype(qtype), np.asarray(raw))
    y = (w @ np.asarray(x, F32)).astype(F32)
    return y + residual if residual is not None else y


def rq_values_ref(packed: np.ndarray, fmt: tuple[int, int]) -> np.ndarray:
    """numpy float32: the values of packed rows (uint8 (rows, blocks * block bytes), decode.cuh rq_pack's layout:
    fmt[0] float32 scales, fmt[1] float32 minimums, 32 int8 codes a block): scale[h] * code - minimum[h], h the
    value's 16-value half where a block has two scales."""
    ns, nm = fmt
    bb = 32 + 4 * (ns + nm)
    blocks = np.ascontiguousarray(packed).reshape(packed.shape[0], -1, bb)
    f = blocks[..., :4 * (ns + nm)].copy().view(np.float32)
    code = blocks[..., 4 * (ns + nm):].view(np.int8).astype(np.float32)
    half = np.arange(32) // 16 if ns == 2 else np.zeros(32, np.int64)
    scale = f[..., :ns][..., half]
    v = scale * code
    if nm:
        v = v - f[..., ns:][..., half if nm == 2 else np.zeros(32, np.int64)]
    return v.reshape(packed.shape[0], -1).astype(np.float32)
