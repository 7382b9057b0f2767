"""Compile the GPU kernel sources with NVRTC on a machine without a GPU, as the lanes do (same source expansion,
same options), and print each kernel's registers and spills from the cubin.

nvcc accepts code that NVRTC rejects (a generic lambda in device code, for one), so a kernel change is checked here
before it costs device time. NVRTC comes from the `nvidia-cuda-nvrtc-cu12` wheel (no GPU or driver needed):

    python scripts/nvrtc_check.py [--arch 90] [--regs NAME]   (NVRTC from the test extra's nvidia-cuda-nvrtc wheel,
    or NVRTC_LIB=path/to/libnvrtc.so)

tests/test_kernel_build.py runs the same builds in CI.

Kernels with a stack frame (spills) are named; --regs prints registers too. --sass NAME prints that kernel's SASS
(cuobjdump from the `nvidia-cuda-cuobjdump` wheel, or CUOBJDUMP=path): where ptxas put the loads relative to the
PDL wait (ACQBULK) is read there, not in the PTX. --sass-dir DIR writes every build's SASS: a change meant to
leave the machine code alone (a helper in place of copies) is checked by `diff -r` of the folders before and after.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lane.kernels import compile as kc  # noqa: E402
from lane.kernels.experts import SOURCE as EXPERTS, ExpertKernels  # noqa: E402


def expert_defines(qtype: str, down: str | None = None, d_model: int = 2048, d_ff: int = 768) -> list[tuple[str, int]]:
    """experts.cu's defines as an H200 lane plans them (the default Tuning: 16 warps a block, up to 2 blocks an SM as
    shared memory allows) for gate/up weights of type qtype and down weights of type `down` (default: the same), at
    the a3b shape unless given."""
    return ExpertKernels.planned(d_model, d_ff, qtype, down or qtype).defines


def _wheel_lib() -> str:
    """libnvrtc from an installed NVRTC wheel (nvidia-cuda-nvrtc for CUDA 13, the project's test extra, or
    nvidia-cuda-nvrtc-cu12), else the loader's search path."""
    for module, lib in (("nvidia.cu13", "libnvrtc.so.13"), ("nvidia.cuda_nvrtc", "libnvrtc.so.12")):
        try:
            pkg = importlib.import_module(module)
        except ImportError:
            continue
        for base in pkg.__path__:
            if (Path(base) / "lib" / lib).exists():
                return str(Path(base) / "lib" / lib)
    return "libnvrtc.so.12"


def nvrtc_cubin(lib: ctypes.CDLL, source: str, name: str, options: list[str]) -> bytes:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        if rc:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed to compile {name}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def resource_usage(cubin: bytes) -> dict[str, tuple[int, int]]:
    """kernel -> (registers, stack frame bytes), read from the cubin's .nv.info attributes (EIATTR_REGCOUNT 0x2f,
    EIATTR_FRAME_SIZE 0x11; checked against ptxas --resource-usage on every dense kernel)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def cstr(sec, at: int) -> str:
        start = sec[4] + at
        return cubin[start:cubin.index(b"\0", start)].decode()

    names = [cstr(secs[shstrndx], s[0]) for s in secs]
    symtab = secs[names.index(".symtab")]
    syms = [cstr(secs[symtab[6]], struct.unpack_from("<I", cubin, symtab[4] + i * 24)[0])
            for i in range(symtab[5] // 24)]
    info = secs[names.index(".nv.info")]
    at, end, out = info[4], info[4] + info[5], {}
    while at < end:
        fmt, attr = cubin[at], cubin[at + 1]
        if fmt == 4:  # a sized value: u16 size, payload
            size = struct.unpack_from("<H", cubin, at + 2)[0]
            if attr in (0x2F, 0x11):
                sym, value = struct.unpack_from("<II", cubin, at + 4)
                regs, frame = out.get(syms[sym], (0, 0))
                out[syms[sym]] = (value, frame) if attr == 0x2F else (regs, value)
            at += 4 + size
        else:  # no value (1), a byte (2), a half word (3)
            at += {1: 2, 2: 3, 3: 4}[fmt]
    return out


def _cuobjdump() -> str:
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    try:  # the nvidia-cuda-cuobjdump wheel
        for base in importlib.import_module("nvidia.cu13").__path__:
            if (Path(base) / "bin" / "cuobjdump").exists():
                return str(Path(base) / "bin" / "cuobjdump")
    except ImportError:
        pass
    raise SystemExit("--sass needs cuobjdump and nvdisasm: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, or "
                     "set CUOBJDUMP")


def sass(cubin: bytes, kernel: str | None = None) -> str:
    """The SASS of one kernel of the cubin, or of all of them (without the temporary file's name, so that two
    builds' listings compare equal where their machine code is)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = _cuobjdump()
        # cuobjdump runs nvdisasm from PATH: the wheels put both in one bin folder
        env = dict(os.environ, PATH=str(Path(tool).parent) + os.pathsep + os.environ.get("PATH", ""))
        out = subprocess.run([tool, "-sass", *(["-fun", kernel] if kernel else []), f.name], capture_output=True,
                             text=True, check=True, env=env).stdout
        return out.replace(f.name, "")


# the sources as the lanes build them: each other op's, and experts.cu for each expert type at the a3b shape
DENSE_SOURCES = ("matvec.cu", "gemm.cu", "norm.cu", "rope_kv.cu", "attention_decode.cu", "attention_prefill.cu",
                 "router.cu", "sampling.cu", "embedding.cu", "fetch.cu")
BUILDS = [(name, name, []) for name in DENSE_SOURCES] + \
    [(f"experts.cu {q}", EXPERTS, expert_defines(q)) for q in ("IQ3_S", "Q4_K", "Q8_0")]


def llama_mixes() -> list[tuple[str, str]]:
    """(gate/up, down) expert types of differing kinds that llama.cpp's quantiser writes for the a3b shape in
    some file type (stratad/model/mixes.py), e.g. Q4_K_M's Q4_K + Q6_K."""
    from stratad.model import mixes
    from stratad.model.config import PRESETS

    c = PRESETS["a3b"]
    shapes = {f"blk.{i}.ffn_{k}_exps.weight": (c.n_expert, c.d_ff_expert, c.d_model) for i in range(c.n_layer)
              for k in ("gate", "down")}
    out = set()
    for ftype in mixes.MIXES.values():
        t = mixes.mix_types(ftype, shapes, c)
        for i in range(c.n_layer):
            gu, dn = t.get(f"blk.{i}.ffn_gate_exps.weight"), t.get(f"blk.{i}.ffn_down_exps.weight")
            if gu is not None and dn is not None and gu != dn:
                out.add((gu.name, dn.name))
    return sorted(out)


def expert_type_builds() -> list[tuple[str, str, list]]:
    """experts.cu for every other expert type (gate/up and down of that type) and for llama.cpp's mixes."""
    from stratad.model import quants

    pairs = [(t.name, t.name) for t in quants.EXPERT_TYPES if t.name not in ("IQ3_S", "Q4_K", "Q8_0")]
    return [(f"experts.cu {g}" + (f"+{d}" if d != g else ""), EXPERTS, expert_defines(g, d))
            for g, d in pairs + llama_mixes()]


def build(lib: ctypes.CDLL, filename: str, defines, arch: str = "90", extra: str = "") -> bytes:
    """The cubin NVRTC makes of `filename` (lane/kernels) with the lanes' options, `extra` appended to the source;
    RuntimeError with NVRTC's log."""
    options = list(kc.BASE_OPTIONS) + [f"--gpu-architecture=sm_{arch}"] + [kc._define(d) for d in defines]
    return nvrtc_cubin(lib, kc._source(kc.HERE / filename) + extra, filename, options)


def layout_asserts(k) -> str:
    """static_asserts that an ExpertKernels plan's shared-memory layout is the kernels' (what _check_layout compares
    on the device), for build(..., extra=): a plan the kernels disagree with fails to compile."""
    from lane.kernels.experts import TABLE_PARTS, table_part

    layout = {"GU_SMEM": k.gu_smem, "DN_SMEM": k.dn_smem, "GUT_SMEM": k.gut_smem, "TILE_P": k.simt_tile,
              "MMA_GU_SMEM": k.mma_gu_smem, "MMA_DN_SMEM": k.mma_dn_smem, "GRID_TABLE_BYTES": k.grid_bytes}
    for side, qt in (("GU_QT", k.qt_gu), ("DN_QT", k.qt_dn)):  # a generic IQ type's part of the table blob
        if qt in TABLE_PARTS:
            start, end = table_part(qt)
            layout |= {f"TabSmem<{side}>::OFF": start, f"TabSmem<{side}>::END": end}
    return "".join(f'\nstatic_assert({n} == {v}, "the plan\'s {n} is not the kernels\'");' for n, v in layout.items())


def load_nvrtc(path: str | None = None) -> ctypes.CDLL:
    return ctypes.CDLL(path or os.environ.get("NVRTC_LIB") or _wheel_lib())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90")
    ap.add_argument("--lib", default=None, help="libnvrtc path (default: NVRTC_LIB, else an installed wheel's)")
    ap.add_argument("--regs", nargs="?", const="_", default="",
                    help="print the registers of kernels whose name holds this (all without a value); a kernel with "
                         "a stack frame is printed always")
    ap.add_argument("--sass", default="", help="print this kernel's SASS (from the first source that has it)")
    ap.add_argument("--sass-dir", default="",
                    help="write each build's SASS to DIR/<build>.sass: a change meant to keep the machine code is "
                         "checked by `diff -r` of two such folders, before and after")
    ap.add_argument("--expert-types", action="store_true",
                    help="also build experts.cu for every other expert type and llama.cpp's gate/up + down mixes")
    args = ap.parse_args()
    lib = load_nvrtc(args.lib)
    failed = 0
    for label, filename, defines in BUILDS + (expert_type_builds() if args.expert_types else []):
        try:
            cubin = build(lib, filename, defines, args.arch)
        except RuntimeError as e:
            print(f"FAIL {label}\n{e}")
            failed += 1
            continue
        print(f"ok   {label}: {len(cubin)} bytes")
        usage = resource_usage(cubin)
        if args.sass_dir:
            Path(args.sass_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.sass_dir) / (label.replace(" ", "_").replace("+", "-") + ".sass")).write_text(sass(cubin))
        if args.sass in usage:
            print(sass(cubin, args.sass))
            args.sass = ""
        for fn, (regs, frame) in sorted(usage.items()):
            if frame or (args.regs and args.regs in fn):
                print(f"  {fn}: {regs} registers, {frame} bytes stack frame")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
