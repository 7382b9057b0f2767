"""Kernel launches, with programmatic dependent launch (PDL) where asked for.

A decode step is ~14 small kernels a layer, each latency-bound: with PDL (sm_90+) a kernel's grid is launched and
its blocks made resident while its predecessor is still running; every kernel of lane/kernels begins with
PDL_ENTRY (griddepcontrol.wait: its predecessors have completed and their writes are visible; then
griddepcontrol.launch_dependents), so the overlap is safe and a normal launch is unchanged. CuPy's RawKernel cannot
set launch attributes, so PDL launches go through the driver's cuLaunchKernelEx (ctypes). Only launches being
captured into a CUDA graph use it (the graph keeps the programmatic edges; docs/perf-notes.md has the step's
times): an eager ctypes launch costs more host time than the overlap saves. The config's [gpu] pdl = false turns it
off (the card sets PDL).
"""
from __future__ import annotations

import ctypes

import numpy as np

PDL = True
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8, a 64-byte value union
    # the union as ints: a c_char array field reads back as a new bytes object, so writing through it (as an
    # earlier version did with memmove) wrote into a temporary (or the shared empty bytes object) and left the
    # attribute unset
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
           np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
           np.dtype(np.float32): ctypes.c_float}
_driver = None


def _cu():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _driver = lib
    return _driver


def _param(a):
    import cupy

    if isinstance(a, cupy.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.generic) and a.dtype in _CTYPES:
        return _CTYPES[a.dtype](a.item())
    raise TypeError(f"kernel argument of type {type(a).__name__} {getattr(a, 'dtype', '')}: pass a cupy array or "
                    f"a numpy int32 / uint32 / int64 / uint64 / float32 scalar")


def _dim3(d) -> list[int]:
    d = list(d)
    return d + [1] * (3 - len(d))


def pdl_config(grid, block, shared_mem: int, stream_ptr: int) -> tuple[_Config, _Attr]:
    """The CUlaunchConfig of a programmatic dependent launch (keep the attribute alive while it is used)."""
    attr = _Attr(id=ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    return _Config(*_dim3(grid), *_dim3(block), int(shared_mem), stream_ptr, ctypes.pointer(attr), 1), attr


def launch(fn, grid, block, args, shared_mem: int = 0, pdl: bool = True) -> None:
    """fn(grid, block, args, shared_mem) on the current stream; a programmatic dependent launch if PDL, pdl and the
    stream is being captured."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if not (PDL and pdl and stream.is_capturing()):
        fn(grid, block, args, shared_mem=shared_mem)
        return

    params = [_param(a) for a in args]
    ptrs = (ctypes.c_void_p * max(1, len(params)))(*[ctypes.cast(ctypes.pointer(p), ctypes.c_void_p)
                                                     for p in params])
    cfg, attr = pdl_config(grid, block, shared_mem, stream.ptr)
    handle = getattr(fn, "kernel", fn).ptr  # a RawKernel's CUfunction is its Function's; a Function's is its own
    rc = _cu().cuLaunchKernelEx(ctypes.byref(cfg), handle, ptrs, None)
    if rc:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {rc}")
