"""A daemon run as a child process (the demo, benchmarks, tests): start, wait until every lane serves, stop."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stratad.client import Client, DaemonUnavailable


class LocalDaemon:
    """http: the gateway's HOST:PORT ("" none, the default, so that several such daemons run at once; None: what the
    config file or the daemon's default says)."""

    def __init__(self, model: str | os.PathLike, cards: str = "cpu,cpu", runtime_dir: str | os.PathLike | None = None,
                 args: list[str] | tuple[str, ...] = (), config: str | os.PathLike | None = None,
                 log: str | os.PathLike | None = None, http: str | None = ""):
        self.model, self.cards = Path(model), cards
        self.runtime_dir = Path(runtime_dir or tempfile.mkdtemp(prefix="stratad-"))
        self.args, self.config, self.http = list(args), config, http
        self.log = Path(log) if log else None
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        a = [sys.executable, "-m", "stratad.cli", "serve", "--model", str(self.model), "--cards", self.cards,
             "--runtime-dir", str(self.runtime_dir)]
        a += ["--config", str(self.config)] if self.config else []
        return a + (["--http", self.http] if self.http is not None else []) + self.args

    def start(self, timeout_s: float = 120.0) -> "LocalDaemon":
        out = open(self.log, "ab") if self.log else None
        self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.wait_ready(timeout_s)
        return self

    def client(self, **kw) -> Client:
        return Client(runtime_dir=str(self.runtime_dir), **kw)

    def status(self):
        with self.client(timeout_s=5) as c:
            return c.status()

    def wait_ready(self, timeout_s: float = 120.0, restarts: int | None = None) -> None:
        """Until every lane serves (and, with `restarts`, at least that many lane restarts happened)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stratad exited with status {self.proc.returncode}")
            try:
                st = self.status()
                if all(ln.role.value not in ("starting", "down") for ln in st.lanes) and \
                        (restarts is None or sum(ln.restarts for ln in st.lanes) >= restarts):
                    return
            except DaemonUnavailable:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"stratad not ready within {timeout_s} s")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a clean stop); SIGKILL to the whole process group if it does not end in time."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self.proc = None
        return rc
