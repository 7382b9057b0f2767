"""The bound on every client's send queue together (client_queue_total_bytes) against the real daemon (two CPU cards,
tiny model): many clients that stop reading, each under its own bound, are cut off by the total; the coordinator's
memory stays bounded and a client that reads streams on without a pause."""
from __future__ import annotations

import threading
import time

import zmq

from daemon_harness import MAX_GAP_S, Daemon, Gaps, RssPeak, greedy, raw_socket
from protos import messages as M
from protos.codec import decode, encode

BUDGET = 1 << 20
N_CLIENTS, N_REQUESTS = 24, 1500  # status replies of ~1.35 KB: ~48 MB waiting without the total bound


def test_clients_that_stop_reading_are_cut_by_the_total_and_a_reader_streams_on(tiny_model_path, tmp_path):
    cfg = tmp_path / "c.toml"  # each client's own bound out of reach: only the total can cut them
    cfg.write_text(f"client_queue_messages = 100000\nclient_queue_bytes = {64 << 20}\n"
                   f"client_queue_total_bytes = {BUDGET}\n")
    d = Daemon(tiny_model_path, tmp_path / "run", config=cfg).start()
    socks = []
    try:
        reference = greedy(d)

        def flood(s: zmq.Socket):
            status = encode(M.StatusRequest())
            for _ in range(N_REQUESTS):
                s.send(status)

        def cut() -> int:
            return d.log_text().count("the most of all clients")

        with RssPeak(d) as rss:
            socks = [raw_socket(d, rcvhwm=1, rcvbuf=4096) for _ in range(N_CLIENTS)]
            floods = [threading.Thread(target=flood, args=(s,)) for _, s in socks]
            t_check, done_at = 0.0, None
            deadline = time.monotonic() + 60
            with Gaps() as gaps, d.client(stream_timeout_s=30) as c:
                stream = c.generate(prompt="Tell me everything about the cards.", max_tokens=6000, ignore_eos=True)
                for _ in stream:
                    gaps.tick()
                    if gaps.n == 5:
                        for t in floods:
                            t.start()
                    if done_at is None and gaps.n > 5 and time.monotonic() - t_check > 0.3:
                        if cut() >= N_CLIENTS:
                            done_at = gaps.n
                        # reading the log is the test's pause, not the daemon's
                        gaps.last = t_check = time.monotonic()
                    if (done_at is not None and gaps.n > done_at + 20) or time.monotonic() > deadline:
                        stream.cancel()
                assert stream.finish_reason == "cancelled"
            for t in floods:
                t.join(10)
        assert done_at is not None, f"{cut()} of {N_CLIENTS} clients cut off"
        assert gaps.longest < MAX_GAP_S, gaps
        assert rss.peak - rss.base < 16 << 20, (rss.base, rss.peak)  # the replies alone would be ~48 MB
        for _, s in socks:  # reading at last: what fitted in the pipe, then the error
            err = None
            while err is None and s.poll(5000):
                msg = decode(s.recv(), M.CoordinatorToClient)
                err = msg if isinstance(msg, M.Error) else None
            assert err is not None and err.code == M.ErrorCode.CLIENT_TOO_SLOW, err
            assert "did not read" in err.message and f"together (limit {BUDGET})" in err.message, err.message
        assert greedy(d) == reference
    finally:
        for ctx, _ in socks:
            ctx.destroy(linger=0)
        assert d.stop() == 0
    assert d.leftovers() == []
