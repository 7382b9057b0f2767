"""Start the real daemon as a subprocess on CPU cards, wait until it serves, stop it and check what it left."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stratad import shm
from stratad.client import Client, DaemonUnavailable

ROOT = Path(__file__).resolve().parents[1]


class Daemon:
    def __init__(self, model: Path, runtime_dir: Path, cards: str = "cpu,cpu", extra: list[str] | None = None,
                 config: Path | None = None):
        self.model, self.runtime_dir, self.cards = model, runtime_dir, cards
        self.extra = extra or []
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.log = runtime_dir.parent / f"{runtime_dir.name}.log"

    def argv(self) -> list[str]:
        a = [sys.executable, "-m", "stratad.cli", "serve", "--model", str(self.model), "--cards", self.cards,
             "--runtime-dir", str(self.runtime_dir)]
        if self.config:
            a += ["--config", str(self.config)]
        return a + self.extra

    def start(self, timeout_s: float = 60.0) -> "Daemon":
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.argv(), stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.wait_ready(timeout_s)
        return self

    def client(self, **kw) -> Client:
        return Client(runtime_dir=str(self.runtime_dir), **kw)

    def status(self):
        with self.client(timeout_s=5) as c:
            return c.status()

    def wait_ready(self, timeout_s: float = 60.0, restarts: int | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                st = self.status()
                if all(ln.role.value not in ("starting", "down") for ln in st.lanes) and \
                        (restarts is None or sum(ln.restarts for ln in st.lanes) >= restarts):
                    return
            except DaemonUnavailable:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"daemon not ready in {timeout_s} s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> int:
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

    def lane_pids(self) -> list[int]:
        return [ln.pid for ln in self.status().lanes]

    def leftovers(self) -> list[str]:
        segs = [str(p) for p in shm.SHM_DIR.glob(shm.prefix_for(self.runtime_dir).lstrip("/") + "*")]
        socks = [str(p) for p in self.runtime_dir.glob("*.sock")]
        return segs + socks
