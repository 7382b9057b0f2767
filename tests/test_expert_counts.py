"""A GPU card's per-step tally (lane/expert_counts.py) against counting entry by entry."""
from __future__ import annotations

import numpy as np
import pytest

from lane.expert_counts import entries_by_source, routed_counts


def test_counts_and_sources_equal_entry_by_entry():
    rng = np.random.default_rng(5)
    L, E, K = 6, 16, 4
    for T in (1, 2, 7, 300):  # fewer entries than experts (looked up one by one) and more (weighed counts)
        ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(L)])
        ids = ids.astype(np.int32)
        src = rng.integers(-1, 3, (L, E)).astype(np.int32)
        staged = {1: np.array([0, 5, 9]), 4: rng.choice(E, 6, replace=False)}
        want = np.zeros((L, E))
        layer = np.broadcast_to(np.arange(L)[:, None, None], ids.shape)
        np.add.at(want, (layer, ids), 1.0)
        c = routed_counts(ids, E)
        np.testing.assert_array_equal(c, want)
        where = src[layer, ids]
        for lyr, experts in staged.items():
            where[lyr][np.isin(ids[lyr], experts)] = 0
        got = entries_by_source(ids, c, src, staged)
        assert all(got.get(s, 0) == int((where == s).sum()) for s in range(-1, 3))
        assert sum(got.values()) == ids.size


def test_out_of_range_ids_are_an_error():
    with pytest.raises(ValueError, match="outside"):
        routed_counts(np.array([[[0, 16]]], np.int32), 16)
    with pytest.raises(ValueError, match="outside"):
        routed_counts(np.array([[[-1, 2]]], np.int32), 16)
