"""The router: softmax over the expert logits, top-k, renormalised (router.cu, route.cuh).

  route(logits, k, ids, weights)      route_ref = reference.route
"""
from __future__ import annotations

import numpy as np

from stratad.engine import reference

from .device import module, need, on_stream
from .launch import launch

SOURCE = "router.cu"


def route(logits, k: int, ids=None, weights=None, *, stream=None):
    """logits float32 (T, n) -> ids int32 (T, k), weights float32 (T, k): softmax, top-k descending (ties to the
    lower index), renormalised. Ranked by the float32 probabilities as numpy ranks them (underflowed zeros tie and
    go by index, as in numpy); ids equal reference.route's unless CUDA's expf and numpy's exp round two nearly
    equal logits into a different order or tie (<= 2 ulp apart). n <= 1024, k <= 32; the softmax sums use numpy's
    pairwise order (exact for n <= 512). Returns (ids, weights)."""
    m = module(SOURCE)
    cp = m.cp
    if logits.ndim == 1:
        logits = logits.reshape(1, -1)
    Tn, n = logits.shape
    if n > 1024 or k > 32 or k > n:
        raise ValueError("route supports n <= 1024 and k <= min(32, n)")
    need(logits, np.float32, None, "logits")
    if ids is None:
        ids = cp.empty((Tn, k), cp.int32)
    if weights is None:
        weights = cp.empty((Tn, k), cp.float32)
    need(ids, np.int32, (Tn, k), "ids")
    need(weights, np.float32, (Tn, k), "weights")
    with on_stream(stream):
        launch(m.fn("route_topk"), (Tn,), (32,), (logits, np.int64(n), np.int32(n), np.int32(k), ids, weights))
    return ids, weights


route_ref = reference.route
