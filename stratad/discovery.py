"""Which runtime directory a client (stratactl, `Client()`) talks to when it is not told.

A running daemon registers its runtime directory in the user's registry (a file named by its pid, holding the
directory), so `stratactl status` finds a daemon started with `--runtime-dir /tmp/st`. The order: an explicit
directory, then $STRATAD_RUNTIME_DIR, then the default directory if a daemon's socket is there, then the one
running daemon the registry names (several: none is picked, the message names them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from stratad.config import default_runtime_dir

ENV = "STRATAD_RUNTIME_DIR"
SOCKET = "client.sock"


def registry_dir() -> Path:
    """$XDG_RUNTIME_DIR/stratad.daemons; without that variable beside the default runtime directory (root:
    /run/stratad.daemons)."""
    return Path(os.environ.get("XDG_RUNTIME_DIR") or Path(default_runtime_dir()).parent) / "stratad.daemons"


def register(runtime_dir: str | os.PathLike) -> Path:
    """Record this process's runtime directory; returns the record (remove it with `unregister`). Raises OSError
    where the registry cannot be written."""
    reg = registry_dir()
    reg.mkdir(mode=0o700, parents=True, exist_ok=True)
    if reg.stat().st_uid != os.getuid():  # another user's folder (e.g. squatted in /tmp): do not write there
        raise PermissionError(f"{reg} belongs to uid {reg.stat().st_uid}, not to us")
    rec = reg / str(os.getpid())
    tmp = reg / f".{os.getpid()}.tmp"
    tmp.write_text(f"{Path(runtime_dir).resolve()}\n")
    tmp.replace(rec)
    return rec


def unregister(record: Path) -> None:
    record.unlink(missing_ok=True)


def dead_records() -> list[tuple[Path, Path]]:
    """(record, runtime dir) of every registered daemon that is gone (killed without its stop): what it left is
    reclaimed by the next start (coordinator.runtime), which then drops the record with `unregister`."""
    reg = registry_dir()
    return [(reg / str(pid), rt) for pid, rt in _records(reg) if not _alive(pid)]


def _records(reg: Path) -> list[tuple[int, Path]]:
    """(pid, runtime dir) of every record."""
    try:
        entries = [p for p in reg.iterdir() if p.name.isdigit()]
    except OSError:  # no registry yet
        return []
    out = []
    for p in entries:
        try:
            out.append((int(p.name), Path(p.read_text().strip())))
        except OSError:  # removed meanwhile
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process has the pid now
        return False
    return True


def _serving(pid: int, rt: Path) -> bool:
    """The daemon of this record is running and listening in rt (its pid file names it: pids are reused)."""
    try:
        return _alive(pid) and int((rt / "stratad.pid").read_text().strip()) == pid and (rt / SOCKET).exists()
    except (OSError, ValueError):
        return False


@dataclass
class Lookup:
    path: Path | None  # the runtime directory to talk to; None: no daemon found
    looked: list[str] = field(default_factory=list)  # every place looked, with what was found there

    def message(self) -> str:
        return "no running stratad found: " + "; ".join(self.looked) + \
            " (start one with `stratad serve`, or name its runtime dir: --runtime-dir DIR or " + ENV + "=DIR)"


def lookup(explicit: str | os.PathLike | None = None) -> Lookup:
    if explicit:
        return Lookup(Path(explicit), [f"--runtime-dir {explicit}"])
    if os.environ.get(ENV):
        return Lookup(Path(os.environ[ENV]), [f"{ENV}={os.environ[ENV]}"])
    default = Path(default_runtime_dir())
    looked = [f"{ENV} is not set", f"no socket at {default / SOCKET} (the default runtime dir)"]
    if (default / SOCKET).exists():
        return Lookup(default, [f"the default runtime dir {default}"])
    reg = registry_dir()
    running = sorted({rt for pid, rt in _records(reg) if _serving(pid, rt)})
    if len(running) == 1:
        return Lookup(running[0], looked + [f"the daemon registered in {reg}"])
    if running:
        looked.append(f"{len(running)} daemons registered in {reg}, none picked: " + ", ".join(map(str, running)))
    else:
        looked.append(f"no running daemon registered in {reg}")
    return Lookup(None, looked)


def runtime_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The directory to talk to; the default one where no daemon is found (a client's connect then says so)."""
    return lookup(explicit).path or Path(default_runtime_dir())
