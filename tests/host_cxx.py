"""Kernel headers written as __host__ __device__ code, built for the host with a C++ compiler through a test's small
C shim and loaded with ctypes (cached by the sources' hash), so their arithmetic is compared with numpy on the CPU."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

FLAGS = ["-O2", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]


def build(name: str, shim: str, headers: list[Path]) -> ctypes.CDLL:
    """The shim (which includes headers, found beside the first) as a shared library; skips without a compiler."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip(f"no C++ compiler (g++ / c++ / clang++ or $CXX) to build {headers[0].name} for the host")
    text = "\0".join([h.read_text() for h in headers] + [shim, cxx] + FLAGS)
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    cache = Path(tempfile.gettempdir()) / f"stratad-decode-{os.getuid()}"
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    so = cache / f"{name}-{digest}.so"
    if not so.exists():
        src = cache / f"{name}-shim-{digest}.{os.getpid()}.cpp"
        src.write_text(shim)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run([cxx, *FLAGS, "-I", str(headers[0].parent), str(src), "-o", str(tmp)],
                           capture_output=True, text=True)
        src.unlink()
        assert r.returncode == 0, f"{headers[0].name} does not build for the host:\n{r.stderr}"
        os.replace(tmp, so)
    return ctypes.CDLL(str(so))
