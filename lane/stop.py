"""A lane's SIGTERM (the coordinator's stop, or its death through PR_SET_PDEATHSIG): a flag and a wake-up, never an
exception. The lane leaves at its next safe point (an idle poll, between tokens, between a prompt's chunks) and
closes its threads, segments and sockets in one place (Lane.close).

sys.exit in the handler had raised wherever the lane was: inside Thread.start() of the host-cache writer (Lane.close's
join then raised "cannot join thread before it is started") or inside ZeroMQ's cleanup, each a traceback in the
daemon's log (the soaks' "tracebacks" in docs/bench/2026-12-05-cpu-2core-soak*.json).

Once the lane has closed, SIGTERM is ignored: the coordinator's stop sends Shutdown and then SIGTERM to each lane
still running, and a lane already leaving is then in the interpreter's finalisation, where Python puts the default
action back for every signal with a Python handler; the signal killed it there (status -15 in the log, a CI run).
"""
from __future__ import annotations

import os
import signal


class StopSignal:
    """Installs the handler; `fd` becomes readable on the signal (signal.set_wakeup_fd), so a poll that has it
    returns at once: pyzmq retries an interrupted poll for its whole timeout, which a flag alone does not shorten."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.set = False
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        signal.signal(signum, self._on_signal)

    def _on_signal(self, *_a) -> None:
        self.set = True

    def drain(self) -> None:
        try:
            while os.read(self.fd, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        signal.signal(self.signum, signal.SIG_IGN)  # the process is leaving: a later signal has nothing to stop
        signal.set_wakeup_fd(-1)
        os.close(self.fd)
        os.close(self._w)
