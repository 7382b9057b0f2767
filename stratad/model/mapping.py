"""Map several files (a split model's shards) read-only into one contiguous range of addresses, without a copy.

The arena every card reads is one uint8 array: a shard's tensors are views of it at the shard's base, so the CPU
pool, the GPU card's page-locking (one registration of the whole range) and its zero-copy reads see one buffer
whatever the number of shards. An address range is reserved, then each file is mapped over its part (MAP_FIXED);
each part is a whole number of pages, so the range has no holes (a file's last page reads zeros past its end).
The range is unmapped when the last array viewing it goes.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
PROT_NONE, MAP_FIXED = 0, 0x10  # Linux, every architecture
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # the reservation takes no swap accounting
MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = mmap.PAGESIZE


def _check(addr, what: str) -> int:
    if addr is None or addr == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return addr


def map_files(paths: list[str | os.PathLike], sizes: list[int]) -> tuple[np.ndarray, list[int]]:
    """(read-only uint8 array over every file, each file's byte offset in it)."""
    spans = [-(-s // PAGE) * PAGE for s in sizes]
    total = sum(spans)
    base = _check(_libc.mmap(None, total, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE,
                             -1, 0), f"reserving {total} bytes of addresses")
    offsets, off = [], 0
    try:
        for path, span in zip(paths, spans):
            fd = os.open(path, os.O_RDONLY)
            try:
                got = _check(_libc.mmap(base + off, span, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, 0),
                             f"mapping {path}")
            finally:
                os.close(fd)
            if got != base + off:
                raise OSError(f"mapping {path}: placed at {got:#x}, not {base + off:#x}")
            offsets.append(off)
            off += span
    except BaseException:
        _libc.munmap(base, total)
        raise
    buf = (ctypes.c_uint8 * total).from_address(base)
    fin = weakref.finalize(buf, _libc.munmap, base, total)  # every view holds buf: unmapped after the last one
    fin.atexit = False  # not at interpreter exit, where a thread may still read it: the exit unmaps it anyway
    arr = np.frombuffer(buf, np.uint8)
    arr.flags.writeable = False
    return arr, offsets
