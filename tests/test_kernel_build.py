"""Every GPU kernel source builds with NVRTC as the lanes build it (same source expansion, same options), on a
machine without a GPU: NVRTC rejects code that nvcc accepts (a generic lambda in device code cost a device call),
and a decode kernel that spills would be slow without failing any test. NVRTC comes from the test extra's
nvidia-cuda-nvrtc wheel; without it the test is skipped."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "nvrtc_check.py"

# the decode step's kernels: no stack frame (a spill there costs every token); prefix match
DECODE_KERNELS = ("matvec_q8_0", "norm_matvec_", "attn_split_", "expert_gateup", "expert_down", "route_pairs",
                  "qk_norm_rope_kv")


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


@pytest.mark.parametrize("i", range(4), ids=["dense", "experts-IQ3_S", "experts-Q4_K", "experts-Q8_0"])
def test_kernels_build_without_decode_spills(nc, i):
    label, filename, defines = nc.BUILDS[i]
    cubin = nc.build(nc.lib, filename, defines)
    usage = nc.resource_usage(cubin)
    assert len(usage) > 10, f"{label}: only {sorted(usage)}"
    spills = {k: v for k, v in usage.items() if v[1] and k.startswith(DECODE_KERNELS)}
    assert not spills, f"{label}: decode kernels with a stack frame (registers, bytes): {spills}"


def test_build_error_names_the_line(nc):
    with pytest.raises(RuntimeError, match=r"bad\.cu\(2\)"):
        nc.nvrtc_cubin(nc.lib, '__global__ void k() {\n  undeclared = 1;\n}\n', "bad.cu", ["-std=c++17"])
