"""Token sampling: greedy, or temperature / top-k / top-p from a seeded generator (reproducible per request)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings, in addition to the model's stop tokens
    ignore_eos: bool = False  # the model's stop tokens do not end the generation (fixed-length runs, benchmarks)

    def problems(self) -> list[str]:
        out = []
        if self.max_tokens < 1:
            out.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            out.append(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            out.append(f"top_k must be >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not -2**63 <= self.seed < 2**63:
            out.append(f"seed must be a 64-bit signed integer, got {self.seed}")
        return out


NUCLEUS_PROBE = 1024  # top-p: the nucleus is looked for among this many top tokens first, then 8x as many, ...


def probes(n: int) -> list[int]:
    """How many top tokens top-p looks among, widening until the nucleus fits (the order's prefix, and so the
    token, does not depend on where it stopped): a wide nucleus costs a few partitions, not a sort of all n."""
    out, m = [], NUCLEUS_PROBE
    while m < n:
        out.append(m)
        m *= 8
    return out + [n]


def top_order(x: np.ndarray, m: int) -> np.ndarray:
    """Indices of the m largest values of x, by value descending, ties to the lower index (O(n) + O(m log m)):
    every value tied with the m-th largest is a candidate first (a partition alone would cut such ties anywhere)."""
    n = x.shape[0]
    idx = np.arange(n) if m >= n else np.flatnonzero(x >= np.partition(x, n - m)[n - m])
    return idx[np.lexsort((idx, -x[idx]))][:m]


class Sampler:
    """Without a top-k or top-p limit the token comes from the inverse CDF over the vocabulary in index order (no
    sort: a sort of 152K logits costs more than a GPU decode step); with one, only the candidates are sorted."""

    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed % 2**64)  # any int64 (-1 too): its two's-complement bits

    def __call__(self, logits: np.ndarray) -> int:
        return self.pick(logits, self.draw())

    def draw(self) -> float:
        """This step's uniform number (none is drawn for greedy decoding: 0.0)."""
        return 0.0 if self.p.temperature == 0 else float(self.rng.random())

    def pick(self, logits: np.ndarray, u: float) -> int:
        """The token for logits (n,) and the step's draw u."""
        temp = self.p.temperature
        if temp == 0:  # on the logits as they are: float64 holds every float32 exactly, so the index is the same
            return int(np.argmax(logits))
        x = np.asarray(logits, np.float64).reshape(-1)
        n = x.shape[0]
        k = self.p.top_k if 0 < self.p.top_k < n else n
        if k == n and self.p.top_p >= 1:
            c = np.cumsum(np.exp((x - x.max()) / temp))
            return int(min(np.searchsorted(c, u * c[-1], side="right"), n - 1))
        for m in ((k,) if k < n else probes(n)):
            order = top_order(x, m)
            z = x[order] / temp
            prob = np.exp(z - z[0])
            if self.p.top_p >= 1:
                break
            total = prob.sum() if k < n else np.exp(x / temp - z[0]).sum()  # top-p is of the whole distribution
            reach = np.flatnonzero(np.cumsum(prob) >= self.p.top_p * total)
            if reach.size:
                order, prob = order[: reach[0] + 1], prob[: reach[0] + 1]
                break
        c = np.cumsum(prob)
        return int(order[min(np.searchsorted(c, u * c[-1], side="right"), len(order) - 1)])
