"""stratad against llama.cpp's own quantiser (issue 27): files `llama-quantize` writes from a float qwen3moe load,
generate through the reference engine, decode as gguf-py decodes them, and hold the types stratad's `--mix` table
(stratad/model/mixes.py) gives each tensor. Needs a llama-quantize binary: LLAMA_QUANTIZE=/path/to/llama-quantize
(scripts/llama_quantize_check.py does the work and prints the table); skipped without it."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

import pytest

from stratad.model.config import PRESETS
from stratad.model.generator import make_model

BIN = os.environ.get("LLAMA_QUANTIZE")
needs_binary = pytest.mark.skipif(not (BIN and os.access(BIN, os.X_OK)),
                                  reason="set LLAMA_QUANTIZE to a llama.cpp llama-quantize binary to run this")

# file types llama.cpp refuses without an importance matrix (a tensor would get IQ3_XXS / IQ2_* / IQ1_* or, in
# Q2_K_S, Q2_K: tensor_requires_imatrix)
NEEDS_IMATRIX = {"IQ3_XS", "IQ3_XXS", "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"}


def _check_module():
    path = Path(__file__).resolve().parents[1] / "scripts" / "llama_quantize_check.py"
    spec = importlib.util.spec_from_file_location("llama_quantize_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path, config, types, modes):
    lq = _check_module()
    src = tmp_path / "f32.gguf"
    make_model(src, config, mix="f32", seed=3)
    return lq, lq.run_check(BIN, src, types, modes, work=tmp_path / "out", log=lambda s: None)


def _assert_served(rows):
    for r in rows:
        if r["rc"]:
            assert r["imatrix"] == "none" and r["file_type"] in NEEDS_IMATRIX, r
            assert "needs an importance matrix" in r["refused"], r
            continue
        assert r["loads"], r
        assert r["file_type_key_ok"], r
        assert r["greedy_ok"] and r["logits_finite"], r
        assert r["stratad_decode_exact"], r["stratad_decode_differs"]
        assert r["rel_rms"] < 0.6, r  # a sanity bound (IQ1_S is the worst); not a test of llama.cpp


def test_fallback_types_are_b11434s():
    """Rows that are not whole 256-value blocks: the types llama.cpp b11434's llama-quantize falls back to (seen
    with test_every_file_type's "odd" shape): Q2_K and Q3_K go to Q4_0 (older builds: IQ4_NL)."""
    from gguf import GGMLQuantizationType as T

    from stratad.model import mixes

    c = PRESETS["tiny"]
    for mix, want in (("q2_k", T.Q4_0), ("q3_k_s", T.Q4_0), ("q3_k_m", T.Q4_0), ("iq3_s", T.IQ4_NL),
                      ("iq4_xs", T.IQ4_NL), ("q4_k_s", T.Q5_0), ("q5_k_s", T.Q5_1), ("q6_k", T.Q8_0)):
        assert mixes.tensor_type(mixes.parse_mix(mix), "blk.1.ffn_up_exps.weight", 96, c) == want, mix
    assert mixes.tensor_type(mixes.parse_mix("q2_k"), "blk.1.ffn_up_exps.weight", 48, c) == T.F16


@needs_binary
def test_common_downloads_load_and_match_the_mix_table(tmp_path):
    """The seed's IQ3_S and the common Q4_K_M, from the tiny shape with an importance matrix (as published files
    are): each loads, generates, decodes as gguf-py does, and every tensor has the type mixes.py gives it (about
    10 s of CPU; every type: test_every_file_type)."""
    lq, res = _run(tmp_path, PRESETS["tiny"], ["Q4_K_M", "IQ3_S"], ["uniform"])
    _assert_served(res["rows"])
    for r in res["rows"]:
        assert r["types_match"], r["differences"]


@needs_binary
@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny", "gqa8", "odd"])
def test_every_file_type(tmp_path, shape):
    """Every file type llama-quantize offers that --mix knows, with and without an importance matrix, on three
    shapes: tiny (n_gqa 2, 4 layers), a3b's head grouping over 16 layers (n_gqa 8: the layer rules show), and rows
    that are not whole 256-value blocks (the fallbacks). Without an imatrix llama.cpp refuses the IQ1 / IQ2 /
    IQ3_XXS / IQ3_XS / Q2_K_S types (where the rows fall back to IQ4_NL / Q4_0 it needs none); the rest load and
    generate. With one, every tensor has mixes.py's type."""
    t = PRESETS["tiny"]
    config = {"tiny": t,
              "gqa8": replace(t, n_layer=16, n_head=8, n_head_kv=1, head_dim=32, n_expert=4, n_expert_used=2),
              "odd": replace(t, d_model=160, n_head=4, n_head_kv=2, head_dim=40, d_ff_expert=96)}[shape]
    lq = _check_module()
    lq, res = _run(tmp_path, config, lq.FILE_TYPES, ["none", "uniform"])
    rows = res["rows"]
    _assert_served(rows)
    refused = {r["file_type"] for r in rows if r["rc"]}
    assert refused == NEEDS_IMATRIX if shape != "odd" else refused <= NEEDS_IMATRIX
    for r in rows:
        if r["imatrix"] == "uniform":
            assert r["types_match"], (r["file_type"], r["differences"])
