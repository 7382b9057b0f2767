"""systemd's readiness and watchdog protocol (sd_notify), spoken directly over $NOTIFY_SOCKET."""
from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send e.g. "READY=1", "WATCHDOG=1", "STOPPING=1", "STATUS=..."; False when not run by systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(state.encode())
    return True


def watchdog_interval_s() -> float | None:
    """Half the watchdog timeout systemd set for this process (the recommended ping interval), if any."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
