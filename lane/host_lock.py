"""Page-locking a host range (the expert arena, a model mapping) for DMA, shared by every card of the process.

CUDA registers a range once per process: a second cudaHostRegister of it fails, and a range unmapped while still
registered poisons every later copy from addresses mapped there again (cudaErrorInvalidValue). So registrations
are counted per start address and released with their last user — by close(), or by a finalizer if the user is
dropped without one — always before the mapping itself can go.
"""
from __future__ import annotations

import logging
import threading
import weakref

import cupy as cp
import numpy as np

log = logging.getLogger(__name__)
READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads, and read-only mappings can be registered
_users: dict[int, int] = {}  # start address -> users
_lock = threading.Lock()


def lock(owner: object, mem: np.ndarray) -> weakref.finalize | None:
    """Page-lock mem for as long as owner lives; the handle returned releases it early (call it in close()).
    None if the range stays pageable (copies from it still work, through the driver's staging)."""
    ptr = mem.ctypes.data
    with _lock:
        if ptr not in _users:
            try:
                cp.cuda.runtime.hostRegister(ptr, mem.nbytes, READ_ONLY)
            except cp.cuda.runtime.CUDARuntimeError as e:
                log.info("host range not page-locked (%s): copies from it go through the driver's staging", e)
                return None
            _users[ptr] = 0
        _users[ptr] += 1
    return weakref.finalize(owner, _release, ptr)


def _release(ptr: int) -> None:
    with _lock:
        _users[ptr] -= 1
        if _users[ptr]:
            return
        del _users[ptr]
    try:
        cp.cuda.runtime.hostUnregister(ptr)
    except cp.cuda.runtime.CUDARuntimeError as e:  # the context is gone already (interpreter exit): nothing held
        log.debug("hostUnregister: %s", e)
