"""The runtime directory (sockets, lock, pid file) and the reclaiming of what a crashed daemon left behind."""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

from stratad import discovery, shm

log = logging.getLogger("stratad.runtime")


class RuntimeDirError(RuntimeError):
    pass


class RuntimeDir:
    """Owns the directory for the daemon's lifetime through an exclusive lock on `stratad.lock`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock_fd: int | None = None
        self._record: Path | None = None  # this daemon's entry in the user's registry (stratad.discovery)

    @property
    def client_endpoint(self) -> str:
        return f"ipc://{self.path / 'client.sock'}"

    @property
    def lane_endpoint(self) -> str:
        return f"ipc://{self.path / 'lanes.sock'}"

    @property
    def shm_prefix(self) -> str:
        return shm.prefix_for(self.path)

    def acquire(self) -> list[str]:
        """Create (0700), lock, and reclaim stale sockets and segments. Returns what was reclaimed."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = self.path.stat()
        if st.st_uid != os.getuid():
            raise RuntimeDirError(f"runtime directory {self.path} belongs to uid {st.st_uid}, not to us")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.path, 0o700)
        fd = os.open(self.path / "stratad.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise RuntimeDirError(f"another stratad (pid {self.read_pid() or '?'}) is running with runtime "
                                    f"directory {self.path}") from None
            raise
        self._lock_fd = fd
        reclaimed = self._reclaim()
        (self.path / "stratad.pid").write_text(f"{os.getpid()}\n")
        try:  # so that a client not told the directory finds it
            self._record = discovery.register(self.path)
        except OSError as e:
            log.warning("runtime dir %s not registered for clients (%s): they need --runtime-dir", self.path, e)
        return reclaimed

    def read_pid(self) -> int | None:
        try:
            return int((self.path / "stratad.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def _reclaim(self) -> list[str]:
        out = []
        for p in self.path.glob("*.sock"):
            p.unlink(missing_ok=True)
            out.append(str(p))
        out += shm.unlink_prefix(self.shm_prefix)
        return out

    def release(self) -> None:
        for p in list(self.path.glob("*.sock")) + [self.path / "stratad.pid"]:
            p.unlink(missing_ok=True)
        shm.unlink_prefix(self.shm_prefix)
        if self._record is not None:
            discovery.unregister(self._record)
            self._record = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

