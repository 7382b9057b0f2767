"""Client library: talk to a running stratad over ZeroMQ.

    from stratad.client import Client
    with Client() as c:
        stream = c.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=64)
        for chunk in stream:
            print(chunk.text, end="", flush=True)
        print(stream.stats)

`AsyncClient` is the asyncio twin. Every request has its own DEALER socket, so streams are independent.
"""
from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator

import zmq
import zmq.asyncio

from protos import messages as M
from protos.codec import FrameError, decode, encode
from stratad.config import default_runtime_dir


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
    try:
        return M.Generate(req_id=req_id or uuid.uuid4().hex, prompt=prompt,
                          messages=None if messages is None else tuple(M.ChatMessage(**m) for m in messages),
                          tokens=None if tokens is None else tuple(tokens),
                          sampling=M.Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                              top_k=top_k, seed=seed, stop=tuple(stop), ignore_eos=ignore_eos),
                          digest=digest, tools=None if tools is None else tuple(tools),
                          enable_thinking=enable_thinking, prefill=prefill)
    except ValueError as e:
        raise RequestError(M.ErrorCode.BAD_REQUEST, str(e)) from None


class _Base:
    def __init__(self, runtime_dir: str | None = None, endpoint: str | None = None, timeout_s: float = 30.0,
                 stream_timeout_s: float | None = 600.0, curve_server_key: bytes | None = None,
                 curve_keypair: tuple[bytes, bytes] | None = None):
        self.runtime_dir = Path(runtime_dir or os.environ.get("STRATAD_RUNTIME_DIR") or default_runtime_dir())
        self.endpoint = endpoint or f"ipc://{self.runtime_dir / 'client.sock'}"
        self.timeout_s, self.stream_timeout_s = timeout_s, stream_timeout_s
        self.curve = (curve_server_key, curve_keypair) if curve_server_key else None

    def _check_endpoint(self) -> None:
        if self.endpoint.startswith("ipc://") and not Path(self.endpoint[6:]).exists():
            raise DaemonUnavailable(f"no stratad socket at {self.endpoint[6:]}: is the daemon running "
                                    f"(runtime dir {self.runtime_dir})?")

    def _setup(self, s: zmq.Socket) -> zmq.Socket:
        s.setsockopt(zmq.LINGER, 0)
        if self.curve:
            server_key, (public, secret) = self.curve
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_key, public, secret
        s.connect(self.endpoint)
        return s

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


class Stream(_StreamState):
    """Iterate for Chunks; then `.stats`, `.finish_reason`, `.text`. `cancel()` stops the request."""

    def __init__(self, client: "Client", msg: M.Generate):
        super().__init__(msg.req_id)
        self.client = client
        self.sock = client._setup(client.ctx.socket(zmq.DEALER))
        self.sock.send(encode(msg))

    def _recv(self):
        first = self.accepted is None
        t = self.client._timeout(first)
        if not self.sock.poll(None if t is None else int(t * 1000)):
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
        s = self._setup(self.ctx.socket(zmq.DEALER))
        try:
            s.send(encode(M.StatusRequest()))
            if not s.poll(int(self.timeout_s * 1000)):
                raise self._unavailable()
            msg = self._parse(s.recv())
        finally:
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


class AsyncStream(_StreamState):
    def __init__(self, client: "AsyncClient", msg: M.Generate):
        super().__init__(msg.req_id)
        self.client, self.msg = client, msg
        self.sock = client._setup(client.ctx.socket(zmq.DEALER))

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        await self.sock.send(encode(self.msg))
        try:
            while self.finish_reason is None:
                t = self.client._timeout(self.accepted is None)
                try:
                    frame = await asyncio.wait_for(self.sock.recv(), t)
                except asyncio.TimeoutError:
                    raise self.client._unavailable() from None
                if (chunk := self.apply(self.client._parse(frame))) is not None:
                    yield chunk
        finally:
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
        s = self._setup(self.ctx.socket(zmq.DEALER))
        try:
            await s.send(encode(M.StatusRequest()))
            try:
                frame = await asyncio.wait_for(s.recv(), self.timeout_s)
            except asyncio.TimeoutError:
                raise self._unavailable() from None
        finally:
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
