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

import numpy as np

log = logging.getLogger(__name__)
READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads, and read-only mappings can be registered
MAPPED = 2  # cudaHostRegisterMapped: kernels may read the range directly (zero-copy)
_users: dict[int, list] = {}  # start address -> [users, mapped]
_lock = threading.Lock()


def _runtime():
    import cupy

    return cupy.cuda.runtime


class Lock:
    """A user's hold on a page-locked range: release() (or the owner's finalizer) gives it up; mapped says whether
    kernels may read the range directly (else it is page-locked for copies only)."""

    def __init__(self, owner: object, ptr: int, nbytes: int, mapped: bool):
        self.mapped, self.ptr, self.nbytes = mapped, ptr, nbytes
        self.release = weakref.finalize(owner, _release, ptr)

    def covers(self, mem: np.ndarray) -> bool:
        """Whether mem lies in the locked range (and the lock is still held)."""
        a = mem.ctypes.data
        return self.release.alive and self.ptr <= a and a + mem.nbytes <= self.ptr + self.nbytes


def lock(owner: object, mem: np.ndarray) -> Lock | None:
    """Page-lock mem for as long as owner lives (mapped for kernels where the driver allows, else for copies only).
    None if the range stays pageable (copies from it still work, through the driver's staging)."""
    ptr, rt = mem.ctypes.data, _runtime()
    with _lock:
        if ptr not in _users:
            for flags in (READ_ONLY | MAPPED, READ_ONLY):
                try:
                    rt.hostRegister(ptr, mem.nbytes, flags)
                except rt.CUDARuntimeError as e:
                    log.info("host range not page-locked with flags %d (%s)", flags, e)
                    continue
                _users[ptr] = [0, bool(flags & MAPPED), mem.nbytes]
                break
            else:  # copies from it go through the driver's staging
                return None
        _users[ptr][0] += 1
        return Lock(owner, ptr, _users[ptr][2], _users[ptr][1])


def _release(ptr: int) -> None:
    with _lock:
        _users[ptr][0] -= 1
        if _users[ptr][0]:
            return
        del _users[ptr]
    rt = _runtime()
    try:
        rt.hostUnregister(ptr)
    except rt.CUDARuntimeError as e:  # the context is gone already (interpreter exit): nothing held
        log.debug("hostUnregister: %s", e)
