"""A client's big request turned into prompt tokens off the coordinator's loop, in the order the client sent it.

Everything done with a request's frame scales with it: decoding it (pydantic-core builds a Python object for each
value: 150,000 empty messages take 0.4 s), rendering its chat template and tokenising the result (seconds for
megabytes), and all of it holds the GIL, so a thread would pause the loop as much. A frame over HEAVY_BYTES goes
whole to a worker process (started once, with its own copy of the tokenizer), which decodes it, refuses it by its
size before rendering anything (`size_refusal`), renders and tokenises it, and sends back the request with its
prompt as token ids, or the error to answer; the loop polls `ready()` every turn. A smaller frame (at most ~1,100
messages or 32 KB of text: milliseconds) is handled in the loop. While one of a client's frames is in the worker,
that client's later messages wait behind it, so its order is kept.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from protos import messages as M
from protos.codec import FrameError, decode
from stratad.proc import die_with
from stratad.prompts import INPUT_ERRORS, size_refusal

_tokenizer = None  # the worker process's own


class PrepareFailed(Exception):
    """An unexpected failure preparing a request in the worker (a fault of ours): the request and the cause's
    type; the cause's traceback comes along (concurrent.futures' remote traceback)."""

    def __init__(self, req_id: str | None, cause: str):
        super().__init__(req_id, cause)
        self.req_id, self.cause = req_id, cause


def _start_worker(model_path: str, coordinator_pid: int) -> None:
    from stratad.model.tokenizer import Tokenizer

    global _tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the coordinator stops us
    die_with(coordinator_pid)
    _tokenizer = Tokenizer.from_file(model_path)


def prepare_frame(tokenizer, frame: bytes, prepare: Callable, context_length: int, max_prompt_bytes: int):
    """What the worker makes of a client's frame: an Error to answer (a bad frame, a request refused by its size or
    its input), or the message to handle; a Generate comes back with its prompt as token ids (its text, tools and
    prefill dropped). A failure of ours raises PrepareFailed."""
    try:
        msg = decode(frame, M.ClientToCoordinator)
    except FrameError as e:
        return M.Error(code=e.code, message=str(e))
    if not isinstance(msg, M.Generate):
        return msg
    if (why := size_refusal(msg, context_length, max_prompt_bytes)) is not None:
        return M.Error(req_id=msg.req_id, code=why[0], message=why[1])
    try:
        tokens = prepare(tokenizer, msg)
    except INPUT_ERRORS as e:
        return M.Error(req_id=msg.req_id, code=M.ErrorCode.BAD_REQUEST, message=str(e))
    except Exception as e:  # noqa: BLE001 - raised on with the request it failed
        raise PrepareFailed(msg.req_id, type(e).__name__) from e
    return msg.model_copy(update=dict(prompt=None, messages=None, tools=None, enable_thinking=None, prefill="",
                                      tokens=tuple(tokens)))


def _prepare_in_worker(frame: bytes, prepare: Callable, context_length: int, max_prompt_bytes: int):
    return prepare_frame(_tokenizer, frame, prepare, context_length, max_prompt_bytes)


def _started() -> None:
    """The worker's first task: none (its initializer has loaded the tokenizer)."""


class Intake:
    def __init__(self, model_path: str, prepare: Callable, context_length: int, max_prompt_bytes: int):
        """prepare(tokenizer, Generate) -> tokens, raising INPUT_ERRORS for input it refuses; picklable (a
        module-level function), since the worker calls it."""
        self.model_path, self.prepare = model_path, prepare
        self.limits = (context_length, max_prompt_bytes)
        self.pool: ProcessPoolExecutor | None = None
        self.waiting: dict[tuple, deque[tuple[object | None, Future | None]]] = {}

    def start(self) -> None:
        """Start the worker now (in the background: the loop does not wait), so that the first big frame does not
        wait for it: spawning it and loading the tokenizer took 1.2 s unloaded, 2-4 s on a busy box (a soak's
        oversized requests after each restart). A worker that dies is replaced by the next big frame."""
        self._pool().submit(_started)

    def busy(self, peer) -> bool:
        return peer in self.waiting

    def pending(self) -> bool:
        return bool(self.waiting)

    def add(self, peer, msg=None, frame: bytes | None = None) -> None:
        """Queue a client's decoded message, or its big frame (to the worker now), behind its earlier ones."""
        fut = None
        if frame is not None:
            try:
                fut = self._pool().submit(_prepare_in_worker, frame, self.prepare, *self.limits)
            except BrokenProcessPool:  # the worker died since the last big frame: a new one
                self.close()
                fut = self._pool().submit(_prepare_in_worker, frame, self.prepare, *self.limits)
        self.waiting.setdefault(peer, deque()).append((msg, fut))

    def _pool(self) -> ProcessPoolExecutor:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_start_worker, initargs=(self.model_path, os.getpid()))
        return self.pool

    def ready(self, everything: bool = False) -> list[tuple[tuple, object | None, Future | None]]:
        """(peer, message or None, the worker's preparation or None) for each message whose turn has come, in each
        client's order (a frame's message is its preparation's result); everything: every waiting one, prepared or
        not (a stop refuses them)."""
        out = []
        for peer, items in list(self.waiting.items()):
            while items and (everything or items[0][1] is None or items[0][1].done()):
                msg, fut = items.popleft()
                if fut is not None and fut.done() and not fut.cancelled() and \
                        isinstance(fut.exception(), BrokenProcessPool):
                    self.close()  # the worker died (killed, out of memory): the next big frame starts a new one
                out.append((peer, msg, fut))
            if not items:
                del self.waiting[peer]
        return out

    def drop(self, peer) -> None:
        """A lost client's waiting messages (their preparation, if running, finishes unread)."""
        for _, fut in self.waiting.pop(peer, ()):
            if fut is not None:
                fut.cancel()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
