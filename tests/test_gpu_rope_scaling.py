"""The GPU card with RoPE scaling (device only): qk_norm_rope_kv on a YaRN / linear RopeTable gives the reference's
bits (reference.rope with the same scaling: one table function), past the original context length."""
from __future__ import annotations

import numpy as np
import pytest

from lane.kernels import rope_kv
from stratad.engine import reference
from stratad.model.rope import RopeScaling

pytestmark = pytest.mark.gpu
F32 = np.float32


@pytest.mark.parametrize("scaling", [RopeScaling("yarn", 4.0, 512), RopeScaling("linear", 2.0)],
                         ids=["yarn", "linear"])
@pytest.mark.parametrize("pos0", [0, 511, 1500])
def test_qk_norm_rope_kv_scaled(cp, scaling, pos0):
    n_head, n_kv, hd, Tn, max_ctx, eps = 32, 4, 128, 5, 2048, 1e-6
    rng = np.random.default_rng(pos0)
    rope = rope_kv.RopeTable(max_ctx, hd, 1e6, scaling)
    qkv = rng.standard_normal((Tn, (n_head + 2 * n_kv) * hd), dtype=F32) * F32(3)
    qnw, knw = rng.uniform(0.5, 1.5, hd).astype(F32), rng.uniform(0.5, 1.5, hd).astype(F32)
    Kc = cp.zeros((n_kv, max_ctx, hd), cp.float16)
    Vc = cp.zeros(rope_kv.v_cache_shape(n_kv, hd, max_ctx), cp.float16)
    q_out = cp.full((Tn, n_head, hd), np.nan, cp.float32)
    rope_kv.qk_norm_rope_kv(cp.asarray(qkv), cp.asarray(qnw), cp.asarray(knw), eps, rope,
                            cp.asarray(np.array([pos0], np.int32)), q_out, Kc, Vc, n_head=n_head, n_kv=n_kv)
    cp.cuda.Device().synchronize()
    pos = np.arange(pos0, pos0 + Tn)
    q = reference.rms_norm(qkv[:, :n_head * hd].reshape(Tn, n_head, hd), qnw, eps)
    k = reference.rms_norm(qkv[:, n_head * hd:(n_head + n_kv) * hd].reshape(Tn, n_kv, hd), knw, eps)
    q, k = reference.rope(q, pos, 1e6, scaling), reference.rope(k, pos, 1e6, scaling)
    assert np.array_equal(q_out.get().view(np.uint32), q.view(np.uint32))
    K = Kc.get()
    for t in range(Tn):
        assert np.array_equal(K[:, pos0 + t].view(np.uint16), k[t].astype(np.float16).view(np.uint16))
