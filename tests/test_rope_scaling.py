"""RoPE scaling: llama.cpp's YaRN / linear formulas in the one table function, the GPU card's table built by it
(unchanged bytes for unscaled models), the config's overrides, and the context-length check."""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from lane.kernels import rope_kv
from stratad import config as daemon_config
from stratad.engine.reference import ReferenceEngine, rope
from stratad.model import rope as R
from stratad.model.config import PRESETS, effective_context_length
from stratad.model.rope import RopeScaling

TINY = PRESETS["tiny"]
YARN = RopeScaling("yarn", 4.0, 32768)


def test_unscaled_table_bytes_unchanged():
    """The GPU card's table for an unscaled model: the very bytes of the formula it had before scaling existed."""
    for max_ctx, hd, base in ((4096, 64, 1e6), (1000, 128, 10000.0)):
        half = hd // 2
        inv = base ** (-np.arange(half, dtype=np.float64) * 2 / hd)
        ang = np.arange(max_ctx, dtype=np.int64)[:, None].astype(np.float64) * inv[None, :]
        c, s = rope_kv.rope_tables(max_ctx, hd, base)
        assert c.tobytes() == np.cos(ang).astype(np.float32).tobytes()
        assert s.tobytes() == np.sin(ang).astype(np.float32).tobytes()


@pytest.mark.parametrize("scaling", [R.NONE, YARN, RopeScaling("linear", 2.0)])
def test_gpu_table_is_the_reference_rotation(scaling):
    """rope_tables (uploaded by the GPU card) and reference.rope come from one function: rotating by the table's
    rows gives the reference's bits."""
    hd, base, pos = 128, 1e6, np.array([0, 1, 5000, 40000, 131071])
    c, s = rope_kv.rope_tables(131072, hd, base, scaling)
    x = np.random.default_rng(0).standard_normal((len(pos), 3, hd)).astype(np.float32)
    a, b = x[..., :hd // 2], x[..., hd // 2:]
    cc, ss = c[pos][:, None, :], s[pos][:, None, :]
    assert np.array_equal(np.concatenate([a * cc - b * ss, b * cc + a * ss], -1), rope(x, pos, base, scaling))


def test_yarn_as_llama_cpp_defines_it():
    """Qwen3's YaRN (factor 4 over 32768, head_dim 128, base 1e6): the ramp between the pairs that turn 32 and
    1 times over the original context, the short wavelengths kept, the long ones divided by 4, cos and sin times
    mscale = 1 + 0.1 ln 4."""
    hd, base = 128, 1e6
    low, high = R.yarn_corr_dims(hd, base, 32768, 32.0, 1.0)
    corr = lambda n: hd * math.log(32768 / (n * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    assert (low, high) == (math.floor(corr(32)), math.ceil(corr(1))) == (23, 40)
    plain, yarn = R.inv_freq(hd, base), R.inv_freq(hd, base, YARN)
    assert np.array_equal(yarn[:low + 1], plain[:low + 1])  # extrapolated: unchanged
    assert np.allclose(yarn[high:], plain[high:] / 4, rtol=1e-15, atol=0)  # interpolated
    mid = 31  # on the ramp: extrapolation weight 1 - (31 - 23) / 17
    w = 1 - (mid - low) / (high - low)
    assert yarn[mid] == pytest.approx(w * plain[mid] + (1 - w) * plain[mid] / 4, rel=1e-14)
    m = 1 + 0.1 * math.log(4)
    assert YARN.mscale() == pytest.approx(m) and RopeScaling("yarn", 4.0, 32768, attn_factor=0.5).mscale() == \
        pytest.approx(0.5 * m)
    assert RopeScaling("linear", 4.0).mscale() == 1.0
    c, s = R.tables(np.array([0, 100]), hd, base, YARN)
    assert c[0, 0] == np.float32(m) and np.allclose(c ** 2 + s ** 2, m * m, rtol=1e-6)


def test_overrides_as_llama_server_flags():
    y = TINY.with_rope_overrides("yarn", 4.0, None)
    assert y.rope_scaling == RopeScaling("yarn", 4.0, TINY.context_length) and y.max_context == 4 * 8192
    assert TINY.with_rope_overrides("yarn", 4.0, 4096).max_context == 16384 < 4 * 8192  # yarn_orig_ctx
    assert TINY.with_rope_overrides("linear", 2.0, None).max_context == 16384
    assert TINY.with_rope_overrides() == TINY  # nothing set: the file's
    scaled = dataclasses.replace(TINY, rope_scaling=YARN)
    assert scaled.with_rope_overrides("none").rope_scaling == R.NONE  # --rope-scaling none turns the file's off
    assert scaled.with_rope_overrides(scale=2.0).rope_scaling == dataclasses.replace(YARN, factor=2.0)
    for args, msg in ((("yarn",), "needs rope_scale > 1"), (("none", 2.0), "rope_scale need rope_scaling"),
                      ((None, 2.0), "rope_scale need rope_scaling linear or yarn (the model has none)"),
                      (("linear", 2.0, 4096), "yarn_orig_ctx applies to rope_scaling = 'yarn' only"),
                      (("ntk", 2.0), "rope_scaling must be none, linear or yarn")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            TINY.with_rope_overrides(*args)


def test_context_length_check():
    assert effective_context_length(4096, TINY) == 4096
    assert effective_context_length(8192, TINY) == 8192
    assert effective_context_length(16384, TINY, explicit=False) == 8192  # the default is capped, as before
    with pytest.raises(ValueError, match=r"context_length 16384 exceeds the model's 8192 tokens \(its trained "
                                         r"length\).*rope_scaling = 'yarn' and rope_scale"):
        effective_context_length(16384, TINY)
    y = TINY.with_rope_overrides("yarn", 4.0, None)
    assert effective_context_length(32768, y) == 32768
    with pytest.raises(ValueError, match=r"context_length 32769 exceeds the model's 32768 tokens \(yarn RoPE "
                                         r"scaling: original length 8192 x rope_scale 4\); lower context_length "
                                         r"or raise rope_scale"):
        effective_context_length(32769, y)


def test_daemon_config_keys():
    cfg = daemon_config.load(None, {"model": "m.gguf", "rope_scaling": "yarn", "rope_scale": 4, "yarn_orig_ctx": 32768})
    assert (cfg.rope_scaling, cfg.rope_scale, cfg.yarn_orig_ctx) == ("yarn", 4.0, 32768)
    assert TINY.with_rope_overrides(cfg.rope_scaling, cfg.rope_scale, cfg.yarn_orig_ctx).max_context == 131072
    for key, bad in (("rope_scaling", "ntk"), ("rope_scale", 1.0), ("yarn_orig_ctx", 0)):
        with pytest.raises(daemon_config.ConfigError, match=f"key '{key}'"):
            daemon_config.load(None, {"model": "m.gguf", key: bad})


def test_reference_generates_past_the_trained_length_when_scaled(tiny_model):
    """The reference engine's context is the scaled one, and YaRN changes its logits (mscale, frequencies)."""
    eng = ReferenceEngine(tiny_model, "float")
    base = eng.forward([1, 2, 3], eng.new_kv(), logits="last")
    tiny_model.config = tiny_model.config.with_rope_overrides("yarn", 4.0, None)
    try:
        assert eng.c is not tiny_model.config  # the engine took the config at construction
        eng = ReferenceEngine(tiny_model, "float")
        assert eng.c.max_context == 4 * TINY.context_length
        scaled = eng.forward([1, 2, 3], eng.new_kv(), logits="last")
        assert not np.allclose(scaled, base, atol=1e-3)
    finally:
        tiny_model.config = TINY
