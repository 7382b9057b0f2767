"""How a helper process follows its parent's death (Linux): the intake workers, the HTTP gateway.

PR_SET_PDEATHSIG alone is not enough: a parent that died before the prctl call (a coordinator SIGKILLed while its
child was still starting) sends nothing, and the child, reparented, would run for good. So the caller names the
parent it was started by, and a child whose parent is no longer that one signals itself at once."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Deliver sig to this process when its parent (parent_pid, the process that started it) dies; if it has died
    already, deliver sig now. The signal's handler, if the process has one, does the stopping (uvicorn's SIGTERM
    ends open responses, then exits), else its default action ends the process. The parent is the thread that
    forked this process, strictly: start children from a thread that lives as long as the parent (the main one).
    False where the call is not available (not Linux): nothing is set up."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # it died before the prctl above: nothing would be sent
        os.kill(os.getpid(), sig)
    return True
