"""Named POSIX shared-memory segments of one daemon instance: owner-only, found again by prefix after a crash."""
from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import numpy as np
import posix_ipc

SHM_DIR = Path("/dev/shm")


def prefix_for(runtime_dir: str | os.PathLike) -> str:
    """A restart with the same runtime dir derives the same prefix and so finds its predecessor's leftovers."""
    h = hashlib.sha1(str(Path(runtime_dir).resolve()).encode()).hexdigest()[:10]
    return f"/stratad-{os.getuid()}-{h}-"


class Segment:
    """A mapped segment; the creator unlinks it on close, an attacher only unmaps. reserve: its pages taken at
    creation (see reserve), for a segment its creator fills at once anyway; else they are taken as written."""

    def __init__(self, name: str, size: int = 0, create: bool = False, reserve: bool = False):
        self.name, self.owner = name, create
        flags = posix_ipc.O_CREX if create else 0
        shm = posix_ipc.SharedMemory(name, flags, mode=0o600, size=size if create else 0)
        try:
            if create and reserve and size:
                reserve_pages(shm.fd, name, size)
            self.size = shm.size
            self.map = mmap.mmap(shm.fd, shm.size) if shm.size else None
        finally:
            shm.close_fd()

    def array(self, dtype=np.uint8, offset: int = 0, shape=None) -> np.ndarray:
        a = np.frombuffer(self.map, dtype=np.uint8, count=self.size - offset, offset=offset)
        a = a.view(dtype)
        return a if shape is None else a[: int(np.prod(shape))].reshape(shape)

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # numpy views still alive; the mapping goes with the process
                pass
            self.map = None
        if self.owner:
            unlink(self.name)
            self.owner = False


def reserve_pages(fd: int, name: str, size: int) -> None:
    """The segment's pages taken now (a new segment is sparse): a /dev/shm without room for them is an OSError
    naming the segment here, not a SIGBUS in the process that first writes a page there is no room for. Not for
    the host conversation cache: taken at once, a quarter of the host's memory would be held from the start, and
    by a crashed daemon's segment until the next start reclaims it."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        unlink(name)
        raise OSError(e.errno, f"shared memory ({SHM_DIR}) has no room for {size / 2**20:.1f} MiB more (segment "
                      f"{name}): {e.strerror}") from None


def unlink(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with prefix."""
    if not SHM_DIR.is_dir():
        return []
    return ["/" + p.name for p in SHM_DIR.glob(prefix.lstrip("/") + "*") if unlink("/" + p.name)]
