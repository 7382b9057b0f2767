"""A client's Generate turned into prompt tokens off the coordinator's loop, in the order the client sent it.

Rendering a chat template and tokenising a long text take seconds for megabytes (docs/perf-notes.md), and the
`tokenizers` encode holds the GIL throughout, so a thread would pause the loop as much: a long text
is prepared in a worker process instead (started once, with its own copy of the tokenizer), and its tokens come
back through `ready()`, polled every loop turn. Short texts (HEAVY_CHARS and under) are prepared in the loop. While one of a
client's requests is being prepared, that client's later messages wait behind it, so its order is kept.
"""
from __future__ import annotations

import multiprocessing
import signal
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from protos import messages as M

HEAVY_CHARS = 32 << 10  # a prompt (or the messages' text) longer than this is prepared in the worker

_tokenizer = None  # the worker process's own


def text_chars(g: M.Generate) -> int:
    if g.prompt is not None:
        return len(g.prompt)
    return sum(len(m.content) for m in g.messages or ())


def _start_worker(model_path: str) -> None:
    from stratad.model.tokenizer import Tokenizer

    global _tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the coordinator stops us
    _tokenizer = Tokenizer.from_file(model_path)


def _prepare_in_worker(frame: bytes, prepare: Callable) -> list[int]:
    return prepare(_tokenizer, M.Generate.model_validate_json(frame))


class Intake:
    def __init__(self, model_path: str, prepare: Callable):
        """prepare(tokenizer, Generate) -> tokens, raising ValueError for input it refuses; picklable (a
        module-level function), since the worker calls it too."""
        self.model_path, self.prepare = model_path, prepare
        self.pool: ProcessPoolExecutor | None = None
        self.waiting: dict[tuple, deque[tuple[M.Generate | object, Future | None]]] = {}

    def busy(self, peer) -> bool:
        return peer in self.waiting

    def pending(self) -> bool:
        return bool(self.waiting)

    def add(self, peer, msg, heavy: bool) -> None:
        """Queue a client's message behind its earlier ones; a heavy Generate starts preparing now."""
        fut = None
        if heavy:
            frame = msg.model_dump_json().encode()
            try:
                fut = self._pool().submit(_prepare_in_worker, frame, self.prepare)
            except BrokenProcessPool:  # the worker died since the last long text: a new one
                self.close()
                fut = self._pool().submit(_prepare_in_worker, frame, self.prepare)
        self.waiting.setdefault(peer, deque()).append((msg, fut))

    def _pool(self) -> ProcessPoolExecutor:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_start_worker, initargs=(self.model_path,))
        return self.pool

    def ready(self, everything: bool = False) -> list[tuple[tuple, object, Future | None]]:
        """(peer, message, its preparation or None) for each message whose turn has come, in each client's order;
        everything: every waiting message, prepared or not (a stop refuses them)."""
        out = []
        for peer, items in list(self.waiting.items()):
            while items and (everything or items[0][1] is None or items[0][1].done()):
                msg, fut = items.popleft()
                if fut is not None and fut.done() and isinstance(fut.exception(), BrokenProcessPool):
                    self.close()  # the worker died (killed, out of memory): the next long text starts a new one
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
