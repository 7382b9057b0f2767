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
        return out


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, np.float64)
        if self.p.temperature == 0:
            return int(np.argmax(logits))
        order = np.argsort(-logits, kind="stable")
        if self.p.top_k:
            order = order[: self.p.top_k]
        z = logits[order] / self.p.temperature
        prob = np.exp(z - z[0])
        prob /= prob.sum()
        if self.p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(prob), self.p.top_p)) + 1
            order, prob = order[:keep], prob[:keep] / prob[:keep].sum()
        i = int(np.searchsorted(np.cumsum(prob), self.rng.random(), side="right"))
        return int(order[min(i, len(order) - 1)])
