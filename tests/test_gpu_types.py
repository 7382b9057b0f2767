"""A GPU lane checks, at card build and before allocating, that its expert kernels take every layer of the model
(lane/kernels/experts.py check_model, planned on the host): any type with any down type; gate and up of one type."""
from __future__ import annotations

import dataclasses

import pytest
from gguf import GGMLQuantizationType as T

from lane.kernels.experts import check_model
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile


@pytest.mark.parametrize("mix", ["q4_k_m", "iq3_s", "q2_k", "iq1_m", "mxfp4_moe", "f16"])
def test_mixes_accepted(tmp_path, mix):
    """llama.cpp's mixes (e.g. Q4_K gate / up with Q6_K down on some layers) and the converter's F16 output."""
    make_model(tmp_path / "m.gguf", "tiny", mix=mix)
    check_model(ModelFile(tmp_path / "m.gguf"))


def test_gate_and_up_of_two_types_refused(tmp_path):
    make_model(tmp_path / "m.gguf", "tiny", mix="q4_k_m")
    m = ModelFile(tmp_path / "m.gguf")
    name = "blk.1.ffn_up_exps.weight"
    m.tensors[name] = dataclasses.replace(m.tensors[name], qtype=T.Q8_0)
    with pytest.raises(ValueError, match="layer 1: gate experts are Q4_K and up experts Q8_0"):
        check_model(m)


def test_a_shape_the_kernels_cannot_take_is_refused_naming_the_layers(tmp_path):
    """F32 experts of the 235B shape: a down row of 1536 float32 does not fit the kernels' shared memory."""
    make_model(tmp_path / "m.gguf", "tiny", mix="f32")
    m = ModelFile(tmp_path / "m.gguf")
    m.config = dataclasses.replace(m.config, d_model=4096, d_ff_expert=1536)  # the planner reads only the shape
    with pytest.raises(ValueError, match=r"cannot take layers 0\.\.3 \(4 layers: F32 gate / up, F32 down, d_model "
                                         r"4096, expert width 1536\)"):
        check_model(m)


def test_the_check_plans_for_the_cards_shared_memory(tmp_path):
    """F32 down experts at the 30B shape fit an H200's shared memory, not a 99 KB card's (RTX 3090 / 4090): the
    check, given the card's shared memory (as a GPU card passes its own), refuses them there before anything is
    allocated, naming the layers (before, it planned for an H200 whatever the card, and the card failed later, its
    slot pool allocated)."""
    make_model(tmp_path / "m.gguf", "tiny", mix="f32")
    m = ModelFile(tmp_path / "m.gguf")
    m.config = dataclasses.replace(m.config, d_model=2048, d_ff_expert=768)  # the planner reads only the shape
    check_model(m)  # an H200
    with pytest.raises(ValueError, match=r"cannot take layers 0\.\.3 .* F32 expert rows need 198864 bytes of shared "
                                         r"memory a block staged; this GPU allows 101376"):
        check_model(m, smem=(101376, 102400))
