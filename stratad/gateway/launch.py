"""Where the gateway listens and the command line that starts it (the coordinator supervises it as a child)."""
from __future__ import annotations

import ipaddress
import sys


def parse_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); ValueError naming the problem."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"port of {listen!r} is not a number in 1..65535")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Only this machine can reach the address (a name other than localhost counts as reachable from outside)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def gateway_argv(runtime_dir: str, listen: str, model: str, context_length: int, api_key_file: str | None = None,
                 log_level: str = "info") -> list[str]:
    """The gateway's command line as the coordinator starts it (same interpreter, same runtime dir)."""
    argv = [sys.executable, "-m", "stratad.gateway", "--runtime-dir", runtime_dir, "--listen", listen,
            "--model", model, "--context-length", str(context_length), "--log-level", log_level]
    return argv + (["--api-key-file", api_key_file] if api_key_file else [])
