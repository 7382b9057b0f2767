"""A GPU lane refuses, at card build and before allocating, a model with tensor types its kernels cannot read yet:
one error naming the tensors and their types (the CPU cards run every type)."""
from __future__ import annotations

from lane.gpu_types import check_gpu_types, unsupported_on_gpu
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile


def test_mixed_file_accepted(tmp_path):
    """llama.cpp's Q4_K_M mix (Q4_K gate/up with Q6_K down experts on some layers, Q4_K / Q6_K dense matrices):
    every tensor runs on the GPU (dense: lane/kernels/decode.cuh; experts: experts.cu's generic path)."""
    make_model(tmp_path / "m.gguf", "tiny", mix="q4_k_m")
    m = ModelFile(tmp_path / "m.gguf")
    assert "Q6_K" in {m.tensors[f"blk.{i}.ffn_down_exps.weight"].qtype.name for i in range(m.config.n_layer)}
    assert unsupported_on_gpu(m) == []
    check_gpu_types(m)


def test_gpu_types_accepted(tiny_model_path):
    m = ModelFile(tiny_model_path)
    assert unsupported_on_gpu(m) == []
    check_gpu_types(m)
