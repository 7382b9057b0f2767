"""The GPU card samples on its device where that gives the host Sampler's token: greedy, top-k of at most SAMPLE_KMAX
candidates, and top-p without a top-k while its nucleus fits the candidates (else the card hands the logits to
Sampler.pick). The device kernels match lane.kernels.sampling.sample_ref (tests/test_gpu_dense.py); this checks
sample_ref against Sampler.pick on the CPU, ties at the top and at the top-k cut included."""
from __future__ import annotations

import numpy as np
import pytest

from lane.kernels.sampling import SAMPLE_KMAX, sample_ref
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


@pytest.mark.parametrize("temp,top_p", [(0.7, 0.9), (1.0, 0.5), (1.5, 0.95)])
def test_top_p_alone_is_the_host_samplers_or_left_to_it(temp, top_p):
    """No top-k: the whole vocabulary's top-p. sample_ref gives Sampler.pick's token where the nucleus fits the
    SAMPLE_KMAX candidates and -1 (the host samples) exactly where it does not."""
    params = SamplingParams(temperature=temp, top_p=top_p)
    rng = np.random.default_rng(int(temp * 10 + top_p * 100))
    seen = set()
    for trial in range(60):
        n = int(rng.choice([300, 5000, 40000]))
        x = (rng.standard_normal(n) * rng.uniform(0.3, 12)).astype(np.float32)
        u = float(rng.random())
        got = sample_ref(x, temp, 0, top_p, u)
        z = np.sort(x.astype(np.float64))[::-1] / temp
        nucleus = int(np.argmax(np.cumsum(np.exp(z - z[0])) >= top_p * np.exp(x.astype(np.float64) / temp - z[0]).sum())) + 1
        assert (got == -1) == (nucleus > min(SAMPLE_KMAX, n)), (n, nucleus, got)
        if got != -1:
            assert got == Sampler(params).pick(x, u)
        seen.add(got == -1)
    assert seen == {True, False}  # both cases were met
