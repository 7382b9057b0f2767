"""Compute threads of a process: capped through the environment so that several lanes share the cores."""
from __future__ import annotations

import os

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def per_lane(configured: int, n_lanes: int) -> int:
    """The configured count, or the cores divided among the lanes."""
    return configured or max(1, (os.cpu_count() or 1) // max(1, n_lanes))


def env_with(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for k in THREAD_VARS:
        env[k] = str(threads)
    return env
