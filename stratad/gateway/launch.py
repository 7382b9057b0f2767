"""Where the gateway listens and the command line that starts it (the coordinator supervises it as a child)."""
from __future__ import annotations

import ipaddress
import socket
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


def listen_socket(listen: str, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound and listening at HOST:PORT (uvicorn's options: SO_REUSEADDR, its backlog). OSError when
    the address is taken or not this machine's."""
    host, port = parse_listen(listen)
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(backlog)
    except OSError:
        s.close()
        raise
    return s


def gateway_argv(runtime_dir: str, listen: str, model: str, context_length: int, api_key_file: str | None = None,
                 log_level: str = "info", listen_fd: int | None = None, parent_pid: int | None = None) -> list[str]:
    """The gateway's command line as the coordinator starts it (same interpreter, same runtime dir); listen_fd: the
    socket the coordinator bound at `listen`, inherited (the gateway then binds nothing itself); parent_pid: the
    coordinator's pid, whose death ends the gateway (it would hold the address, and the next start could not)."""
    argv = [sys.executable, "-m", "stratad.gateway", "--runtime-dir", runtime_dir, "--listen", listen,
            "--model", model, "--context-length", str(context_length), "--log-level", log_level]
    argv += ["--listen-fd", str(listen_fd)] if listen_fd is not None else []
    argv += ["--parent-pid", str(parent_pid)] if parent_pid is not None else []
    return argv + (["--api-key-file", api_key_file] if api_key_file else [])
