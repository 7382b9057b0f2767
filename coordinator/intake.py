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

import ctypes
import multiprocessing
import os
import signal
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from pydantic_core import to_json

from protos import messages as M
from protos.codec import FrameError, decode
from stratad.model.chat_template import ChatTemplateError

HEAVY_BYTES = 32 << 10  # a client frame longer than this is decoded and prepared in the worker
# A token stands for at most the vocabulary's longest token's bytes, so a text longer than context x that cannot
# fit; x4 leaves room for normalisation (NFC) composing characters. A chat template writes at least one token for
# each message (its role's marker): a message counts as one token's share of the limit besides its text, and more
# messages than the context holds are refused by their count alone.
PROMPT_BYTES_SLACK = 4

_tokenizer = None  # the worker process's own


class PromptError(ValueError):
    """A request's prompt that cannot be served as given (token ids outside the vocabulary): bad_request."""


INPUT_ERRORS = (ChatTemplateError, PromptError)  # the client's input, not a fault of ours: bad_request


class PrepareFailed(Exception):
    """An unexpected failure preparing a request in the worker (a fault of ours): the request and the cause's
    type; the cause's traceback comes along (concurrent.futures' remote traceback)."""

    def __init__(self, req_id: str | None, cause: str):
        super().__init__(req_id, cause)
        self.req_id, self.cause = req_id, cause


def _utf8(s: str | None) -> int:
    return len(s.encode("utf-8", "surrogatepass")) if s else 0


def _json(value) -> int:
    """Bytes of value as compact JSON (pydantic-core: no Python walk over a big structure)."""
    return len(to_json(value, fallback=str))


def input_bytes(g: M.Generate) -> int:
    """The UTF-8 bytes of every field of g that a chat template renders: the prompt; each message's role, content,
    name, tool call id, reasoning and tool calls (id, name, arguments); the tools; the prefill. JSON data (tools,
    arguments) counts as compact JSON: templates render it with tojson, which writes that and spaces. Token ids
    count 0 (they are counted as tokens); no per-message overhead (size_refusal adds it)."""
    if g.prompt is not None:
        return _utf8(g.prompt)
    n = _utf8(g.prefill)
    for t in g.tools or ():
        n += len(t.model_dump_json(exclude_none=True))
    for m in g.messages or ():
        n += _utf8(m.role) + _utf8(m.content) + _utf8(m.name) + _utf8(m.tool_call_id) + _utf8(m.reasoning_content)
        for c in m.tool_calls or ():
            n += _utf8(c.id) + _utf8(c.function.name) + _json(c.function.arguments)
    return n


def size_refusal(g: M.Generate, context_length: int, max_prompt_bytes: int) -> tuple[M.ErrorCode, str] | None:
    """Why g cannot fit the context, from its sizes alone (nothing rendered or tokenised); None if it may.
    max_prompt_bytes: PROMPT_BYTES_SLACK x the longest token's bytes x context_length."""
    n, ctx = g.sampling.max_tokens, context_length
    if n >= ctx:
        return M.ErrorCode.BAD_REQUEST, f"max_tokens {n} exceeds what the context length {ctx} can hold beside a " \
                                        f"prompt (at most {ctx - 1})"
    if g.tokens is not None:
        if len(g.tokens) + n > ctx:
            return M.ErrorCode.PROMPT_TOO_LONG, f"prompt of {len(g.tokens)} tokens + max_tokens {n} exceeds the " \
                                                f"context length {ctx}"
        return None
    n_msgs = len(g.messages or ())
    if n_msgs + n > ctx:
        return M.ErrorCode.PROMPT_TOO_LONG, f"{n_msgs} messages + max_tokens {n} exceed the context length {ctx} " \
                                            f"(a chat template writes at least one token a message)"
    per_token = max_prompt_bytes // ctx
    size = input_bytes(g) + per_token * n_msgs
    if size > max_prompt_bytes:
        return M.ErrorCode.PROMPT_TOO_LONG, f"prompt of {size} bytes exceeds the limit of {max_prompt_bytes} " \
            f"bytes (the context length {ctx} x {per_token} bytes, {PROMPT_BYTES_SLACK}x the longest token's; " \
            f"counted: the text of every field the template renders" + \
            (f", {per_token} bytes a message)" if n_msgs else ")")
    return None


def _start_worker(model_path: str, coordinator_pid: int) -> None:
    from stratad.model.tokenizer import Tokenizer

    global _tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the coordinator stops us
    _die_with(coordinator_pid)
    _tokenizer = Tokenizer.from_file(model_path)


def _die_with(coordinator_pid: int) -> None:
    """Linux: SIGTERM when the coordinator dies (a SIGKILLed one had left this worker, and multiprocessing's
    resource tracker with its semaphores in /dev/shm, running for good)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != coordinator_pid:  # it died before the line above
        os._exit(0)


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


class Intake:
    def __init__(self, model_path: str, prepare: Callable, context_length: int, max_prompt_bytes: int):
        """prepare(tokenizer, Generate) -> tokens, raising INPUT_ERRORS for input it refuses; picklable (a
        module-level function), since the worker calls it."""
        self.model_path, self.prepare = model_path, prepare
        self.limits = (context_length, max_prompt_bytes)
        self.pool: ProcessPoolExecutor | None = None
        self.waiting: dict[tuple, deque[tuple[object | None, Future | None]]] = {}

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
