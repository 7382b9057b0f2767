"""The one worker process beside an event loop that prepares a client's big request (decoding, rendering the chat
template, tokenising: work that grows with the request and holds the GIL, so a thread would pause the loop as much).
The coordinator's intake (coordinator/intake.py, big ZeroMQ frames) and the HTTP gateway's (stratad/gateway/intake.py,
big bodies) each hold one; what they do with a request is theirs, the process is this module's.

The worker is spawned (not forked: the loop's process has sockets and threads) and started with its owner, in the
background, so that the first big request after a start does not wait for it: spawning it and loading the tokenizer
took 1.2 s unloaded, 2-4 s on a busy box (a soak's oversized requests after each restart). It ignores Ctrl-C (it
reaches the whole process group: its owner stops it) and dies with its owner (stratad.proc.die_with). A worker that
dies (killed, out of memory) fails what it held with BrokenProcessPool; the owner's loop, seeing that, calls broken(),
which starts a new one, unless that pool was replaced already (several of its requests fail at once).

Use it from one thread, the one that lives as long as its owner (a parent-death signal follows the thread that
started the child)."""
from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from stratad.proc import die_with

MAX_WAITING = 8  # big requests in or waiting for the worker (each up to 8 MiB a frame, 16 MiB a body); more: refused

_state = None  # in the worker: what its load function returned (a tokenizer, the gateway's Model)
_POOL = "_stratad_pool"  # the attribute naming, on each future, the pool it was submitted to


class PrepareFailed(Exception):
    """An unexpected failure preparing a request in the worker (a fault of ours, not the client's): the request
    (None where it is not known) and the cause's type, as text (not every exception pickles); raised `from` the
    cause, whose traceback reaches the owner as this one's __cause__ (concurrent.futures' remote traceback)."""

    def __init__(self, req_id: str | None, cause: str):
        super().__init__(req_id, cause)
        self.req_id, self.cause = req_id, cause

    def __str__(self) -> str:
        return self.cause


def _start(parent_pid: int, load: Callable, args: tuple) -> None:
    global _state
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the owner stops us
    die_with(parent_pid)  # and an owner killed takes us with it
    _state = load(*args)


def _call(fn: Callable, args: tuple):
    return fn(_state, *args)


def _started(_state) -> None:
    """The worker's first task: none (its initializer has loaded what it needs)."""


class WorkerPool:
    def __init__(self, load: Callable, *args):
        """load(*args), in the worker, returns what each task is called with (fn(state, ...)). load, its args and
        every task's function and arguments are pickled: module-level functions and plain data."""
        self.load, self.args = load, args
        self.pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker now, without waiting for it."""
        self.submit(_started)

    def submit(self, fn: Callable, *args) -> Future:
        """fn(state, *args) in the worker. A worker found dead here is replaced first."""
        if self.pool is None:
            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                                            initargs=(os.getpid(), self.load, self.args))
        try:
            fut = self.pool.submit(_call, fn, args)
        except BrokenProcessPool:  # it died since the last request, and nothing noticed
            self.close()
            return self.submit(fn, *args)
        setattr(fut, _POOL, self.pool)
        return fut

    def broken(self, fut: Future) -> bool:
        """Whether fut failed because its worker died; if so, and its pool is still the current one, a new worker
        is started now. A pool already replaced (another of its requests said so first) is left alone: closing it
        again would shut down the new one."""
        if not fut.done() or fut.cancelled() or not isinstance(fut.exception(), BrokenProcessPool):
            return False
        if self.pool is not None and getattr(fut, _POOL, None) is self.pool:
            self.close()
            self.start()
        return True

    def close(self) -> None:
        """End the worker (at once: what it holds fails) and wait for the pool's threads, so that the pool's
        semaphores are released before the owner exits (a pool left to the interpreter's exit had its worker's
        queues reported as leaked semaphores by multiprocessing's resource tracker)."""
        if self.pool is not None:
            pool, self.pool = self.pool, None
            for proc in list((pool._processes or {}).values()):  # no public way before Python 3.14's terminate_workers
                proc.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
