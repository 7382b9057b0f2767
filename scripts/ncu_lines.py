"""Where a kernel's instructions and stall samples go, by source line: Nsight Compute's SASS source page (the
`ncu-src` step's src-KERNEL-CTX.csv) matched, offset by offset, to a build of the same kernel with line numbers.

The lanes build without -lineinfo, so the device's report has SASS only. -lineinfo leaves the machine code as it
is, so the same source built here by NVRTC with it (NVRTC of the device's CUDA: its version decides the code; the
`nvidia-cuda-nvrtc==13.0.*` wheel for the device image's 13.0) gives every offset its line. The script checks that
each offset's opcode matches and says how many do not (any: another NVRTC or another tree; the lines are then not
to be trusted). The experts.cu build takes the defines nvrtc_check.py plans for TYPE (a3b shape); other sources
build without defines.

    NVRTC_LIB=.../libnvrtc.so.13 CUOBJDUMP=.../cuobjdump python scripts/ncu_lines.py src-expert_gateup-1024.csv \
        expert_gateup [--type IQ3_S] [--source experts.cu] [--top 30]

(nvdisasm beside cuobjdump: the `nvidia-cuda-nvdisasm` wheel puts both in one bin folder.)
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nvrtc_check  # noqa: E402
from ncu_hot import _num, source_rows  # noqa: E402
from lane.kernels import compile as kc  # noqa: E402

PRED = re.compile(r"^@!?U?P\w+\s+")


def opcode(text: str) -> str:
    text = PRED.sub("", text.strip())
    return text.split()[0] if text else ""


def lined_sass(source: str, kernel: str, defines) -> tuple[list[str], dict[int, tuple[int | None, str]]]:
    """The expanded source's lines, and the kernel's offset -> (source line, instruction) from a -lineinfo build."""
    src = kc._source(kc.HERE / source)
    options = list(kc.BASE_OPTIONS) + ["--gpu-architecture=sm_90", "-lineinfo"] + [kc._define(d) for d in defines]
    cubin = nvrtc_check.nvrtc_cubin(nvrtc_check.load_nvrtc(), src, source, options)
    nvdisasm = str(Path(nvrtc_check._cuobjdump()).parent / "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-g", "-c", f.name], capture_output=True, text=True, check=True).stdout
    out: dict[int, tuple[int | None, str]] = {}
    inside, line = False, None
    for ln in text.splitlines():
        if ln.startswith(".text."):
            inside = ln == f".text.{kernel}:"
            continue
        if not inside:
            continue
        m = re.search(r'//## File ".*", line (\d+)', ln)
        if m:
            line = int(m.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", ln)
        if m:
            out[int(m.group(1), 16)] = (line, m.group(2))
    if not out:
        raise SystemExit(f"no kernel {kernel} in the {source} build")
    return src.splitlines(), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("kernel")
    ap.add_argument("--source", default="experts.cu")
    ap.add_argument("--type", default="IQ3_S", help="experts.cu: the expert type whose plan gives the defines")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    defines = nvrtc_check.expert_defines(args.type) if args.source == "experts.cu" else []
    src, sass = lined_sass(args.source, args.kernel, defines)
    rows = source_rows(args.csv)
    if not rows or "Address" not in rows[0]:
        raise SystemExit(f"{args.csv}: no SASS source table")
    stall_col = next(c for c in rows[0] if "Stall Sampling (All" in c)
    base = int(rows[0]["Address"], 16)
    by = defaultdict(lambda: [0, 0])
    mismatched = 0
    for r in rows:
        line, text = sass.get(int(r["Address"], 16) - base, (None, ""))
        mismatched += opcode(text) != opcode(r["Source"])
        by[line][0] += int(_num(r[stall_col]))
        by[line][1] += int(_num(r["Instructions Executed"]))
    samples = sum(s for s, _ in by.values()) or 1
    executed = sum(e for _, e in by.values()) or 1
    print(f"{args.kernel}: {len(rows)} instructions in the report, {len(sass)} in the build, {mismatched} opcodes "
          f"differ; {samples} stall samples, {executed} warp instructions")

    def show(key, title):
        print(title)
        for line, (s, e) in sorted(by.items(), key=key)[:args.top]:
            text = src[line - 1].strip()[:100] if line else "?"
            print(f"  {e / executed * 100:5.1f} % executed  {s / samples * 100:5.1f} % samples  L{line}: {text}")

    show(lambda kv: -kv[1][1], "by instructions executed:")
    show(lambda kv: -kv[1][0], "by stall samples:")
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
