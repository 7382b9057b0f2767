"""The per-device cache of compiled kernel modules, and the argument checks every op wrapper shares.

`module("matvec.cu")` is that source compiled for the current device (compile.py caches the cubin on disk and the
RawModule per process); `Module.fn(name, smem)` looks a kernel up once and opts it into `smem` bytes of dynamic
shared memory where that is over the default 48 KB.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np
from gguf import GGMLQuantizationType as T

from stratad.model import quants

from .compile import load_module

# every type of stratad.model.quants and its kernels' suffix (decode.cuh's type lists); FAST: the types whose rows
# the mat-vec reads as the file holds them (matvec.cuh: the float types, Q8_0, and the types with a per-lane
# decoder, decode.cuh's RQ_PART_TYPES); the other quantised types are packed at upload (weights.PackedRows)
QNAME = {t: t.name.lower() for t in quants.DENSE_TYPES}
FILE_BLK = (T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ3_S)
FAST = (T.F32, T.F16, T.BF16) + FILE_BLK

_lock = threading.Lock()
_mods: dict[tuple[str, int], "Module"] = {}


class Module:
    def __init__(self, source: str, device_id: int):
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.module, self.build = load_module(source, (), device=device_id, return_info=True)
            attrs = self.device.attributes
            self.n_sm = int(attrs.get("MultiProcessorCount", 132))
            self.smem_optin = int(attrs.get("MaxSharedMemoryPerBlockOptin", 232448))
            self.smem_sm = int(attrs.get("MaxSharedMemoryPerMultiprocessor", 233472))
        self._fns: dict[str, object] = {}

    def fn(self, name: str, smem: int = 0):
        f = self._fns.get(name)
        if f is None:
            f = self.module.get_function(name)
            if smem:
                f.max_dynamic_shared_size_bytes = smem
            self._fns[name] = f
        return f

    def blocks_per_sm(self, name: str, threads: int, dyn_smem: int = 0) -> int:
        f = self.fn(name)
        try:
            regs = int(f.num_regs)
            smem = int(f.shared_size_bytes) + dyn_smem
        except Exception:  # noqa: BLE001
            return 2
        warps = (threads + 31) // 32
        per_warp = ((regs * 32 + 255) // 256) * 256
        by_regs = 65536 // max(1, per_warp * warps)
        by_smem = self.smem_sm // (smem + 1024) if smem else 32
        by_warps = 64 // warps
        return max(1, min(by_regs, by_smem, by_warps, 32))


def module(source: str, device=None) -> Module:
    """The compiled `source` (a .cu beside this file) for `device` (default: current), built once per process."""
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    with _lock:
        m = _mods.get((source, dev.id))
        if m is None:
            m = _mods[(source, dev.id)] = Module(source, dev.id)
        return m


def on_stream(stream):
    return stream if stream is not None else contextlib.nullcontext()


def ptr(a) -> np.uint64:
    """A kernel's optional pointer argument: 0 for None."""
    return np.uint64(0 if a is None else a.data.ptr)


def need(a, dtype, shape, name, align: int = 4):
    import cupy

    if not isinstance(a, cupy.ndarray) or a.dtype != np.dtype(dtype) or not a.flags.c_contiguous:
        raise TypeError(f"{name} must be a C-contiguous cupy {np.dtype(dtype).name} array")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if a.data.ptr % align:
        raise ValueError(f"{name} must be {align}-byte aligned")


def dense_qtype(q) -> T:
    if isinstance(q, str):
        return quants.parse_type(q)
    return quants.fmt(q).qtype  # ValueError naming the supported types for any other
