"""The client's wait beside its connection monitor (stratad.client._Watch), on real ZeroMQ sockets: a drop the
monitor reports while messages are still queued must not be forgotten. The monitor tells of a drop once
(DISCONNECTED, then CLOSED as the socket file closes); read while the last messages were in flight, the stream once
read those and then took CLOSED for a connection never made ("connection refused" instead of "went away"), or,
with both events read so, waited out its stream timeout (up to 10 minutes) for a daemon that had died
(test_faults' coordinator kill failed so once, under load)."""
from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from stratad.client import _await, _wait, _Watch


def _connected(ctx, tmp_path):
    """A ROUTER, and a DEALER of ctx connected to it with its connection monitor."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    addr = f"ipc://{tmp_path}/s"
    router.bind(addr)
    dealer = ctx.socket(zmq.DEALER)
    monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
    dealer.connect(addr)
    return router, dealer, monitor


def _serve_two_and_close(router):
    """Answer the DEALER's first message with two, then close: the drop follows them."""
    ident, _ = router.recv_multipart()
    router.send_multipart([ident, b"one"])
    router.send_multipart([ident, b"two"])
    router.close(linger=1000)


def _monitor_first(base):
    """A poller that, the first time, reports the monitor alone: the order in which the drop and the last messages
    can meet a wait (the race, made certain)."""
    class MonitorFirst(base):
        def __init__(self, monitor):
            super().__init__()
            self.monitor, self.first = monitor, True

        def only_monitor(self, ready):
            if self.first:
                self.first = False
                return [(s, e) for s, e in ready if s is self.monitor]
            return ready
    return MonitorFirst


def test_a_drop_seen_before_the_last_messages_raises_after_them(tmp_path):
    ctx = zmq.Context()
    try:
        router, dealer, monitor = _connected(ctx, tmp_path)
        dealer.send(b"hello")
        _serve_two_and_close(router)
        assert monitor.poll(5000) and dealer.poll(5000)

        class Poller(_monitor_first(zmq.Poller)):
            def poll(self, timeout=None):
                return self.only_monitor(super().poll(timeout))

        w = _Watch(dealer, monitor, Poller(monitor))
        got = []
        for _ in range(2):
            assert _wait(w, 5.0)
            got.append(dealer.recv())
        assert got == [b"one", b"two"]
        t0 = time.monotonic()
        with pytest.raises(ConnectionError) as e:
            _wait(w, 5.0)
        assert time.monotonic() - t0 < 1.0  # at once, not after the timeout
        assert not isinstance(e.value, ConnectionRefusedError)  # the drop, not a connection never made
    finally:
        ctx.destroy(linger=0)


def test_the_async_wait_likewise(tmp_path):
    async def go():
        ctx = zmq.asyncio.Context()
        try:
            router, dealer, monitor = _connected(ctx, tmp_path)
            await dealer.send(b"hello")
            await asyncio.get_running_loop().run_in_executor(None, _serve_two_and_close, router)
            assert await monitor.poll(5000) and await dealer.poll(5000)

            class Poller(_monitor_first(zmq.asyncio.Poller)):
                async def poll(self, timeout=None):
                    return self.only_monitor(await super().poll(timeout))

            w = _Watch(dealer, monitor, Poller(monitor))
            got = [await _await(w, 5.0), await _await(w, 5.0)]
            assert got == [b"one", b"two"]
            t0 = time.monotonic()
            with pytest.raises(ConnectionError) as e:
                await _await(w, 5.0)
            assert time.monotonic() - t0 < 1.0
            assert not isinstance(e.value, ConnectionRefusedError)
        finally:
            ctx.destroy(linger=0)
    asyncio.run(go())
