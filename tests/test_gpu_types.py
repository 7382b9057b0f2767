"""A GPU lane refuses, at card build and before allocating, a model with tensor types its kernels cannot read yet:
one error naming the tensors and their types (the CPU cards run every type)."""
from __future__ import annotations

import pytest

from lane.gpu_types import check_gpu_types, unsupported_on_gpu
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile


def test_mixed_file_refused_naming_its_tensors(tmp_path):
    make_model(tmp_path / "m.gguf", "tiny", mix="q4_k_m")
    m = ModelFile(tmp_path / "m.gguf")
    bad = unsupported_on_gpu(m)
    # Q4_K experts and every dense matrix run (lane/kernels/decode.cuh); Q6_K down experts do not (yet)
    assert "blk.2.ffn_down_exps.weight (Q6_K)" in bad and "blk.0.ffn_gate_exps.weight (Q4_K)" not in bad
    assert all("_exps." in b for b in bad)
    with pytest.raises(ValueError, match=r"the GPU card cannot run \d+ tensors of this model yet: .*; "
                                         r"GPU expert types: IQ3_S, Q4_K, Q8_0; GPU dense types: F32, F16, BF16, "
                                         r"Q4_0, .*, IQ1_M \(the CPU cards"):
        check_gpu_types(m)


def test_gpu_types_accepted(tiny_model_path):
    m = ModelFile(tiny_model_path)
    assert unsupported_on_gpu(m) == []
    check_gpu_types(m)
