"""What a benchmark ran on, and the memory bandwidth its floors are held against (measured, not datasheet)."""
from __future__ import annotations

import os
import platform
import time

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


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(gpu: bool = False) -> dict:
    hw = {"cpu": cpu_name(), "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
          "host_copy_gbs": round(host_bandwidth_gbs(), 1), "python": platform.python_version()}
    if gpu:
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        hw |= {"gpu": props["name"].decode(), "gpu_count": cupy.cuda.runtime.getDeviceCount(),
               "gpu_memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
               "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion()}
    return hw
