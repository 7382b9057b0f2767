"""The split of a GPU card's misses between the CPU pool and the card's bus reads (lane/host_split.py)."""
from __future__ import annotations

import numpy as np
import pytest

from lane.host_split import cpu_side


def _profile(seed: int, L: int = 6, E: int = 32):
    rng = np.random.default_rng(seed)
    off = rng.random((L, E)) < 0.5
    counts = rng.zipf(1.6, (L, E)).astype(np.float64) * (rng.random((L, E)) < 0.9)  # skewed, some never routed
    return off, counts


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_the_ends_are_all_bus_or_all_cpu(share):
    off, counts = _profile(1)
    got = cpu_side(off, counts, share)
    np.testing.assert_array_equal(got, off if share else np.zeros_like(off))


@pytest.mark.parametrize("share", [0.1, 0.25, 0.4, 0.5, 0.75, 0.9])
def test_each_layer_gets_its_share_of_the_expected_use(share):
    for seed in range(5):
        off, counts = _profile(seed)
        got = cpu_side(off, counts, share)
        assert not (got & ~off).any(), "only experts no card holds go to the CPU"
        w = counts + 1e-6 * (1 + counts.max())
        for layer in range(off.shape[0]):
            total = w[layer][off[layer]].sum()
            if not total:
                continue
            cpu = w[layer][got[layer]].sum()
            # greedy in order of weight: off by at most the largest weight on the layer's off-card experts
            assert abs(cpu - share * total) <= w[layer][off[layer]].max() + 1e-9, (seed, layer, cpu, total)


def test_without_a_profile_the_experts_alternate():
    off = np.zeros((2, 16), bool)
    off[0, ::2] = True  # 8 experts
    off[1, :5] = True
    got = cpu_side(off, np.zeros((2, 16)), 0.5)
    np.testing.assert_array_equal(np.flatnonzero(got[0]), [0, 4, 8, 12])  # by index: every other one
    np.testing.assert_array_equal(np.flatnonzero(got[1]), [0, 2, 4])
    assert cpu_side(off, np.zeros((2, 16)), 0.25)[0].sum() == 2


def test_a_share_outside_0_1_is_refused():
    off, counts = _profile(0)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="host_cpu_share"):
            cpu_side(off, counts, bad)
