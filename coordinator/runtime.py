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
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = self.path.stat()
        except OSError as e:  # a file there, a parent missing or not writable
            raise RuntimeDirError(f"runtime directory {self.path}: cannot create it ({e.strerror})") from None
        if st.st_uid != os.getuid():
            raise RuntimeDirError(f"runtime directory {self.path} belongs to uid {st.st_uid}, not to us")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.path, 0o700)
        self._lock_fd = self._lock()
        try:
            reclaimed = self._reclaim()
            (self.path / "stratad.pid").write_text(f"{os.getpid()}\n")
            try:  # so that a client not told the directory finds it
                self._record = discovery.register(self.path)
            except OSError as e:
                log.warning("runtime dir %s not registered for clients (%s): they need --runtime-dir", self.path, e)
        except BaseException:
            self.release()
            raise
        return reclaimed

    def _lock(self) -> int:
        """The exclusive lock on `stratad.lock`, created if missing. release() unlinks the file while it still
        holds the lock, so a lock won on a file no longer at that path (opened before a release unlinked it)
        guards nothing: it is dropped and the path opened again."""
        lock = self.path / "stratad.lock"
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as e:  # a directory of that name, say
                raise RuntimeDirError(f"runtime directory {self.path}: cannot open its lock file {lock.name} "
                                      f"({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise RuntimeDirError(f"another stratad (pid {self.read_pid() or '?'}) is running with runtime "
                                        f"directory {self.path}") from None
                raise
            try:
                st, held = os.stat(lock), os.fstat(fd)
                if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                    return fd
            except FileNotFoundError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def read_pid(self) -> int | None:
        try:
            return int((self.path / "stratad.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def _reclaim(self) -> list[str]:
        out = []
        for p in self.path.glob("*.sock"):
            if p.is_dir() and not p.is_symlink():
                raise RuntimeDirError(f"{p} is a directory where the daemon's socket goes: remove it")
            p.unlink(missing_ok=True)
            out.append(str(p))
        out += shm.unlink_prefix(self.shm_prefix)
        here = self.path.resolve()
        for record, rt in discovery.dead_records():
            if rt != here:
                out += _reclaim_segments_of(rt)
            discovery.unregister(record)
        return out

    def release(self) -> None:
        """Remove what this daemon made in the directory (sockets, pid file, segments, registry entry, and last
        the lock file, unlinked while still locked: see _lock), leaving the directory empty. Without the lock
        (a start refused because another daemon holds it) nothing here is ours: nothing is touched."""
        if self._lock_fd is None:
            return
        try:
            for p in list(self.path.glob("*.sock")) + [self.path / "stratad.pid"]:
                if not p.is_dir() or p.is_symlink():  # a directory there is not ours (acquire refused it)
                    p.unlink(missing_ok=True)
            shm.unlink_prefix(self.shm_prefix)
            if self._record is not None:
                discovery.unregister(self._record)
                self._record = None
            (self.path / "stratad.lock").unlink(missing_ok=True)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None



def _reclaim_segments_of(rt: Path) -> list[str]:
    """The shared-memory segments of a killed daemon that ran in another runtime directory (a crashed test's
    temporary one, say: no start there would ever reclaim them). Taken under that directory's lock, so that a
    daemon starting there meanwhile keeps its own; a held lock means one runs there now: nothing is touched."""
    try:
        fd = os.open(rt / "stratad.lock", os.O_RDWR)
    except FileNotFoundError:  # its directory removed, or its lock: no daemon there (one starting there now makes
        # its segments only after its own reclaim and the model's load, long after this)
        return shm.unlink_prefix(shm.prefix_for(rt))
    except OSError:
        return []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return []
    try:
        return shm.unlink_prefix(shm.prefix_for(rt))
    finally:
        os.close(fd)
