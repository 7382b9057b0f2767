"""The V cache's blocked layout: the host helpers (v_blocked / v_unblocked, which the GPU tests and benches use to
fill and read caches) agree with the kernels' own index function, rope.cuh's v_at, read from the source."""
import re
from pathlib import Path

import numpy as np
import pytest

from lane.kernels import rope_kv


def v_at_from_source():
    """rope.cuh's v_at as a Python function of (kvh, hd, max_ctx, d, p): its return expression, casts removed."""
    src = (Path(rope_kv.__file__).parent / "rope.cuh").read_text()
    m = re.search(r"i64 v_at\(int kvh, int hd, int max_ctx, int d, int p\) \{\s*return (.*?);\s*\}", src, re.S)
    assert m, "v_at not found in rope.cuh"
    expr = m.group(1).replace("(i64)", "")
    return eval(f"lambda kvh, hd, max_ctx, d, p: {expr}")  # noqa: S307 (our own source, integer arithmetic)


@pytest.mark.parametrize("n_kv,hd,max_ctx", [(4, 128, 256), (2, 64, 64), (1, 8, 48)])
def test_v_cache_layout_is_the_kernels(n_kv, hd, max_ctx):
    v_at = v_at_from_source()
    rng = np.random.default_rng(hd + max_ctx)
    vt = rng.standard_normal((n_kv, hd, max_ctx)).astype(np.float16)  # V^T, as attention_ref's inputs transpose
    vc = rope_kv.v_blocked(vt)
    assert vc.shape == rope_kv.v_cache_shape(n_kv, hd, max_ctx) and vc.flags.c_contiguous
    flat = vc.reshape(-1)
    for k, d, p in zip(rng.integers(0, n_kv, 500), rng.integers(0, hd, 500), rng.integers(0, max_ctx, 500)):
        assert flat[v_at(int(k), hd, max_ctx, int(d), int(p))] == vt[k, d, p]
    assert np.array_equal(rope_kv.v_unblocked(vc).view(np.uint16), vt.view(np.uint16))
    # a 16-position tile's V^T is one contiguous hd x 16 piece: what the attention kernels copy whole
    p0 = 16 * int(rng.integers(0, max_ctx // 16))
    start = v_at(0, hd, max_ctx, 0, p0)
    assert np.array_equal(flat[start:start + hd * 16].reshape(hd, 16), vt[0, :, p0:p0 + 16])


def test_v_cache_needs_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 16"):
        rope_kv.v_cache_shape(4, 128, 40)
