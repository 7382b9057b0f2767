"""The coordinator's client-facing sockets: sending never blocks the loop, whatever a client does.

A reply goes straight to the socket (non-blocking) while nothing waits for that client, else into the client's
own queue, bounded in messages and bytes and flushed every loop turn, so one client that stops reading costs only
its own queue. A client whose queue overflows is cut off: `on_lost` cancels its requests (their lanes are freed),
what it had queued is dropped, and one `client_too_slow` error waits for room in its pipe for CUT_OFF_TTL_S. All
queues together are bounded too (max_total_bytes): many clients that each stay under their own bound and stop
reading would add up without one; past it the clients with the largest queues are cut off the same way until the
total fits (a client that reads keeps its queue short: not the one cut). A client that disconnected (EHOSTUNREACH,
with ROUTER_MANDATORY) is lost the same way, without the error.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import zmq

from protos import messages as M
from protos.codec import encode

log = logging.getLogger("stratad.coordinator")

# libzmq's own pipe per client, in messages: kept small so that what waits is mostly in the accounted queue
SNDHWM = 64
# the kernel's buffer per connection: with the default (~200 KB on Linux) a stalled reader held ~2000 token chunks
# there before libzmq's pipe even filled
SNDBUF = 64 << 10
# frames up to this are read and refused with an error naming MAX_FRAME_BYTES; libzmq drops a peer announcing a
# bigger one before allocating it (a 512 MiB frame had been read whole: 1.12 GB RSS)
MAXMSGSIZE = 2 * M.MAX_FRAME_BYTES
# TCP: the kernel's keepalive finds a client whose host vanished (idle 10 s, then 3 probes 2 s apart) and libzmq
# drops it, freeing its lanes; local (ipc) peers are seen to go at once. Not ZMTP heartbeats: a client that stops
# reading cannot see them, so they would drop a live client, and libzmq 4.3 may then abort it (libzmq #3937).
KEEPALIVE_IDLE_S, KEEPALIVE_INTVL_S, KEEPALIVE_CNT = 10, 2, 3
CUT_OFF_TTL_S = 30.0  # how long a cut-off client's final error waits for room, and its messages are ignored
LOST_MAX = 4096  # cut-off / gone clients remembered (identities are not reused: each connection gets a new one)

Peer = tuple[zmq.Socket, bytes]


@dataclass
class _Queue:
    frames: deque = field(default_factory=deque)
    nbytes: int = 0
    final: bool = False  # only the cut-off error is left to deliver


class ClientIO:
    def __init__(self, ctx: zmq.Context, max_messages: int, max_bytes: int, max_total_bytes: int,
                 on_lost: Callable[[zmq.Socket, bytes, str], None]):
        self.ctx = ctx
        self.max_messages, self.max_bytes, self.max_total_bytes = max_messages, max_bytes, max_total_bytes
        self.total = 0  # bytes in every queue
        self.on_lost = on_lost  # (socket, client, why): cancel the client's requests
        self.socks: list[zmq.Socket] = []
        self.queues: dict[Peer, _Queue] = {}
        self.lost: OrderedDict[Peer, float] = OrderedDict()  # peer -> when it was cut off or found gone
        self.final_until: dict[Peer, float] = {}

    def socket(self, endpoint: str, curve: tuple[bytes, bytes] | None = None) -> zmq.Socket:
        """A bound ROUTER for clients; curve: (secret, public) key of a CURVE server."""
        s = self.ctx.socket(zmq.ROUTER)
        if curve:
            s.curve_secretkey, s.curve_publickey, s.curve_server = curve[0], curve[1], True
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EHOSTUNREACH for a gone client, EAGAIN for a full pipe
        s.setsockopt(zmq.LINGER, 0)  # a stop never waits for a client to read
        s.setsockopt(zmq.SNDHWM, SNDHWM)
        s.setsockopt(zmq.SNDBUF, SNDBUF)
        s.setsockopt(zmq.MAXMSGSIZE, MAXMSGSIZE)
        s.setsockopt(zmq.TCP_KEEPALIVE, 1)
        s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
        s.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
        s.bind(endpoint)
        self.socks.append(s)
        return s

    def is_lost(self, sock: zmq.Socket, client: bytes) -> bool:
        return (sock, client) in self.lost

    def pending(self) -> bool:
        return bool(self.queues)

    def send(self, sock: zmq.Socket, client: bytes, msg) -> bool:
        """Queue or send one message; False when the client is gone or cut off (it will not get it)."""
        return self.send_frame(sock, client, encode(msg))

    def send_frame(self, sock: zmq.Socket, client: bytes, frame: bytes) -> bool:
        """send() of an encoded message (a lane's token chunk, relayed as it came)."""
        peer = (sock, client)
        if peer in self.lost:
            return False
        q = self.queues.get(peer)
        if q is None:
            try:
                sock.send_multipart([client, frame], zmq.NOBLOCK)
                return True
            except zmq.Again:
                q = self.queues[peer] = _Queue()
            except zmq.ZMQError:
                self._lose(peer, "gone")
                return False
        q.frames.append(frame)
        q.nbytes += len(frame)
        self.total += len(frame)
        if len(q.frames) > self.max_messages or q.nbytes > self.max_bytes:
            self._cut_off(peer, q, f"{len(q.frames)} messages waiting (limit {self.max_messages})"
                          if len(q.frames) > self.max_messages else f"{q.nbytes} bytes waiting (limit {self.max_bytes})")
            return False
        if self.total > self.max_total_bytes:
            self._cut_largest()
            return peer not in self.lost
        return True

    def flush(self) -> None:
        """Move what waits into the clients' pipes as far as they have room; expire undelivered final errors."""
        now = time.monotonic()
        for peer, q in list(self.queues.items()):
            sock, client = peer
            try:
                while q.frames:
                    sock.send_multipart([client, q.frames[0]], zmq.NOBLOCK)
                    n = len(q.frames.popleft())
                    q.nbytes -= n
                    self.total -= n
            except zmq.Again:
                if q.final and now > self.final_until.get(peer, 0.0):
                    self._drop(peer)
                continue
            except zmq.ZMQError:
                self._drop(peer)
                if not q.final:
                    self._lose(peer, "gone")
                continue
            self._drop(peer)
        while self.lost and (len(self.lost) > LOST_MAX or next(iter(self.lost.values())) < now - CUT_OFF_TTL_S):
            self.lost.popitem(last=False)

    def _drop(self, peer: Peer) -> None:
        q = self.queues.pop(peer, None)
        if q is not None:
            self.total -= q.nbytes
        self.final_until.pop(peer, None)

    def _lose(self, peer: Peer, why: str) -> None:
        self.lost[peer] = time.monotonic()
        self.on_lost(peer[0], peer[1], why)

    def _cut_largest(self) -> None:
        """The clients with the most bytes waiting, cut off until every queue together fits max_total_bytes."""
        total = self.total
        for peer, q in sorted(self.queues.items(), key=lambda pq: -pq[1].nbytes):
            if self.total <= self.max_total_bytes:
                return
            if q.final:  # already cut: only its error waits
                continue
            self._cut_off(peer, q, f"{q.nbytes} bytes waiting, the most of all clients, whose queues held {total} "
                                   f"bytes together (limit {self.max_total_bytes})")

    def _cut_off(self, peer: Peer, q: _Queue, limit: str) -> None:
        log.warning("client %s stopped reading its replies (%s): cut off, its requests cancelled", peer[1].hex(),
                    limit)
        err = encode(M.Error(code=M.ErrorCode.CLIENT_TOO_SLOW,
                             message=f"this client did not read its replies: {limit}; its requests were cancelled"))
        self.total += len(err) - q.nbytes
        q.frames, q.nbytes, q.final = deque([err]), len(err), True
        self.final_until[peer] = time.monotonic() + CUT_OFF_TTL_S
        self._lose(peer, "too_slow")

    def close(self) -> None:
        """One last non-blocking pass over what waits (a stop's errors); then the sockets go, without lingering."""
        self.flush()
        for s in self.socks:
            s.close(linger=0)
        self.socks.clear()
