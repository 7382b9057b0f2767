"""A prompt chunk's dense projections: Y = X W^T (+ residual) on cuBLAS's fp16 tensor cores (float32 accumulate
and output), W dequantised to fp16 once (gemm.cu dequant_rows_<type>, decode.cuh's decode; kept on the weight), X
rounded to fp16 (convert_f32).

  dense_batched(W, X, Y, residual)    dense_batched_ref(raw, qtype, X, residual)
"""
from __future__ import annotations

import numpy as np

from stratad.model import quants

from .device import dense_qtype, module, need, on_stream
from .launch import launch
from .weights import DenseWeight, StackedWeight

SOURCE = "gemm.cu"
CUDA_R_16F, CUDA_R_32F = 2, 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0


def dense_batched(W: DenseWeight | StackedWeight, X, Y=None, residual=None, *, cache: bool = False, stream=None):
    """Y = X W^T (+ residual), X float32 (T, cols), Y float32 (T, rows) (Y may be residual). Returns Y.

    cache=True keeps the dequantised copy on W (2 bytes per weight, no dequantisation per call, no allocation:
    graph-capturable); cache=False dequantises into a pool allocation each call."""
    m = module(SOURCE)
    cp = m.cp
    if X.ndim != 2 or X.shape[1] != W.cols:
        raise ValueError(f"X must be (T, {W.cols})")
    Tn = int(X.shape[0])
    need(X, np.float32, None, "X", align=16)
    if Y is None:
        Y = cp.empty((Tn, W.rows), cp.float32)
    need(Y, np.float32, (Tn, W.rows), "Y")
    if residual is not None:
        need(residual, np.float32, (Tn, W.rows), "residual")
    if Tn == 0:
        return Y
    with on_stream(stream):
        from cupy_backends.cuda.libs import cublas

        Wd = W.dequantized(cache=cache, stream=stream)
        Xc = cp.empty((Tn, W.cols), cp.float16)
        n = Tn * W.cols
        launch(m.fn("convert_f32"), ((n // 2 + 255) // 256,), (256,), (X, np.int64(n), Xc, np.int32(1)))  # 1: F16
        beta = 0.0
        if residual is not None:
            if residual.data.ptr != Y.data.ptr:
                Y[...] = residual
            beta = 1.0
        alpha_h, beta_h = np.array([1.0], np.float32), np.array([beta], np.float32)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
        # column-major: Y^T (rows x T) = W (as (cols x rows))^T  X^T (cols x T)
        cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, W.rows, Tn, W.cols, alpha_h.ctypes.data, Wd.data.ptr,
                      CUDA_R_16F, W.cols, Xc.data.ptr, CUDA_R_16F, W.cols, beta_h.ctypes.data, Y.data.ptr,
                      CUDA_R_32F, W.rows, CUBLAS_COMPUTE_32F, -1)
    return Y


def dense_batched_ref(raw: np.ndarray, qtype, X: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    w = quants.dequantize(dense_qtype(qtype), np.asarray(raw))
    y = (np.asarray(X, np.float32) @ w.T).astype(np.float32)
    return y + residual if residual is not None else y
