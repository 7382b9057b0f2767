"""What a benchmark ran on, and the memory bandwidth its floors are held against (measured, not datasheet)."""
from __future__ import annotations

import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil


def host_bandwidth_gbs(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Host memory copy bandwidth (bytes read + written per second), best of a few large copies."""
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best / 1e9


def host_read_bandwidth(threads: int, nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """GB/s of reading nbytes (numpy uint64 sums) split across `threads` threads: what the pool could stream."""
    x = np.ones(nbytes // 8, np.uint64)
    n = x.shape[0]
    with ThreadPoolExecutor(threads) as ex:
        def once():
            list(ex.map(lambda c: x[c * n // threads:(c + 1) * n // threads].sum(), range(threads)))  # GIL released
        once()
        best = 1e9
        for _ in range(repeat):
            t = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _rate(cp, run, amount: int, iters: int) -> tuple[float, list[float]]:
    """amount / 1e9 per second of run(stream) (bytes moved: GB/s; FLOPs: GFLOP/s), on a stream of its own:
    (best, each of 3 runs of iters)."""
    s = cp.cuda.Stream(non_blocking=True)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    res = []
    for _ in range(2):
        run(s)
    for _ in range(3):
        e0.record(s)
        for _ in range(iters):
            run(s)
        e1.record(s)
        e1.synchronize()
        res.append(amount * iters / (cp.cuda.get_elapsed_time(e0, e1) * 1e-3) / 1e9)
    return max(res), res


def gpu_copy_bandwidth(cp, nbytes: int = 1 << 30, iters: int = 10) -> tuple[float, list[float]]:
    """Device-to-device copy rate in GB/s (bytes read + written), on non-constant data: (best, each of 3 runs)."""
    a = cp.empty(nbytes, cp.uint8)
    a.view(cp.uint32)[:] = cp.arange(nbytes // 4, dtype=cp.uint32) * np.uint32(2654435761)
    b = cp.empty_like(a)
    return _rate(cp, lambda s: b.data.copy_from_device_async(a.data, nbytes, s), 2 * nbytes, iters)


def gpu_upload_bandwidth(cp, nbytes: int = 256 << 20, iters: int = 4) -> tuple[float, list[float]]:
    """Page-locked host -> device copy rate in GB/s (the bus an expert read from host memory crosses)."""
    host = cp.cuda.alloc_pinned_memory(nbytes)
    np.frombuffer(host, np.uint8, nbytes)[:] = 7
    dev = cp.empty(nbytes, cp.uint8)
    h2d = 1  # cudaMemcpyHostToDevice
    return _rate(cp, lambda s: cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ptr, nbytes, h2d, s.ptr), nbytes, iters)


def gpu_gemm_tflops(cp, n: int = 8192, iters: int = 10) -> tuple[float, list[float]]:
    """fp16 tensor-core GEMM rate (cuBLAS, n x n x n, fp32 accumulation) in TFLOP/s: (best, each of 3 runs)."""
    a = cp.random.default_rng(0).standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b, c = a.T.copy(), cp.empty((n, n), cp.float16)

    def gemm(s):
        with s:
            cp.matmul(a, b, out=c)

    best, runs = _rate(cp, gemm, 2 * n ** 3, iters)  # GFLOP/s
    return best / 1e3, [r / 1e3 for r in runs]


class NoGpu(RuntimeError):
    """A GPU benchmark asked for where CuPy cannot reach a CUDA device."""


def need_gpu(scenario: str):
    """The cupy module, or NoGpu naming the scenario and why."""
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - ImportError, or CUDA's own error types (no driver, no device)
        raise NoGpu(f"the {scenario} benchmark runs on a CUDA GPU through CuPy: {type(e).__name__}: {e}") from None
    return cupy


def gpu_info(cp) -> dict:
    """The current CUDA device, its software and (where nvidia-smi answers) its clocks and power now."""
    import subprocess

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    info = {"device": name.decode() if isinstance(name, bytes) else name,
            "sm": dev.attributes["MultiProcessorCount"], "gpu_memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "gpu_count": cp.cuda.runtime.getDeviceCount(), "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "driver": cp.cuda.runtime.driverGetVersion()}
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001 - informational only
        info["nvidia_smi"] = repr(e)
    return info


def describe(gpu: bool = False) -> dict:
    hw = {"cpu": cpu_name(), "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
          "host_copy_gbs": round(host_bandwidth_gbs(), 1), "python": platform.python_version()}
    if gpu:
        import cupy

        hw |= gpu_info(cupy)
    return hw
