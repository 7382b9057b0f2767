"""Lane processes: spawning, liveness (exit status and heartbeats), restarts with back-off."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from protos import messages as M
from stratad import shm
from stratad.config import LaneConfig
from stratad.threads import env_with as threads_env

log = logging.getLogger("stratad.coordinator")

RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0)
MAX_START_FAILURES = 3  # a lane that dies this many times in a row before serving is given up on


@dataclass
class LaneHandle:
    lane: int
    card: str
    proc: subprocess.Popen | None = None
    ready: bool = False
    role: M.Role = M.Role.STARTING
    req_id: str | None = None
    last_seen: float = 0.0
    status: M.LaneStatus | None = None
    restarts: int = 0
    restart_at: float = 0.0  # when a dead lane may be started again
    start_failures: int = 0  # deaths before becoming ready, in a row
    failed: str | None = None  # why the lane was given up on
    fail_reason: str | None = None  # what the lane said before exiting (LaneFailed)
    pid: int = 0

    @property
    def identity(self) -> bytes:
        return f"lane-{self.lane}".encode()

    @property
    def free(self) -> bool:
        return self.ready and self.req_id is None


class Supervisor:
    def __init__(self, cards: list[str], argv_for, shm_prefix: str, timeout_s: float, threads: int,
                 start_timeout_s: float):
        self.lanes = [LaneHandle(i, c) for i, c in enumerate(cards)]
        self.threads = threads
        self.argv_for = argv_for  # lane -> argv
        self.shm_prefix = shm_prefix
        self.timeout_s = timeout_s
        # building a card (kernels compiled on a cold cache, GBs of experts uploaded, two lanes sharing a GPU) is
        # silent for longer than a serving lane may be
        self.start_timeout_s = start_timeout_s

    def start(self, h: LaneHandle) -> None:
        h.proc = subprocess.Popen(self.argv_for(h), stdin=subprocess.DEVNULL, env=child_env(self.threads) | {"STRATAD_PARENT_PID": str(os.getpid())})
        h.pid, h.ready, h.req_id, h.last_seen = h.proc.pid, False, None, time.monotonic()
        h.fail_reason = None
        h.role = M.Role.STARTING
        log.info("lane %d (card %s) started, pid %d", h.lane, h.card, h.pid)

    def start_all(self) -> None:
        for h in self.lanes:
            self.start(h)

    def by_identity(self, ident: bytes) -> LaneHandle | None:
        for h in self.lanes:
            if h.identity == ident:
                return h
        return None

    def reap(self) -> list[tuple[LaneHandle, str]]:
        """Lanes that died (exited, or silent past the timeout) since the last call, with why."""
        dead, now = [], time.monotonic()
        for h in self.lanes:
            if h.proc is None:
                continue
            rc = h.proc.poll()
            why = None
            if rc is not None:
                why = f"lane {h.lane} exited with status {rc}" if rc >= 0 else \
                    f"lane {h.lane} was killed by {signal.Signals(-rc).name}"
            elif now - h.last_seen > (self.timeout_s if h.ready else self.start_timeout_s):
                what = "stopped answering for" if h.ready else "did not finish starting (building its card) in"
                why = f"lane {h.lane} {what} {now - h.last_seen:.0f} s"
                h.proc.kill()
                h.proc.wait()
            if why:
                if h.fail_reason:
                    why = f"{why}: {h.fail_reason}"
                self.mark_dead(h, why)
                dead.append((h, why))
        return dead

    def mark_dead(self, h: LaneHandle, why: str = "") -> None:
        h.start_failures = 0 if h.ready else h.start_failures + 1
        if h.start_failures >= MAX_START_FAILURES:
            h.failed = f"{why}; it failed to start {h.start_failures} times in a row, so it is not restarted"
        h.proc, h.ready = None, False
        h.role = M.Role.DOWN
        h.status = None
        shm.unlink_prefix(f"{self.shm_prefix}lane{h.lane}-")  # whatever the dead lane could not release
        h.restart_at = time.monotonic() + RESTART_BACKOFF_S[min(h.restarts, len(RESTART_BACKOFF_S) - 1)]
        h.restarts += 1

    def restart_due(self) -> None:
        now = time.monotonic()
        for h in self.lanes:
            if h.proc is None and h.role == M.Role.DOWN and not h.failed and now >= h.restart_at:
                self.start(h)

    def stop_all(self, timeout_s: float = 5.0) -> None:
        live = [h for h in self.lanes if h.proc is not None]
        for h in live:
            if h.proc.poll() is None:
                h.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for h in live:
            try:
                rc = h.proc.wait(max(0.0, deadline - time.monotonic()))
                if rc == -signal.SIGTERM and not h.ready:  # still importing: no handler yet, nothing to release
                    log.info("lane %d was stopped while starting", h.lane)
                elif rc != 0:  # a lane leaves at its next safe point with 0: anything else is worth a look
                    log.warning("lane %d exited with status %d at the stop", h.lane, rc)
            except subprocess.TimeoutExpired:
                log.warning("lane %d did not stop within %.0f s: killed", h.lane, timeout_s)
                h.proc.kill()
                h.proc.wait()
            h.proc = None
        shm.unlink_prefix(self.shm_prefix + "lane")


def lane_argv(cfg: LaneConfig) -> list[str]:
    """The lane's command line: its whole configuration as one JSON argument (lane/main.py reads it)."""
    return [sys.executable, "-m", "lane.main", cfg.model_dump_json()]


def child_env(threads: int) -> dict[str, str]:
    """The daemon's environment minus systemd's notification variables (only the coordinator speaks to systemd),
    with each lane's compute threads capped so that lanes share the cores instead of oversubscribing them."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return threads_env(threads, env)
