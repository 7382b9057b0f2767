"""Load a CUDA source file beside this module into a cupy.RawModule, compiled for the current device.

Options are always ('--fmad=false', '-std=c++17', '--gpu-architecture=sm_XY', '-ftz=false', '-prec-div=true',
'-prec-sqrt=true') plus the given defines. Modules are cached per (file, defines, device) for the process.

NVRTC is called here directly and the resulting cubin loaded through ``cupy.RawModule(path=...)``: CuPy's own
``RawModule(code=...)`` path appends '-ftz=true' after the caller's options (and NVRTC honours the last one), which
would silently flush subnormals in anything not written as explicit PTX. If the direct path is unavailable (a CuPy
without these NVRTC bindings) we fall back to ``RawModule(code=...)`` and record it in ``module_info``; the kernels
of this package do all result-bearing float arithmetic in inline PTX with explicit rounding and no .ftz, so their
bits do not depend on that flag either way.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE_OPTIONS = ("--fmad=false", "-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")

CACHE_DIR: str | None = None  # where compiled cubins are kept ([gpu] kernel_cache; set by the card), else below
_lock = threading.Lock()
_cache: dict[tuple, object] = {}
module_info: dict[tuple, dict] = {}  # cache key -> {"path": "nvrtc-direct" | "cupy-rawmodule", "options": [...]}


def _define(d) -> str:
    if isinstance(d, tuple):
        name, value = d
        return f"-D{name}={value}"
    return f"-D{d}"


def _cache_dir() -> Path:
    base = CACHE_DIR or os.path.join(tempfile.gettempdir(), f"stratad-kernels-{os.getuid()}")
    p = Path(base)
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    return p


def _nvrtc_cubin(source: str, name: str, options: tuple[str, ...]) -> bytes:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except Exception as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile {name}:\n{log}") from e
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _source(path: Path) -> str:
    """The kernel source with its `#include "x.cuh"` lines replaced by those files (beside it): NVRTC needs no
    include path, and the cache key (a hash of this text) covers the shared code too."""
    return re.sub(r'^#include "([\w.]+\.cuh)"$', lambda m: (path.parent / m.group(1)).read_text(), path.read_text(),
                  flags=re.M)


def load_module(filename: str, defines=(), *, device=None, return_info: bool = False):
    """cupy.RawModule of `filename` (a .cu beside this file) for `device` (default: the current one).

    With return_info: (module, info), info saying how it was built ({"path", "options", "cubin"}).
    """
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    cc = dev.compute_capability  # e.g. "90"
    path = HERE / filename
    defs = tuple(_define(d) for d in defines)
    key = (str(path), defs, dev.id)
    with _lock:
        mod = _cache.get(key)
        if mod is not None:
            return (mod, module_info[key]) if return_info else mod
        source = _source(path)
        options = BASE_OPTIONS + (f"--gpu-architecture=sm_{cc}",) + defs
        with dev:
            try:
                digest = hashlib.sha256((source + "\0" + "\0".join(options)).encode()).hexdigest()[:32]
                cubin_path = _cache_dir() / f"{path.stem}-{digest}.cubin"
                if not cubin_path.exists():
                    cubin = _nvrtc_cubin(source, path.name, options)
                    tmp = cubin_path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_bytes(cubin)
                    os.replace(tmp, cubin_path)
                mod = cupy.RawModule(path=str(cubin_path))
                info = {"path": "nvrtc-direct", "options": list(options), "cubin": str(cubin_path)}
            except (ImportError, AttributeError) as e:  # no usable NVRTC bindings: CuPy's path (adds -ftz=true)
                opts = tuple(o for o in options if not o.startswith("--gpu-architecture"))
                mod = cupy.RawModule(code=source, options=opts)
                info = {"path": "cupy-rawmodule", "options": list(opts), "why": repr(e)}
        _cache[key] = mod
        module_info[key] = info
        return (mod, info) if return_info else mod
