"""The GPU card samples on its device where that gives the host Sampler's token: greedy, and top-k of at most
SAMPLE_KMAX candidates. The device kernels match lane.kernels.dense.sample_ref (tests/test_gpu_dense.py); this checks
sample_ref against Sampler.pick on the CPU, ties at the top and at the top-k cut included."""
from __future__ import annotations

import numpy as np
import pytest

from lane.kernels.dense import SAMPLE_KMAX, sample_ref
from stratad.engine.sampling import Sampler, SamplingParams

DEVICE_PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=40),
                 SamplingParams(temperature=1.3, top_k=SAMPLE_KMAX, top_p=0.9), SamplingParams(temperature=0.5, top_k=1),
                 SamplingParams(temperature=2.0, top_k=100, top_p=0.5)]


@pytest.mark.parametrize("params", DEVICE_PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_device_algorithm_is_the_host_samplers(params):
    rng = np.random.default_rng(int(params.top_k * 10 + params.temperature * 100))
    for trial in range(200):
        x = (rng.standard_normal(5000) * rng.uniform(0.5, 5)).astype(np.float32)
        if trial % 5 == 0:  # ties at the top
            x[rng.integers(5000, size=20)] = x.max()
        if trial % 5 == 1:  # ties across the top-k cut
            x[rng.integers(5000, size=50)] = np.sort(x)[-max(1, params.top_k - 3)]
        u = float(rng.random())
        assert sample_ref(x, params.temperature, params.top_k, params.top_p, u) == Sampler(params).pick(x, u)
