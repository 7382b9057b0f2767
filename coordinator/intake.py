"""A client's big request turned into prompt tokens off the coordinator's loop, in the order the client sent it.

Everything done with a request's frame scales with it: decoding it (pydantic-core builds a Python object for each
value: 150,000 empty messages take 0.4 s), rendering its chat template and tokenising the result (seconds for
megabytes), and all of it holds the GIL, so a thread would pause the loop as much. A frame over HEAVY_BYTES goes
whole to a worker process (stratad/intake_worker.py: started with the daemon, with its own copy of the tokenizer),
which decodes it, refuses it by its size before rendering anything (`size_refusal`), renders and tokenises it, and
sends back the request with its prompt as token ids, or the error to answer; the loop polls `ready()` every turn. A
smaller frame (at most ~1,100 messages or 32 KB of text: milliseconds) is handled in the loop. While one of a client's
frames is in the worker, that client's later messages wait behind it, so its order is kept. At most MAX_WAITING big
frames (of all clients) are in the worker or wait for it; one more is answered queue_full, in its client's order,
undecoded (its req_id read off the frame's head). A client's small messages waiting behind its big frames are bounded
too (BEHIND_COUNT messages, BEHIND_BYTES of frames): one more is answered queue_full at once, with its req_id (the
client library reads each request's answers on a socket of its own, so answering it before the messages ahead of it
loses no order that a client sees).
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Callable

from protos import messages as M
from protos.codec import FrameError, decode, req_id_of
from stratad.intake_worker import MAX_WAITING, PrepareFailed, WorkerPool
from stratad.prompts import HEAVY_BYTES, INPUT_ERRORS, size_refusal

__all__ = ["BEHIND_BYTES", "BEHIND_COUNT", "Intake", "MAX_WAITING", "PrepareFailed", "prepare_frame"]

# a client's decoded small messages held behind its big frames: a decoded message takes several times its frame's
# bytes, and a stream of tiny frames costs a Python object each, so both are bounded
BEHIND_COUNT = 1024
BEHIND_BYTES = 4 << 20


def _load_tokenizer(model_path: str):
    from stratad.model.tokenizer import Tokenizer

    return Tokenizer.from_file(model_path)


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


def _refused(in_worker: int, req_id: str | None) -> Future:
    """A big frame over the cap, answered queue_full in its client's order (through ready(), as the worker's answer
    would be), with the req_id its head shows (codec.req_id_of: the frame is not decoded, the work refused)."""
    fut = Future()
    fut.set_result(M.Error(req_id=req_id, code=M.ErrorCode.QUEUE_FULL, message=(
        f"{in_worker} large requests (over {HEAVY_BYTES} bytes) are being prepared; send it again later")))
    return fut


class Intake:
    def __init__(self, model_path: str, prepare: Callable, context_length: int, max_prompt_bytes: int):
        """prepare(tokenizer, Generate) -> tokens, raising INPUT_ERRORS for input it refuses; picklable (a
        module-level function), since the worker calls it."""
        self.prepare = prepare
        self.limits = (context_length, max_prompt_bytes)
        self.workers = WorkerPool(_load_tokenizer, model_path)
        self.waiting: dict[tuple, deque[tuple[object | None, Future | None, int]]] = {}
        self.behind: dict[tuple, int] = {}  # frame bytes of each client's small messages in waiting
        self.in_worker: set[Future] = set()  # big frames sent to the worker whose answer the loop has not taken

    def start(self) -> None:
        """Start the worker now (in the background: the loop does not wait), so that the first big frame does not
        wait for its spawn and tokenizer (stratad/intake_worker.py)."""
        self.workers.start()

    def busy(self, peer) -> bool:
        return peer in self.waiting

    def pending(self) -> bool:
        return bool(self.waiting)

    def add(self, peer, msg=None, frame: bytes | None = None, size: int = 0) -> bool:
        """Queue a client's decoded message (its frame size bytes), or its big frame (to the worker now), behind its
        earlier ones. Past MAX_WAITING big frames in the worker or waiting for it (any clients'), a frame is not sent:
        its turn answers queue_full (M.Error, the req_id its head shows), so that the frames held, each up to 8 MiB,
        stay bounded. A small message past its client's BEHIND_COUNT / BEHIND_BYTES is not queued: False (the caller
        refuses it, queue_full)."""
        fut = None
        if frame is not None:
            if len(self.in_worker) >= MAX_WAITING:
                fut = _refused(len(self.in_worker), req_id_of(frame))
            else:
                fut = self.workers.submit(prepare_frame, frame, self.prepare, *self.limits)
                fut.req_id = req_id_of(frame)  # for an answer while it is still in the worker (a stop)
                self.in_worker.add(fut)
        else:
            held = self.behind.get(peer, 0)
            if len(self.waiting.get(peer, ())) >= BEHIND_COUNT or held + size > BEHIND_BYTES:
                return False
            self.behind[peer] = held + size
        self.waiting.setdefault(peer, deque()).append((msg, fut, size))
        return True

    def ready(self, everything: bool = False) -> list[tuple[tuple, object | None, Future | None]]:
        """(peer, message or None, the worker's preparation or None) for each message whose turn has come, in each
        client's order (a frame's message is its preparation's result); everything: every waiting one, prepared or
        not (a stop refuses them). A preparation that failed because the worker died (BrokenProcessPool) has a new
        worker started (once, however many of the dead one's frames say so)."""
        out = []
        for peer, items in list(self.waiting.items()):
            while items and (everything or items[0][1] is None or items[0][1].done()):
                msg, fut, size = items.popleft()
                if fut is not None:
                    self.in_worker.discard(fut)
                    self.workers.broken(fut)
                if size:
                    self.behind[peer] -= size
                out.append((peer, msg, fut))
            if not items:
                del self.waiting[peer]
                self.behind.pop(peer, None)
        return out

    def drop(self, peer) -> None:
        """A lost client's waiting messages (their preparation, if running, finishes unread)."""
        self.behind.pop(peer, None)
        for _, fut, _ in self.waiting.pop(peer, ()):
            if fut is not None:
                self.in_worker.discard(fut)
                fut.cancel()

    def close(self) -> None:
        self.workers.close()
