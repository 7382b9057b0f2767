"""The HTTP gateway as the coordinator's child (config key `http`): started with the daemon, restarted with the
lanes' back-off when it dies, stopped with the daemon. It holds no model memory; its log is the daemon's.

The coordinator binds the address itself, before any lane starts, and hands the listening socket to each gateway
process it starts: an address already taken stops `stratad serve` at once with an error naming it and the setting
(instead of a gateway that fails and is restarted for ever), and a restarted gateway never has to bind again
(connections that arrive meanwhile wait in the socket's backlog). The gateway is told the coordinator's pid and dies
with it (stratad.proc.die_with): a SIGKILLed coordinator must not leave it holding the address, which the next
`stratad serve` could not bind then. Started from the loop's thread only (the main one): a parent-death signal
follows the thread that started the child."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time

from coordinator.lanes import RESTART_BACKOFF_S, child_env
from stratad.config import ConfigError, DaemonConfig
from stratad.gateway.launch import gateway_argv, listen_socket

log = logging.getLogger("stratad.coordinator")


class GatewayChild:
    def __init__(self, argv: list[str], sock: socket.socket | None = None):
        self.argv, self.sock = argv, sock
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.restart_at = 0.0

    @classmethod
    def for_config(cls, cfg: DaemonConfig, runtime_dir: str, model: str, context_length: int) -> "GatewayChild":
        """Binds cfg.http, having read the API key file as the gateway will (ConfigError naming the setting when
        either cannot be: a gateway that cannot start would be restarted for ever)."""
        from stratad.gateway.guard import load_key

        if cfg.api_key_file:
            try:
                load_key(cfg.api_key_file)
            except (OSError, ValueError) as e:
                raise ConfigError(f"api_key_file = {cfg.api_key_file!r}: the HTTP gateway cannot read its key "
                                  f"({e.strerror if isinstance(e, OSError) else e})") from None
        try:
            sock = listen_socket(cfg.http)
        except OSError as e:
            raise ConfigError(f"http = {cfg.http!r}: the HTTP gateway cannot listen there ({e.strerror or e}); set "
                              f"http (config file or --http) to a free HOST:PORT, or to \"\" for no gateway") from None
        return cls(gateway_argv(runtime_dir, cfg.http, model, context_length, cfg.api_key_file, cfg.log_level,
                                listen_fd=sock.fileno(), parent_pid=os.getpid()), sock)

    def start(self) -> None:
        fds = (self.sock.fileno(),) if self.sock is not None else ()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, env=child_env(1), pass_fds=fds)
        log.info("HTTP gateway started, pid %d: %s", self.proc.pid, " ".join(self.argv[3:]))

    def poll(self) -> None:
        """From the coordinator's tick: a gateway that exited is started again once its back-off has passed."""
        if self.proc is not None:
            rc = self.proc.poll()
            if rc is None:
                return
            self.proc = None
            self.restart_at = time.monotonic() + RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
            self.restarts += 1
            log.error("HTTP gateway exited with status %d; restarting it", rc)
        elif time.monotonic() >= self.restart_at:
            self.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        try:
            self._stop_proc(timeout_s)
        finally:
            if self.sock is not None:
                self.sock.close()
                self.sock = None

    def _stop_proc(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # uvicorn ends its open responses, then exits
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
