"""GPU expert kernels on every expert type and on llama.cpp's gate/up + down mixes, against canonical.expert bit for
bit: experts.cu's generic path (expert_term.cuh, host-checked by test_expert_term_host.py) for every type but the
tuned IQ3_S / Q4_K / Q8_0 (tests/test_gpu_experts.py), in decode items and in prompt tiles (on int8 tensor
cores where both types have int8 fragments and the tiles fit, else SIMT tiles), pairs sharing experts, weights read
over the bus.

On the device machine: `python3 -m pytest -q -m gpu tests/test_gpu_expert_types.py`. Without CuPy or a CUDA device
the GPU tests skip; test_sources_build compiles each case's experts.cu here with NVRTC (slow: STRATAD_SLOW=1).
"""
from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from test_gpu_experts import run_case

from lane.kernels.experts import MMA_TYPES, TUNED, Tuning, card_smem, mma_smem, simt_tile
from stratad.model import quants

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "nvrtc_check.py"
GENERIC = [t.name for t in quants.EXPERT_TYPES if t not in TUNED]


def _nvrtc_check():
    spec = importlib.util.spec_from_file_location("nvrtc_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# llama.cpp's mixes of two types (Q4_K_M's Q4_K + Q6_K, IQ3_XS's IQ3_XXS + IQ3_S, ...), and floats beside quants
MIXES = _nvrtc_check().llama_mixes() + [("F16", "Q6_K"), ("Q8_0", "BF16")]

# (gate/up, down, d_model, d_ff, slots, tokens, pairs, max_pairs, tiled): the shapes each case runs
DECODE = (1280, 512, 6, 3, 17, 20)   # 40 sub-blocks a gate row: a lane's partial second round
TILED = (512, 256, 5, 16, 300, 320)  # pairs sharing 5 experts: long runs cut into full and short tiles
A3B_DECODE, A3B_TILED = (2048, 768, 6, 4, 24, 32), (2048, 768, 6, 40, 200, 256)
CASES = [(q, q, *DECODE, False) for q in GENERIC] + [(q, q, *TILED, True) for q in GENERIC] + \
    [(g, d, *A3B_DECODE, False) for g, d in MIXES] + [(g, d, *A3B_TILED, True) for g, d in MIXES]


def _id(c):
    return f"{c[0]}" + (f"+{c[1]}" if c[1] != c[0] else "") + f"-{c[2]}x{c[3]}" + ("-tiled" if c[8] else "")


def _run(cp, gu, dn, d_model, d_ff, n_slots, n_tok, n_pairs, max_pairs, tiled, **kw):
    rng = np.random.default_rng(zlib.crc32(f"{gu}{dn}{d_model}{tiled}{kw}".encode()))
    k = run_case(cp, rng, getattr(T, gu), getattr(T, dn), d_model, d_ff, n_slots, n_tok, n_pairs, max_pairs,
                 tiled=tiled, **kw)
    # tensor-core tiles where both types have int8 fragments, the rows are whole 128s, the tuning asks for them and
    # a tile fits the block (the plan's or this card's): as many m-tiles of 16 as fit
    block = kw["smem"][0] if "smem" in kw else card_smem(cp.cuda.Device())[0]
    fits = [mt for mt in (4, 2, 1) if mt <= k.tuning.mma_mt and
            max(mma_smem(k.qt_gu, d_model, True, mt), mma_smem(k.qt_dn, d_ff, False, mt)) <= block]
    mma = k.qt_gu in MMA_TYPES and k.qt_dn in MMA_TYPES and d_model % 128 == 0 and d_ff % 128 == 0 and fits
    assert k.mma == bool(mma and k.tuning.prompt == "mma")
    assert k.tile_p == (16 * fits[0] if k.mma else k.simt_tile)
    assert k.simt_tile == simt_tile(k.qt_gu, k.tuning) or "smem" in kw
    return k


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_expert_bits(cp, case):
    """h, qh, dh and the expert's output: canonical's bits, per pair (decode) and tiled (prompt chunks)."""
    _run(cp, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("tiled", [False, True], ids=["decode", "tiled"])
@pytest.mark.parametrize("gu,dn", [("Q6_K", "Q6_K"), ("IQ2_XS", "Q2_K"), ("F16", "F16"), ("Q4_K", "Q6_K")],
                         ids=lambda v: v)
def test_experts_read_from_host_memory(cp, gu, dn, tiled):
    """Generic types read from page-locked host memory in the arena's layout (gate, up and down tensors apart)."""
    _run(cp, gu, dn, *(A3B_TILED if tiled else A3B_DECODE), tiled, host=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tiled", [False, True], ids=["decode", "tiled"])
@pytest.mark.parametrize("gu,dn", [("IQ3_S", "IQ3_S"), ("Q4_K", "Q6_K"), ("Q5_1", "Q5_1"), ("F16", "F16"),
                                   ("Q8_0", "Q8_0")], ids=lambda v: v)
def test_the_plan_of_a_card_with_99_kb_a_block(cp, gu, dn, tiled):
    """The staging an RTX 30xx / 40xx card plans (99 KB of shared memory a block: one stage, tensor-core prompt tiles
    of 16 pairs where they fit, else SIMT ones (Q5_1's of 4), Q8_0's gate/up read in place by the generic decoder),
    run on this card (tests/test_expert_plan.py plans it on the host)."""
    k = _run(cp, gu, dn, *(A3B_TILED if tiled else A3B_DECODE), tiled, smem=(101376, 102400))
    assert max(k.gu_smem, k.dn_smem, k.gut_smem, *((k.mma_gu_smem, k.mma_dn_smem) if k.mma else ())) <= 101376


@pytest.mark.gpu
@pytest.mark.parametrize("qt", ["Q6_K", "IQ4_XS", "BF16"])
def test_tunings(cp, qt):
    """The launch shapes the benchmark varies, on generic types: warps, stages, rows a warp, SIMT tile lengths (a
    float type's tile stays at most 4)."""
    for t in ({"gu_warps": 8, "gu_min_blocks": 3}, {"gu_stages": 2, "dn_stages": 4, "dn_rows": 8},
              {"prompt": "simt", "tile_p": 16}, {"tile_p": 4, "dn_rows": 2, "dn_min_blocks": 1}):
        _run(cp, qt, qt, *DECODE, False, tuning=Tuning(**t))
        _run(cp, qt, qt, *TILED, True, tuning=Tuning(**t))


@pytest.mark.slow
def test_sources_build():
    """Every case's experts.cu builds for sm_90 with NVRTC, without a GPU, with the defines an H200 lane plans for it
    (ExpertKernels.planned), and the plan's shared-memory layout is the kernels' (what ExpertKernels._check_layout
    compares on the device, asserted here at compile time)."""
    from lane.kernels.experts import ExpertKernels

    nc = _nvrtc_check()
    try:
        lib = nc.load_nvrtc()
    except OSError as e:
        pytest.skip(f"no NVRTC library ({e}); the test extra installs nvidia-cuda-nvrtc")
    for gu, dn, d_model, d_ff in sorted({c[:4] for c in CASES}):
        k = ExpertKernels.planned(d_model, d_ff, gu, dn)
        usage = nc.resource_usage(nc.build(lib, "experts.cu", k.defines, extra=nc.layout_asserts(k)))
        assert {"expert_gateup", "expert_down", "expert_gateup_tiled", "expert_down_tiled"} <= set(usage), (gu, dn)
