"""RMSNorm over the last axis with numpy's float32 summation tree (norm.cu): bit-identical to reference.rms_norm
where the row length has an exact pairwise plan; optionally writes the experts' quantised input in the same launch.

  rms_norm(x, w, eps, y, quant=)      rms_norm_ref = reference.rms_norm
"""
from __future__ import annotations

import numpy as np

from stratad.engine import reference

from .device import module, need, on_stream
from .launch import launch

SOURCE = "norm.cu"


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
    m = module(SOURCE)
    cp = m.cp
    n = int(x.shape[-1])
    rows = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    need(x, np.float32, None, "x")
    need(w, np.float32, (n,), "w")
    if y is None:
        y = cp.empty_like(x)
    need(y, np.float32, x.shape, "y")
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
        need(quant[0], np.int8, (rows, n), "q")
        need(quant[1], np.float32, (rows, n // 32), "d")
        qd = tuple(quant)
    with on_stream(stream):
        launch(m.fn("rms_norm_rows"), (rows,), (threads,), (x, np.int64(n), w, y, np.int64(n), np.int32(n), np.int32(L),
                                                    np.int32(NL), np.float32(eps), np.int32(staged)) + qd,
                              shared_mem=8 * n if staged else 0)
    return y


rms_norm_ref = reference.rms_norm
