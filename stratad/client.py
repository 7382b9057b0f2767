"""Client library: talk to a running stratad over ZeroMQ.

    from stratad.client import Client
    with Client() as c:
        stream = c.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=64)
        for chunk in stream:
            print(chunk.text, end="", flush=True)
        print(stream.stats)

`AsyncClient` is the asyncio twin. Every request has its own DEALER socket, so streams are independent.

Liveness: each socket watches its own connection (a socket monitor) and never reconnects (a new connection could
not continue the request): a daemon that dies closes the connection and every open stream raises DaemonUnavailable
at once (ipc); over TCP the kernel's keepalive finds a vanished host in about KEEPALIVE_*'s 5 s. Not ZMTP
heartbeats: a client that stops reading its stream cannot see them, so they drop its connection, and libzmq 4.3
then may abort the process (libzmq #3937; it happened here with a receive HWM of 1). A daemon alive but stuck is
the stream timeout's case.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator

import zmq
import zmq.asyncio
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError
from zmq.utils.monitor import parse_monitor_message

from protos import messages as M
from protos.codec import FrameError, decode, encode
from stratad import discovery
from stratad.config import default_runtime_dir


KEEPALIVE_IDLE_S, KEEPALIVE_INTVL_S, KEEPALIVE_CNT = 2, 1, 3  # TCP: a host silent 2 s, then 3 probes 1 s apart


class DaemonUnavailable(ConnectionError):
    pass


class RequestError(RuntimeError):
    def __init__(self, code: M.ErrorCode, message: str, req_id: str | None = None):
        self.code, self.message, self.req_id = code, message, req_id
        super().__init__(f"{code.value}: {message}")


@dataclass(frozen=True)
class Chunk:
    text: str
    tokens: tuple[int, ...]


def _generate_msg(req_id, prompt, messages, tokens, max_tokens, temperature, top_p, top_k, seed, stop,
                  digest=False, ignore_eos=False, tools=None, enable_thinking=None, prefill="") -> M.Generate:
    """The Generate message for generate()'s arguments; RequestError(bad_request) naming the argument at fault."""
    try:
        msg = M.Generate.model_validate(dict(
            req_id=req_id or uuid.uuid4().hex, prompt=prompt, messages=messages, tokens=tokens, digest=digest,
            sampling=dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop=stop, ignore_eos=ignore_eos),
            tools=tools, enable_thinking=enable_thinking, prefill=prefill))
        frame = encode(msg)
    except ValidationError as e:
        raise RequestError(M.ErrorCode.BAD_REQUEST, _first_problem(e)) from None
    except PydanticSerializationError:  # a str Python holds but UTF-8 cannot: a lone surrogate
        raise RequestError(M.ErrorCode.BAD_REQUEST, _unencodable(msg)) from None
    if len(frame) > M.MAX_FRAME_BYTES:
        raise RequestError(M.ErrorCode.PROMPT_TOO_LONG, f"the request is {len(frame)} bytes, over the daemon's limit "
                                                        f"of {M.MAX_FRAME_BYTES} bytes a message")
    return msg


def _first_problem(e: ValidationError) -> str:
    """One line naming the argument (sampling's fields by their generate() names) and what is wrong with it."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"]]
    where = ".".join(loc[1:] if loc[:1] == ["sampling"] else loc)
    problem = err["msg"].removeprefix("Value error, ").replace("a valid tuple", "a list").replace("Tuple", "List")
    problem = problem.replace(" after validation,", ",")
    return f"{where}: {problem}" if where else problem


def _unencodable(msg: M.Generate) -> str:
    def walk(v, path):
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"{path}: not valid Unicode text (a lone surrogate at character {e.start})"
        elif isinstance(v, dict):
            return next((w for k, x in v.items() if (w := walk(x, f"{path}.{k}" if path else k))), None)
        elif isinstance(v, (list, tuple)):
            return next((w for i, x in enumerate(v) if (w := walk(x, f"{path}.{i}"))), None)
        return None

    return walk(msg.model_dump(), "") or "the request is not valid Unicode text"


class _Base:
    def __init__(self, runtime_dir: str | None = None, endpoint: str | None = None, timeout_s: float = 30.0,
                 stream_timeout_s: float | None = 600.0, curve_server_key: bytes | None = None,
                 curve_keypair: tuple[bytes, bytes] | None = None):
        # the daemon's runtime dir: the one given, STRATAD_RUNTIME_DIR, the default, else the one running daemon
        # this user registered (stratad/discovery.py: stratactl finds daemons the same way)
        self.found = discovery.lookup(runtime_dir) if endpoint is None else None
        self.runtime_dir = (self.found.path if self.found and self.found.path else
                            Path(runtime_dir or default_runtime_dir()))
        self.endpoint = endpoint or f"ipc://{self.runtime_dir / 'client.sock'}"
        self.timeout_s, self.stream_timeout_s = timeout_s, stream_timeout_s
        self.curve = (curve_server_key, curve_keypair) if curve_server_key else None

    def _check_endpoint(self) -> None:
        if self.endpoint.startswith("ipc://") and not Path(self.endpoint[6:]).exists():
            if self.found is not None and self.found.path is None:
                raise DaemonUnavailable(self.found.message())
            raise DaemonUnavailable(f"no stratad socket at {self.endpoint[6:]}: is the daemon running "
                                    f"(runtime dir {self.runtime_dir})?")

    def _setup(self, s: zmq.Socket) -> zmq.Socket:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, -1)
        s.setsockopt(zmq.TCP_KEEPALIVE, 1)
        s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
        s.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
        if self.curve:
            server_key, (public, secret) = self.curve
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_key, public, secret
        s.connect(self.endpoint)
        return s

    def _watch(self, s: zmq.Socket) -> zmq.Socket:
        """The monitor of s's connection (before connecting, so no event is missed)."""
        return s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)

    def _gone(self, req_id: str | None, e: ConnectionError) -> DaemonUnavailable:
        if isinstance(e, ConnectionRefusedError):  # closed without ever connecting (no reconnection: see above)
            return DaemonUnavailable(f"no stratad listens at {self.endpoint} (connection refused): is the daemon "
                                     f"running (runtime dir {self.runtime_dir})?")
        what = f"during request {req_id}" if req_id else "before answering"
        return DaemonUnavailable(f"stratad at {self.endpoint} went away {what} (connection lost)")

    def _timeout(self, first: bool) -> float | None:
        return self.timeout_s if first else self.stream_timeout_s

    def _unavailable(self) -> DaemonUnavailable:
        return DaemonUnavailable(f"stratad at {self.endpoint} did not answer within {self.timeout_s:g} s")

    @staticmethod
    def _parse(frame: bytes):
        try:
            return decode(frame, M.CoordinatorToClient)
        except FrameError as e:
            raise RequestError(e.code, f"bad reply from the daemon: {e}") from None


class _StreamState:
    """What a stream has received so far; `apply` turns one reply into a Chunk (or None) or raises its error."""

    def __init__(self, req_id: str):
        self.req_id = req_id
        self.accepted: M.Accepted | None = None
        self.stats: M.RequestStats | None = None
        self.finish_reason: str | None = None
        self.text = ""
        self.tokens: list[int] = []

    def apply(self, msg) -> Chunk | None:
        if isinstance(msg, M.Accepted):
            self.accepted = msg
        elif isinstance(msg, M.TokenChunk):
            self.text += msg.text
            self.tokens += msg.tokens
            return Chunk(msg.text, msg.tokens)
        elif isinstance(msg, M.Done):
            self.stats, self.finish_reason = msg.stats, msg.finish_reason
        elif isinstance(msg, M.Error):
            raise RequestError(msg.code, msg.message, msg.req_id)
        return None


class _Watch:
    """A request's socket beside its connection monitor, for the socket's life, shared by _wait and _await: each
    wait's timeout, what a monitor event means, and a drop already seen (`gone`). The monitor tells of a drop once:
    seen while messages were still queued (they arrived before it), the messages are read first and the next wait
    with none left raises at once (forgotten, a stream would wait out its stream timeout for a dead daemon)."""

    def __init__(self, sock, monitor, poller):
        self.sock, self.monitor, self.poller = sock, monitor, poller
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self.deadline: float | None = None
        self.gone: Exception | None = None

    def start(self, timeout_s: float | None) -> None:
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def left_ms(self) -> int | None:
        return None if self.deadline is None else max(0, int((self.deadline - time.monotonic()) * 1000))

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    @staticmethod
    def dropped(frames) -> Exception:
        """The error for a monitor event: the connection dropped, or it closed without ever connecting."""
        event = parse_monitor_message(frames)["event"]
        return ConnectionError() if event == zmq.EVENT_DISCONNECTED else ConnectionRefusedError()


def _wait(w: _Watch, timeout_s: float | None) -> bool:
    """Until w's socket has a message (True) or timeout_s passes (False); raises ConnectionError when the connection
    has dropped and no message is left (those that arrived before the drop are still read), ConnectionRefusedError
    when it closed without ever connecting (a socket file nobody listens at)."""
    w.start(timeout_s)
    while True:
        if w.gone is not None:
            if w.sock.poll(0):
                return True
            raise w.gone
        ready = dict(w.poller.poll(w.left_ms()))
        if w.sock in ready:
            return True
        if w.monitor in ready:
            w.gone = w.dropped(w.monitor.recv_multipart())
        elif w.expired():
            return False


class Stream(_StreamState):
    """Iterate for Chunks; then `.stats`, `.finish_reason`, `.text`. `cancel()` stops the request."""

    def __init__(self, client: "Client", msg: M.Generate):
        super().__init__(msg.req_id)
        self.client = client
        sock = client.ctx.socket(zmq.DEALER)
        self.monitor = client._watch(sock)
        self.sock = client._setup(sock)
        self.watch = _Watch(self.sock, self.monitor, zmq.Poller())
        self.sock.send(encode(msg))

    def _recv(self):
        first = self.accepted is None
        t = self.client._timeout(first)
        try:
            arrived = _wait(self.watch, t)
        except ConnectionError as e:
            self.close()
            raise self.client._gone(self.req_id, e) from None
        if not arrived:
            self.close()
            if first:
                raise self.client._unavailable()
            raise DaemonUnavailable(f"stratad went silent for {t:g} s during request {self.req_id}")
        return self.client._parse(self.sock.recv())

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while self.finish_reason is None:
                if (chunk := self.apply(self._recv())) is not None:
                    yield chunk
        finally:
            if self.finish_reason is not None:
                self.close()

    def wait_accepted(self) -> M.Accepted:
        """Block until the daemon has accepted (queued or started) the request; raises its error if refused."""
        while self.accepted is None:
            self.apply(self._recv())
        return self.accepted

    def cancel(self) -> None:
        if not self.sock.closed:
            self.sock.send(encode(M.Cancel(req_id=self.req_id)))

    def result(self) -> str:
        for _ in self:
            pass
        return self.text

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=0)


class Client(_Base):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.ctx = zmq.Context()

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 tokens: list[int] | None = None, max_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop: tuple[str, ...] | list[str] = (),
                 req_id: str | None = None, digest: bool = False, ignore_eos: bool = False,
                 tools: list[dict] | None = None, enable_thinking: bool | None = None, prefill: str = "") -> Stream:
        """digest: the final stats carry a sha256 of every step's logits (to compare runs bit for bit).
        ignore_eos: generate max_tokens tokens whatever the model's stop tokens say (stop strings still apply).
        With messages: tools (OpenAI-style {"type": "function", "function": {...}}) and enable_thinking go to the
        chat template; prefill is text the reply starts with (rendered after the generation prompt)."""
        msg = _generate_msg(req_id, prompt, messages, tokens, max_tokens, temperature, top_p, top_k, seed, stop,
                            digest, ignore_eos, tools, enable_thinking, prefill)
        self._check_endpoint()
        return Stream(self, msg)

    def status(self) -> M.Status:
        self._check_endpoint()
        s = self.ctx.socket(zmq.DEALER)
        monitor = self._watch(s)
        self._setup(s)
        try:
            s.send(encode(M.StatusRequest()))
            try:
                if not _wait(_Watch(s, monitor, zmq.Poller()), self.timeout_s):
                    raise self._unavailable()
            except ConnectionError as e:
                raise self._gone(None, e) from None
            msg = self._parse(s.recv())
        finally:
            s.disable_monitor()
            monitor.close(linger=0)
            s.close(linger=0)
        if isinstance(msg, M.Error):
            raise RequestError(msg.code, msg.message)
        return msg

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


async def _await(w: _Watch, timeout_s: float | None) -> bytes | None:
    """_wait's asyncio twin: the socket's next message, or None after timeout_s; ConnectionError when the
    connection has dropped and no message is left."""
    w.start(timeout_s)
    while True:
        if w.gone is not None:
            if await w.sock.poll(0):
                return await w.sock.recv()
            raise w.gone
        ready = dict(await w.poller.poll(w.left_ms()))
        if w.sock in ready:
            return await w.sock.recv()
        if w.monitor in ready:
            w.gone = w.dropped(await w.monitor.recv_multipart())
        elif w.expired():
            return None


class AsyncStream(_StreamState):
    def __init__(self, client: "AsyncClient", msg: M.Generate):
        super().__init__(msg.req_id)
        self.client, self.msg = client, msg
        sock = client.ctx.socket(zmq.DEALER)
        self.monitor = client._watch(sock)
        self.sock = client._setup(sock)
        self.watch = _Watch(self.sock, self.monitor, zmq.asyncio.Poller())

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        await self.sock.send(encode(self.msg))
        try:
            while self.finish_reason is None:
                t = self.client._timeout(self.accepted is None)
                try:
                    frame = await _await(self.watch, t)
                except ConnectionError as e:
                    raise self.client._gone(self.req_id, e) from None
                if frame is None:
                    raise self.client._unavailable()
                if (chunk := self.apply(self.client._parse(frame))) is not None:
                    yield chunk
        finally:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=0)

    async def cancel(self) -> None:
        if not self.sock.closed:
            await self.sock.send(encode(M.Cancel(req_id=self.req_id)))


class AsyncClient(_Base):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.ctx = zmq.asyncio.Context()

    def generate(self, prompt: str | None = None, **kw) -> AsyncStream:
        args = dict(messages=None, tokens=None, max_tokens=128, temperature=0.0, top_p=1.0, top_k=0, seed=0,
                    stop=(), req_id=None, digest=False, ignore_eos=False, tools=None, enable_thinking=None,
                    prefill="") | kw
        msg = _generate_msg(args.pop("req_id"), prompt, **args)
        self._check_endpoint()
        return AsyncStream(self, msg)

    async def status(self) -> M.Status:
        self._check_endpoint()
        s = self.ctx.socket(zmq.DEALER)
        monitor = self._watch(s)
        self._setup(s)
        try:
            await s.send(encode(M.StatusRequest()))
            try:
                frame = await _await(_Watch(s, monitor, zmq.asyncio.Poller()), self.timeout_s)
            except ConnectionError as e:
                raise self._gone(None, e) from None
            if frame is None:
                raise self._unavailable()
        finally:
            s.disable_monitor()
            monitor.close(linger=0)
            s.close(linger=0)
        msg = self._parse(frame)
        if isinstance(msg, M.Error):
            raise RequestError(msg.code, msg.message)
        return msg

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()
