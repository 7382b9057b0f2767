"""Every GPU kernel source builds with NVRTC as the lanes build it (same source expansion, same options), on a
machine without a GPU: NVRTC rejects code that nvcc accepts (a generic lambda in device code cost a device call),
and a decode kernel that spills would be slow without failing any test. NVRTC comes from the test extra's
nvidia-cuda-nvrtc wheel; without it the test is skipped."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "nvrtc_check.py"

# the decode step's kernels: no stack frame (a spill there costs every token); prefix match
DECODE_KERNELS = ("matvec_q8_0", "matvec_q4_k", "matvec_q6_k", "matvec_iq3_s", "matvec_rq", "matvec_dq_", "norm_matvec",
                  "attn_split_", "expert_gateup", "expert_down", "route_pairs", "qk_norm_rope_kv", "fetch_experts")


@pytest.fixture(scope="module")
def nc():
    spec = importlib.util.spec_from_file_location("nvrtc_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        mod.lib = mod.load_nvrtc()
    except OSError as e:
        pytest.skip(f"no NVRTC library ({e}); the test extra installs nvidia-cuda-nvrtc")
    return mod


BUILD_IDS = ["matvec", "gemm", "norm", "rope_kv", "attention_decode", "attention_prefill", "router", "sampling",
             "embedding", "fetch", "experts-IQ3_S", "experts-Q4_K", "experts-Q8_0"]


def test_every_build_has_its_id(nc):
    assert [b[0].replace(".cu", "").replace("experts ", "experts-") for b in nc.BUILDS] == BUILD_IDS


@pytest.fixture(scope="module")
def usages(nc):
    """label -> {kernel: (registers, stack frame)}, each source built once."""
    return {label: nc.resource_usage(nc.build(nc.lib, filename, defines)) for label, filename, defines in nc.BUILDS}


@pytest.mark.parametrize("i", range(len(BUILD_IDS)), ids=BUILD_IDS)
def test_kernels_build_without_decode_spills(nc, usages, i):
    label = nc.BUILDS[i][0]
    usage = usages[label]
    assert usage, f"{label}: no kernels"
    spills = {k: v for k, v in usage.items() if v[1] and k.startswith(DECODE_KERNELS)}
    assert not spills, f"{label}: decode kernels with a stack frame (registers, bytes): {spills}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["80", "86", "89"])
def test_kernels_build_for_ampere_and_ada(nc, arch):
    """Every source builds for the cards users run besides Hopper (A100, RTX 3090, RTX 4090): PDL and the other
    sm_90 instructions are behind __CUDA_ARCH__ guards. Built only; no test has run on those cards."""
    for label, filename, defines in nc.BUILDS:
        assert nc.resource_usage(nc.build(nc.lib, filename, defines, arch)), label


@pytest.mark.parametrize("qt", ["Q8_0", "Q5_1"])
def test_experts_build_as_a_99_kb_card_plans_them(nc, qt):
    """What an RTX 30xx / 40xx card's plan builds (tests/test_expert_plan.py): Q8_0's gate/up read in place by the
    generic decoder (UNTUNED), Q5_1's SIMT tiles of 4; for sm_86, with the plan's layout the kernels' (a Q8_0 plan
    without tensor-core tiles once disagreed with kernels that still sized them: the lane's layout check failed on
    the H100), the decode kernels without a stack frame."""
    from lane.kernels.experts import ExpertKernels

    k = ExpertKernels.planned(2048, 768, qt, qt, n_sm=82, smem=(101376, 102400))
    usage = nc.resource_usage(nc.build(nc.lib, "experts.cu", k.defines, "86", extra=nc.layout_asserts(k)))
    assert {"expert_gateup", "expert_down", "expert_gateup_tiled", "expert_down_tiled"} <= set(usage)
    spills = {n: v for n, v in usage.items() if v[1] and n.startswith(DECODE_KERNELS)}
    assert not spills, spills


@pytest.mark.slow
@pytest.mark.parametrize("qt", ["IQ3_S", "Q4_K"])
def test_every_bench_variant_builds_without_decode_spills(nc, qt):
    """The experts bench's launch shapes (stratad bench --scenario experts --variants) as the lanes would plan them:
    each builds with its plan's layout and no stack frame in its two decode kernels, so that a variant costs no
    device call to find it does not build or spills (dn8r, 8 down rows a warp, spilled 48 bytes for Q4_K: dropped,
    it had measured slower at 8 pairs)."""
    from lane.kernels.experts import ExpertKernels, Tuning
    from stratad.bench.experts import VARIANTS

    for name, over in VARIANTS.items():
        k = ExpertKernels.planned(2048, 768, qt, qt, tuning=Tuning(**over))
        usage = nc.resource_usage(nc.build(nc.lib, "experts.cu", k.defines, extra=nc.layout_asserts(k)))
        spills = {n: v for n, v in usage.items() if v[1] and n in ("expert_gateup", "expert_down")}
        assert not spills, f"{qt} {name}: {spills}"


def test_build_error_names_the_line(nc):
    with pytest.raises(RuntimeError, match=r"bad\.cu\(2\)"):
        nc.nvrtc_cubin(nc.lib, '__global__ void k() {\n  undeclared = 1;\n}\n', "bad.cu", ["-std=c++17"])


def test_every_kernel_a_wrapper_launches_is_in_its_source(usages):
    """The dense wrappers look kernels up by name in their own op's module (lane/kernels/<op>.py -> <op>.cu): every
    name they can ask for is built there, so a kernel moved or renamed without its wrapper fails here, not on a GPU."""
    from lane.kernels import device, weights

    def names(q, R, KS):
        return f"{q}_r{R}_k{KS}"

    from stratad.model.quants import FORMATS

    every_type = set(device.QNAME.values())  # decode.cuh's per-type kernels: one for each type of quants
    assert every_type == {t.name.lower() for t in FORMATS}
    quantised = every_type - {"f32", "f16", "bf16"}
    # the packed formats (weights.PackedRows): every type's own, and those a stack of types takes
    own = set(weights.RQ_FORMATS.values()) | {(1, 0)}
    packed = tuple(sorted({f"rq{ns}{nm}" for ns, nm in {weights.rq_widest([a, b]) for a in own for b in own}}))
    # the types read as the file holds them (Q8_0 and decode.cuh's RQ_PART_TYPES), on 8-bit x too (QX_TYPES)
    fast = tuple(device.QNAME[t] for t in device.FAST)
    qx = tuple(f"{device.QNAME[t]}x" for t in weights.QX_TYPES) + ("rq10x",)  # IQ3_S packed (to_packed)
    pairs = tuple(f"{device.QNAME[a]}_{device.QNAME[b]}" for a, b in weights.FILE_PAIRS)
    wanted = {
        "matvec.cu": {f"matvec_{names(q, R, KS)}" for q in fast + qx + packed for R, KS in weights.PLANS}
        | {f"norm_matvec_{names(q, min(R, 2), KS)}" for q in fast + packed for R, KS in weights.PLANS}
        | {f"norm_matvec2_{names(ab, R, KS)}" for ab in pairs for R, KS in weights.PAIR_PLANS}
        | {f"matvec_dq_{names(q, R, KS)}" for q in every_type for R, KS in weights.DQ_PLANS}
        | {f"pack_rows_{q}" for q in quantised},
        "gemm.cu": {f"dequant_rows_{q}" for q in every_type} | {"convert_f32"},
        "norm.cu": {"rms_norm_rows"},
        "rope_kv.cu": {"qk_norm_rope_kv", "advance_pos"},
        "attention_decode.cu": {f"attn_split_hd{hd}_g{g}{suf}" for hd in (64, 128) for g in (8, 16)
                                for suf in ("", "_pipe", "_qkv", "_qkv_plain")} | {"attn_combine"},
        "attention_prefill.cu": {f"attn_flash_prefill_{hd}{m}" for hd in (64, 128) for m in ("", "_m64")}
        | {"attn_q_pack", "attn_o_unpack"},
        "router.cu": {"route_topk"},
        "sampling.cu": {"argmax_k", "topk_stage1", "topk_sample", "cdf_max", "cdf_sample"},
        "embedding.cu": {f"embed_rows_{q}" for q in every_type},
    }
    for source, want in wanted.items():
        missing = want - set(usages[source])
        assert not missing, f"{source} lacks {sorted(missing)}"
    # and every literal name a wrapper asks its module for is among them
    here = Path(__file__).resolve().parent.parent / "lane" / "kernels"
    for py in ("matvec", "gemm", "norm", "rope_kv", "attention", "router", "sampling", "embedding", "weights"):
        text = (here / f"{py}.py").read_text()
        for name in re.findall(r'\.fn\("(\w+)"', text):
            assert any(name in built for built in wanted.values()), f"{py}.py asks for {name}, built nowhere"
        for prefix in re.findall(r'\.fn\(f"(\w+)_\{\w+\.name\}"', text):  # per type: <prefix>_<type>
            types = quantised if prefix == "pack_rows" else every_type  # packing: the quantised types
            assert any({f"{prefix}_{q}" for q in types} <= built for built in wanted.values()), \
                f"{py}.py asks for {prefix}_<type>, not built for every type"


def _expert_type_labels() -> list:
    """nvrtc_check's experts.cu builds for every other expert type and llama.cpp's mixes; a representative three run
    always (the float view; a tuned gate/up with a generic down, Q4_K_M's Q4_K + Q6_K; an IQ table type with the
    register-capped plan), the rest with the slow tests."""
    spec = importlib.util.spec_from_file_location("nvrtc_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    always = {"experts.cu F16", "experts.cu Q4_K+Q6_K", "experts.cu IQ2_S"}
    return [pytest.param(label, marks=() if label in always else pytest.mark.slow, id=label.split()[1])
            for label, _, _ in mod.expert_type_builds()]


# Decode kernels allowed a stack frame, with its size: the float types' gate/up reads its rows in place through the
# read-only path (asm loads kept in order); F32 at one block an SM (experts.py GU_REGS: 128 registers) keeps a
# 16-byte frame and runs faster than at two with 192 bytes spilled (docs/perf-notes.md, session 31); with the
# decode items a warp's rows (H_IN_DOWN) F16 / BF16 keep 8 bytes, measured faster than without them (session 35)
KNOWN_FRAMES = {("experts.cu F32", "expert_gateup"): 16, ("experts.cu F16", "expert_gateup"): 8,
                ("experts.cu BF16", "expert_gateup"): 8}


@pytest.mark.parametrize("label", _expert_type_labels())
def test_expert_kernels_build_for_every_type(nc, label):
    """The generic path (expert_term.cuh) builds for each type and mix as experts.py plans it, its decode kernels
    without a stack frame (KNOWN_FRAMES aside); the tensor-core prompt kernels, without one either, only where both
    types have int8 fragments (every quantised type)."""
    _, filename, defines = next(b for b in nc.expert_type_builds() if b[0] == label)
    usage = nc.resource_usage(nc.build(nc.lib, filename, defines))
    assert {"expert_gateup", "expert_down", "expert_gateup_tiled", "expert_down_tiled"} <= set(usage)
    spills = {k: v for k, v in usage.items()
              if v[1] > KNOWN_FRAMES.get((label, k), 0) and k.startswith(DECODE_KERNELS)}
    assert not spills, f"{label}: decode kernels with a stack frame (registers, bytes): {spills}"
    from lane.kernels.experts import MMA_TYPES

    mma = {int(t) for t in MMA_TYPES}
    d = dict(defines)
    assert ("expert_gateup_mma" in usage) == (d["GU_QT"] in mma and d["DN_QT"] in mma)
    frames = {k: v for k, v in usage.items() if k.endswith("_mma") and v[1]}  # 128 registers a thread at most
    assert not frames, f"{label}: tensor-core tile kernels with a stack frame: {frames}"
