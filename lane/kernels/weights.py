"""A dense GGUF matrix on the device (the rows as the file holds them) and its mat-vec launch plan.

The dense types (F32, F16, BF16, Q8_0) are decoded by the kernels themselves (dense_common.cuh, load_elem and the
mat-vec bodies); `DenseWeight.dequantized` makes the float16 copy a prompt chunk's cuBLAS GEMM reads.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from stratad.model import quants

from .device import dense_qtype, module, need, on_stream
from .launch import launch

# (rows per warp, warps per row group). With KS > 1 and R > 1 a warp reads its K slice of x once for R rows: the
# activation's shared-memory / L1 traffic (4 bytes a weight at R = 1, against 1 byte of weights) falls by R.
PLANS = ((4, 1), (2, 1), (1, 1), (1, 2), (1, 4), (1, 8), (4, 2), (4, 4), (2, 2), (2, 4))


class DenseWeight:
    """A dense GGUF matrix on the device: rows x row_bytes raw bytes (cupy uint8), its type and column count."""

    def __init__(self, data, qtype, cols: int):
        import cupy

        self.qtype = dense_qtype(qtype)
        self.cols = int(cols)
        self.row_bytes = quants.fmt(self.qtype).row_bytes(self.cols)
        if not isinstance(data, cupy.ndarray):
            raise TypeError("data must be a cupy array (use DenseWeight.upload for host data)")
        data = data.view(cupy.uint8).reshape(-1, self.row_bytes)
        need(data, np.uint8, None, "data", align=1)
        self.data = data
        self.rows = int(data.shape[0])
        granule = 256 if self.qtype == T.Q8_0 else 1
        self.fast = (self.row_bytes % 16 == 0 and data.data.ptr % 16 == 0 and self.cols % granule == 0)
        self._cache = None  # the float16 copy, once dequantized(cache=True) made it

    @classmethod
    def upload(cls, raw: np.ndarray, qtype, cols: int | None = None) -> "DenseWeight":
        """From host rows: uint8 (rows, row_bytes) as ModelFile.raw gives them (or a float array of the type)."""
        import cupy

        qt = dense_qtype(qtype)
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

    def dequantized(self, *, cache: bool = True, stream=None):
        """Dense (rows, cols) float16 copy (gemm.py's cuBLAS operand); cache=True keeps it on this weight."""
        if self._cache is not None:
            return self._cache
        m = module("gemm.cu")
        cp = m.cp
        if self.cols % 8:
            raise ValueError("dequantized() needs cols % 8 == 0")
        out = cp.empty((self.rows, self.cols), cp.float16)
        n = self.rows * (self.cols // 8)
        with on_stream(stream):
            launch(m.fn("dequant_rows"), ((n + 255) // 256,), (256,),
                   (self.data, np.int32(int(self.qtype)), np.int32(self.rows), np.int32(self.cols),
                    np.int64(self.row_bytes), out, np.int32(1)))  # 1: GGML's F16 type code
        if cache:
            self._cache = out
        return out

    def drop_cache(self) -> None:
        self._cache = None


def default_plan(qtype, rows: int, cols: int) -> tuple[int, int]:
    qt = dense_qtype(qtype)
    f = quants.fmt(qt)
    if qt == T.Q8_0:
        ntiles = -(-(cols // 32) // 32)
    else:
        ntiles = -(-(f.row_bytes(cols) // 16) // 32)
    target = 4096  # warps: ~31 per SM on 132 SMs
    if qt == T.Q8_0:  # measured on the H200, each a3b shape's best plan (docs/perf-notes.md, the plan sweep)
        if rows >= 16384:
            return (4, 1)
        if rows >= 4096:
            return (2, 1)
        if rows >= 1024:  # o (2048 x 4096): four rows a warp, each row's tiles over four warps
            return (4, 4) if ntiles >= 4 else (1, 1)
        return (1, 2)
    for R in (4, 2):
        if rows // R >= target:
            return (R, 1)
    ks = 1
    while ks < 8 and rows * ks < target and 2 * ks <= ntiles:
        ks *= 2
    return (1, ks)
