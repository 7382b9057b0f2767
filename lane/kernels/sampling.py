"""Sampling on the card (sampling.cu): argmax, top-k / top-p with a given uniform, and whole-vocabulary temperature
sampling; params float64 (4,) = [temperature, top_k, top_p, u]; the token is int32 (1,) on the device.

  Argmax(n)(x, out)                       argmax_ref = np.argmax
  DeviceSampler(n)(logits, params, out)   sample_ref(logits, temperature, top_k, top_p, u)
  CdfSampler(n)(logits, params, out)      the host Sampler's inverse CDF
"""
from __future__ import annotations

import numpy as np

from .device import module, need, on_stream
from .launch import launch

SOURCE = "sampling.cu"
F32 = np.float32
SAMPLE_KMAX = 256       # candidates kept by the sampler (sampling.cu SAMPLE_KMAX)
SAMPLE_CHUNK = 4096     # logits per stage-1 block (sampling.cu SAMPLE_CHUNK)
CDF_CHUNK = 4096        # logits per block of the whole-vocabulary sampler (sampling.cu CDF_CHUNK)


class Argmax:
    """np.argmax on the device (first index of the maximum; NaN counts as the maximum; -0 == +0), one launch."""

    def __init__(self, n: int, *, blocks: int | None = None, device=None):
        m = self.m = module(SOURCE, device)
        cp = m.cp
        self.n = int(n)
        self.blocks = int(blocks or max(1, min(2 * m.n_sm, -(-self.n // 1024))))
        with m.device:
            self.part = cp.empty(self.blocks, cp.uint64)
            self.counter = cp.zeros(1, cp.uint32)

    def __call__(self, x, out, *, stream=None) -> None:
        need(x, np.float32, (self.n,), "x")
        need(out, np.int32, (1,), "out")
        with on_stream(stream):
            launch(self.m.fn("argmax_k"), (self.blocks,), (256,), (x, np.int32(self.n), self.part, self.counter, out))


def argmax_ref(x: np.ndarray) -> int:
    return int(np.argmax(x))


def sampling_params(temperature: float, top_k: int, top_p: float, u: float) -> np.ndarray:
    """The device sampler's params array (float64 [temperature, top_k, top_p, u]); upload with cupy.asarray or
    copy into a resident (4,) float64 buffer before each graph replay."""
    return np.array([temperature, top_k, top_p, u], np.float64)


def _need_sample(n: int, logits, params, out) -> None:
    """A sampler's arguments: logits float32 (n,), params float64 (4,) (sampling_params), out int32 (1,)."""
    need(logits, np.float32, (n,), "logits")
    need(params, np.float64, (4,), "params")
    need(out, np.int32, (1,), "out")


class DeviceSampler:
    """Temperature / top-k / top-p sampling with a given uniform u, two launches; the algorithm is exactly
    sample_ref's (see there). Greedy (temperature <= 0) gives np.argmax's token."""

    def __init__(self, n: int, *, device=None):
        m = self.m = module(SOURCE, device)
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
        with on_stream(stream):
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
        m = self.m = module(SOURCE, device)
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
        with on_stream(stream):
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
