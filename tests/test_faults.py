"""Faults against the real daemon on CPU cards (tiny model): clients that stop reading, flood, send oversized frames
or prompts, a coordinator or lanes killed mid-stream, Ctrl-C and SIGTERM in the foreground. After each, status
answers and a greedy generation gives the tokens it gave before."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import pytest
import zmq

from daemon_harness import GREEDY_PROMPT, MAX_GAP_S, Daemon, Gaps, RssPeak, coordinator_rss, curve_tcp, greedy, \
    raw_socket
from protos import messages as M
from protos.codec import decode, encode
from stratad.client import KEEPALIVE_CNT, KEEPALIVE_IDLE_S, KEEPALIVE_INTVL_S, AsyncClient, Client, \
    DaemonUnavailable, RequestError
from stratad.demo import SHIPPED_MODEL

LONG = dict(prompt="Tell me everything about the cards.", ignore_eos=True)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """On the shipped model: its chat template (Qwen3's) renders tools, tool calls, reasoning and a prefill."""
    tmp = tmp_path_factory.mktemp("faults")
    cfg = tmp / "c.toml"
    cfg.write_text("client_queue_messages = 32\nclient_queue_bytes = 65536\nstop_grace_s = 1.0\n")
    d = Daemon(SHIPPED_MODEL, tmp / "run", config=cfg).start()
    d.reference = greedy(d)
    yield d
    t0 = time.monotonic()
    assert d.stop() == 0 and time.monotonic() - t0 < 10  # whatever the clients did
    assert d.leftovers() == []


def still_right(d: Daemon) -> None:
    with Gaps() as g, g.timed():
        d.status()
    assert g.slowest_call < MAX_GAP_S, g  # answered at once after the fault: nothing of it still holds the loop
    assert greedy(d) == d.reference


def lane_of(d: Daemon, req_id: str):
    return next((ln for ln in d.status().lanes if ln.req_id == req_id), None)


def read_until_error(s: zmq.Socket, timeout_s: float) -> M.Error | None:
    deadline = time.monotonic() + timeout_s
    while s.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        msg = decode(s.recv(), M.CoordinatorToClient)
        if isinstance(msg, M.Error):
            return msg
    return None


def stream_beside(d: Daemon, until, timeout_s: float = 60.0) -> Gaps:
    """A reading client's long stream, iterated until until() holds (checked about every 0.3 s) and for a few more
    chunks; until()'s calls (status requests) are timed on the way and checked with the pauses: neither may take
    MAX_GAP_S, less what this process was stalled itself (Gaps). The pauses seen."""
    t_check, done_at = 0.0, None
    deadline = time.monotonic() + timeout_s
    with Gaps() as gaps, d.client(stream_timeout_s=30) as c:
        s = c.generate(max_tokens=6000, **LONG)
        for _ in s:
            gaps.tick()
            if done_at is None and time.monotonic() - t_check > 0.3:
                with gaps.timed():
                    if until():
                        done_at = gaps.n
                gaps.last = t_check = time.monotonic()  # the status call is the test's pause, not the daemon's
            if (done_at is not None and gaps.n > done_at + 20) or time.monotonic() > deadline:
                s.cancel()
        assert s.finish_reason == "cancelled"
    assert done_at is not None, "the condition never held"
    assert gaps.slowest_call < MAX_GAP_S, f"status took too long: {gaps}"
    return gaps


def test_a_stalled_reader_is_cut_off_and_nobody_waits_for_it(daemon):
    ctx, stalled = raw_socket(daemon, rcvhwm=1, rcvbuf=4096)
    try:
        stalled.send(encode(M.Generate(req_id="stalled", prompt=LONG["prompt"],
                                       sampling=M.Sampling(max_tokens=7000, ignore_eos=True))))
        deadline = time.monotonic() + 10
        while lane_of(daemon, "stalled") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lane_of(daemon, "stalled") is not None
        gaps = stream_beside(daemon, lambda: lane_of(daemon, "stalled") is None)
        assert gaps.longest < MAX_GAP_S, gaps
        err = read_until_error(stalled, 10)  # reading at last: what fitted in the pipe, then the error
        assert err is not None and err.code == M.ErrorCode.CLIENT_TOO_SLOW and "did not read" in err.message
    finally:
        ctx.destroy(linger=0)
    assert "stopped reading its replies" in daemon.log_text()
    still_right(daemon)


def test_a_slow_reader_that_keeps_reading_pauses_nobody(daemon):
    """A client that reads its stream slowly (a message every 20 ms, a pipe of one message): beside it a normal
    client's stream never pauses; the slow one gets its tokens in order, then its Done or (once it falls too far
    behind) client_too_slow, and nothing else."""
    ctx, slow = raw_socket(daemon, rcvhwm=1, rcvbuf=4096)
    got, end, stop = [], [], threading.Event()

    def read_slowly():
        while not stop.is_set() and not end:
            if slow.poll(100):
                msg = decode(slow.recv(), M.CoordinatorToClient)
                if isinstance(msg, (M.Done, M.Error)):
                    end.append(msg)
                elif isinstance(msg, M.TokenChunk):
                    got.extend(msg.tokens)
                time.sleep(0.02)

    reader = threading.Thread(target=read_slowly)
    try:
        slow.send(encode(M.Generate(req_id="slow", prompt=GREEDY_PROMPT, sampling=M.Sampling(max_tokens=1500,
                                                                                        ignore_eos=True))))
        reader.start()
        gaps = stream_beside(daemon, lambda: bool(end) or len(got) >= 300)
        assert gaps.longest < MAX_GAP_S, gaps
        reader.join(60)
    finally:
        stop.set()
        reader.join()
        ctx.destroy(linger=0)
    assert len(end) == 1 and len(got) >= 300, (end, len(got))
    if isinstance(end[0], M.Error):
        assert end[0].code == M.ErrorCode.CLIENT_TOO_SLOW, end[0]
    else:
        assert end[0].req_id == "slow" and end[0].finish_reason == "length" and len(got) == 1500
    with daemon.client() as c:  # nothing lost or reordered: a normal client's greedy tokens
        s = c.generate(prompt=GREEDY_PROMPT, max_tokens=300, ignore_eos=True)
        s.result()
        assert got[:300] == s.tokens
    still_right(daemon)


def test_a_client_flooding_status_requests_without_reading(daemon):
    ctx, flood = raw_socket(daemon, rcvhwm=1, rcvbuf=4096)
    flood.setsockopt(zmq.SNDTIMEO, 5000)
    status = encode(M.StatusRequest())
    cut = daemon.log_text().count("stopped reading its replies")
    try:
        def cut_off():
            return daemon.log_text().count("stopped reading its replies") > cut

        sender = threading.Thread(target=lambda: [flood.send(status) for _ in range(3000)])
        sender.start()
        gaps = stream_beside(daemon, cut_off)
        sender.join(30)
        assert gaps.longest < MAX_GAP_S, gaps
    finally:
        ctx.destroy(linger=0)  # and it disconnects, never having read
    still_right(daemon)


@contextlib.contextmanager
def memory_bounded(d: Daemon):
    """The coordinator's RSS sampled while the block runs: its peak at most 200 MB over the start, and within 64 MB
    of it a second after."""
    with RssPeak(d) as rss:
        yield
    assert rss.peak - rss.base < 200 << 20, (rss.base, rss.peak)
    time.sleep(1.0)
    assert coordinator_rss(d) - rss.base < 64 << 20, (rss.base, coordinator_rss(d))


def test_oversized_frames_and_prompts_are_refused_with_the_limit_and_memory_stays_bounded(daemon):
    ctx, s = raw_socket(daemon)
    with memory_bounded(daemon):
        s.send(b"{" * (64 << 20))  # libzmq drops the connection on the size in the header: never allocated
        s.send(b"[" * (12 << 20))  # under the socket's cap: read, then refused naming the limit
        assert s.poll(10000)
        err = decode(s.recv(), M.CoordinatorToClient)
        assert err.code == M.ErrorCode.BAD_FRAME and str(M.MAX_FRAME_BYTES) in err.message
        with daemon.client() as c:
            with pytest.raises(RequestError) as e:  # refused by the client library before sending
                c.generate(prompt="x" * (64 << 20))
            assert e.value.code == M.ErrorCode.PROMPT_TOO_LONG and str(M.MAX_FRAME_BYTES) in e.value.message
            t0 = time.monotonic()
            with pytest.raises(RequestError) as e:  # fits a frame, cannot fit the context: refused untokenised
                c.generate(prompt="word " * (7_000_000 // 5), max_tokens=5).result()
            # the intake worker's decode (the worker starts with the daemon; before, the first big frame waited for
            # its start), well under the ~8 s that tokenising 7 MB took; memory_bounded is the check that nothing
            # was tokenised (1 s failed under load)
            assert time.monotonic() - t0 < 15.0
            assert e.value.code == M.ErrorCode.PROMPT_TOO_LONG and "bytes exceeds the limit of" in e.value.message
            with pytest.raises(RequestError) as e:
                c.generate(prompt="hi", max_tokens=10**12).result()
            assert e.value.code == M.ErrorCode.BAD_REQUEST
            assert "max_tokens 1000000000000" in e.value.message and "context length 8192" in e.value.message
    ctx.destroy(linger=0)
    still_right(daemon)


BIG = "word " * 1_400_000  # 7 MB: fits a frame, not the context
HI = {"role": "user", "content": "hi"}


def call(arguments: dict) -> dict:
    fn = {"name": "f", "arguments": arguments}
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": fn}]}


BIG_FIELDS = {  # each a request's field the chat template renders, made 7 MB (or 150,000 messages: a 4.8 MB frame)
    "tools": lambda: dict(messages=[HI], tools=[{"type": "function", "function": {"name": "f", "description": BIG}}]),
    "tool_call_arguments": lambda: dict(messages=[HI, call({"a": BIG}), HI]),
    "tool_call_argument_items": lambda: dict(messages=[HI, call({"a": [0] * 2_500_000}), HI]),
    "reasoning_content": lambda: dict(messages=[HI, {"role": "assistant", "content": "ok", "reasoning_content": BIG},
                                                HI]),
    "name": lambda: dict(messages=[HI, {"role": "tool", "content": "42", "name": BIG}]),
    "prefill": lambda: dict(messages=[HI], prefill=BIG),
    "messages": lambda: dict(messages=[{"role": "user", "content": ""}] * 150_000),
}


@pytest.mark.parametrize("field", list(BIG_FIELDS))
def test_a_big_field_is_refused_untokenised_without_pausing_anyone(daemon, field):
    """Not only the prompt and the contents: every field the template renders counts toward the byte bound, and
    more messages than the context holds are refused by their count. The refusal comes at once; another client's
    stream and status go on; the coordinator's memory stays bounded."""
    frame = json.dumps(dict(type="generate", req_id=f"big-{field}", sampling={"max_tokens": 4}, **BIG_FIELDS[field]()),
                       separators=(",", ":")).encode()
    assert 4 << 20 < len(frame) < M.MAX_FRAME_BYTES
    ctx, s = raw_socket(daemon)
    answered = []

    def send():
        t0 = time.monotonic()
        s.send(frame)
        if s.poll(30000):
            answered.append((decode(s.recv(), M.CoordinatorToClient), time.monotonic() - t0))

    t = threading.Thread(target=send)

    def sent_then_answered():
        if t.ident is None:
            t.start()
        daemon.status()
        return bool(answered) or not t.is_alive()

    try:
        with memory_bounded(daemon):
            gaps = stream_beside(daemon, sent_then_answered)
            t.join(30)
    finally:
        ctx.destroy(linger=0)
    (err, took), = answered
    assert isinstance(err, M.Error) and err.code == M.ErrorCode.PROMPT_TOO_LONG, err
    want = "150000 messages + max_tokens 4 exceed" if field == "messages" else "bytes exceeds the limit of"
    # refused from its sizes, untokenised (memory_bounded holds): the time is the intake worker's decoding of the
    # frame (0.02-0.6 s on the idle 2-core box, up to 5 s with the box busy; the worker starts with the daemon); the
    # other stream's gaps are the strict check
    assert want in err.message and took < 15.0, (err.message, took)
    assert gaps.longest < MAX_GAP_S, gaps
    still_right(daemon)


def test_a_long_prompt_is_tokenised_off_the_loop_in_the_clients_order(daemon):
    """300 KB of text (fits the byte bound, not the context): tokenised in the intake worker while another stream
    goes on; the same client's status request, sent right after it, is answered after its refusal."""
    ctx, s = raw_socket(daemon)
    done = threading.Event()

    def long_prompts():
        for i in range(3):
            s.send(encode(M.Generate(req_id=f"long{i}", prompt="word " * 60000)))
            s.send(encode(M.StatusRequest()))
            for want in (M.Error, M.Status):
                assert s.poll(30000)
                msg = decode(s.recv(), M.CoordinatorToClient)
                assert isinstance(msg, want), msg
                if want is M.Error:
                    assert msg.code == M.ErrorCode.PROMPT_TOO_LONG and msg.req_id == f"long{i}"
        done.set()

    t = threading.Thread(target=long_prompts)

    def start_then_done():  # the prompts go once the other stream is under way
        if t.ident is None:
            t.start()
        return done.is_set()

    try:
        gaps = stream_beside(daemon, start_then_done)
        t.join(60)
        assert done.is_set() and gaps.longest < MAX_GAP_S, gaps
    finally:
        ctx.destroy(linger=0)
    still_right(daemon)


def test_every_lane_killed_mid_stream_fails_its_request_within_5_s(daemon):
    with daemon.client(stream_timeout_s=60) as c:
        streams = [c.generate(max_tokens=5000, req_id=f"victim{i}", **LONG) for i in range(2)]
        its = [iter(s) for s in streams]
        for it in its:
            next(it)
        lanes = {ln.lane: ln for ln in daemon.status().lanes if ln.req_id}
        assert len(lanes) == 2
        restarts = sum(ln.restarts for ln in daemon.status().lanes)
        t0 = time.monotonic()
        for ln in lanes.values():
            os.kill(ln.pid, signal.SIGKILL)
        for it in its:
            with pytest.raises(RequestError) as e:
                for _ in it:
                    pass
            assert e.value.code == M.ErrorCode.LANE_FAILED
            assert time.monotonic() - t0 < 5.0
    daemon.wait_ready(30, restarts=restarts + 2)
    still_right(daemon)


def kill_coordinator_mid_stream(d: Daemon, within_s: float = 5.0, **client) -> None:
    """A sync and an async stream open; SIGKILL of the coordinator alone: both raise DaemonUnavailable in within_s.
    client: how the clients reach the daemon (Client's arguments; its runtime dir if none)."""
    outcome, started = {}, threading.Barrier(3)
    client = client or dict(runtime_dir=str(d.runtime_dir))

    def sync_stream():
        with Client(stream_timeout_s=600, **client) as c:
            s = c.generate(max_tokens=5000, **LONG)
            try:
                for i, _ in enumerate(s):
                    if i == 0:
                        started.wait()
            except Exception as e:  # noqa: BLE001
                outcome["sync"] = (e, time.monotonic())

    def async_stream():
        async def go():
            async with AsyncClient(stream_timeout_s=600, **client) as c:
                first = True
                try:
                    async for _ in c.generate(max_tokens=5000, **LONG):
                        if first:
                            await asyncio.get_running_loop().run_in_executor(None, started.wait)
                            first = False
                except Exception as e:  # noqa: BLE001
                    outcome["async"] = (e, time.monotonic())
        asyncio.run(go())

    ts = [threading.Thread(target=f) for f in (sync_stream, async_stream)]
    for t in ts:
        t.start()
    started.wait(30)
    t0 = time.monotonic()
    d.proc.kill()
    for t in ts:
        t.join(within_s + 5)
    for name in ("sync", "async"):
        assert name in outcome, f"the {name} stream still open {within_s + 5:g} s after the kill"
        e, t = outcome[name]
        assert isinstance(e, DaemonUnavailable) and "went away" in str(e), (name, e)
        assert t - t0 < within_s, (name, t - t0)
    d.proc.wait()


def test_coordinator_killed_mid_stream(tiny_model_path, tmp_path):
    import psutil

    d = Daemon(tiny_model_path, tmp_path / "run").start()
    reference = greedy(d)
    ctx, s = raw_socket(d)
    s.send(encode(M.Generate(req_id="big", prompt="word " * 20000)))  # starts the intake worker
    assert s.poll(30000) and decode(s.recv(), M.CoordinatorToClient).code == M.ErrorCode.PROMPT_TOO_LONG
    ctx.destroy(linger=0)
    children = psutil.Process(d.proc.pid).children(recursive=True)  # lanes, the intake worker, its resource tracker
    assert len(children) >= 4 and set(d.lane_pids()) < {p.pid for p in children}
    kill_coordinator_mid_stream(d)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive  # every process of the daemon follows its coordinator
    assert d.leftovers()  # what a crash leaves: the next start reclaims it
    with Gaps() as g, g.timed(), pytest.raises(DaemonUnavailable, match="connection refused"):
        d.status()  # a socket file nobody listens at
    assert g.slowest_call < 1.0, g  # at once, not after status()'s 5 s timeout (this process's own stalls aside)
    t_restart = time.time()
    d.start()
    try:
        assert "reclaimed leftovers" in d.log_text()
        assert all(os.stat(p).st_ctime >= t_restart - 1 for p in d.leftovers())  # only the new daemon's
        assert greedy(d) == reference
    finally:
        assert d.stop() == 0
    assert d.leftovers() == []


def test_coordinator_killed_mid_stream_over_tcp_with_curve(tiny_model_path, tmp_path):
    """The same over TCP with CURVE keys. The kernel closes a killed process's connections, so the streams learn at
    once, as over the local socket; the bound is what the client's TCP keepalive allows for a host that vanished
    without a word (KEEPALIVE_IDLE_S + KEEPALIVE_CNT probes KEEPALIVE_INTVL_S apart: 5 s), which this cannot
    stage. A request after that is refused at once, not after its timeout; a restart binds the same port."""
    cfg = tmp_path / "c.toml"
    endpoint, client = curve_tcp(tmp_path, cfg)
    d = Daemon(tiny_model_path, tmp_path / "run", config=cfg).start()
    keepalive_s = KEEPALIVE_IDLE_S + KEEPALIVE_CNT * KEEPALIVE_INTVL_S
    kill_coordinator_mid_stream(d, within_s=keepalive_s + 1.0, endpoint=endpoint, **client)
    with Gaps() as g, g.timed(), pytest.raises(DaemonUnavailable, match="connection refused"), \
            Client(endpoint=endpoint, timeout_s=30, **client) as c:
        c.status()
    assert g.slowest_call < 2.0, g  # at once, not after the client's 30 s timeout (this process's stalls aside)
    d.start()
    try:
        with Client(endpoint=endpoint, timeout_s=10, **client) as c:
            assert c.status().lanes
    finally:
        assert d.stop() == 0
    assert d.leftovers() == []


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_foreground_stop_ends_streams_with_shutting_down(tiny_model_path, tmp_path, sig):
    """Ctrl-C (SIGINT to the whole process group, lanes included) or SIGTERM with a stream open: the stream gets
    shutting_down after stop_grace_s, the daemon exits 0 with no traceback and leaves nothing behind."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("stop_grace_s = 1.0\n")
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu", config=cfg).start()
    with d.client(stream_timeout_s=30) as c:
        s = c.generate(max_tokens=6000, **LONG)
        it = iter(s)
        next(it)
        t0 = time.monotonic()
        if sig == "SIGINT":
            os.killpg(d.proc.pid, signal.SIGINT)
        else:
            d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(RequestError) as e:
            for _ in it:
                pass
        assert e.value.code == M.ErrorCode.SHUTTING_DOWN
    rc = d.proc.wait(1.0 + 5.0)
    assert rc == 0 and time.monotonic() - t0 < 6.0
    d.proc = None
    log = d.log_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "restarting" not in log, log[-3000:]
    assert d.leftovers() == []


def test_bad_arguments_are_one_line_bad_requests_naming_the_argument(tmp_path):
    """Refused by the client library before anything is sent (no daemon needed)."""
    from stratad.client import Client

    cases = [(dict(messages="hello"), "messages: Input should be a list"),
             (dict(prompt="a\ud800b"), "prompt: not valid Unicode text (a lone surrogate at character 1)"),
             (dict(messages=[{"role": "user", "content": "\udc00"}]), "messages.0.content: not valid Unicode"),
             (dict(prompt="x", max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
             (dict(prompt="x", stop="ab"), "stop: Input should be a list"),
             (dict(prompt="x", stop=["."] * 65), "stop: List should have at most 64 items, not 65"),
             (dict(prompt="x", stop=["." * 1025]), "stop.0: String should have at most 1024 characters"),
             (dict(tokens=[1.5]), "tokens.0: Input should be a valid integer"),
             (dict(), "exactly one of prompt, messages, tokens is required")]
    with Client(runtime_dir=str(tmp_path)) as c:
        for kw, message in cases:
            with pytest.raises(RequestError) as e:
                c.generate(**kw)
            assert e.value.code == M.ErrorCode.BAD_REQUEST and e.value.message.startswith(message), (kw, e.value)
            assert "\n" not in e.value.message and "http" not in e.value.message


def test_a_killed_prompt_worker_is_replaced(daemon):
    """The intake worker (big frames) SIGKILLed: the next long prompt gets a new one."""
    import psutil

    ctx, s = raw_socket(daemon)

    def long_prompt(i: int) -> M.Error:
        s.send(encode(M.Generate(req_id=f"worker{i}", prompt="word " * 60000)))
        assert s.poll(30000)
        return decode(s.recv(), M.CoordinatorToClient)

    def workers():
        return [p for p in psutil.Process(daemon.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]

    try:
        assert long_prompt(0).code == M.ErrorCode.PROMPT_TOO_LONG  # tokenised by the worker, then refused
        (worker,) = workers()
        worker.kill()
        worker.wait(5)
        for i in (1, 2):  # the first may still meet the dead one (internal), then a new worker serves
            err = long_prompt(i)
            assert err.code in (M.ErrorCode.PROMPT_TOO_LONG, M.ErrorCode.INTERNAL), err
        assert err.code == M.ErrorCode.PROMPT_TOO_LONG and "tokens + max_tokens 128 exceeds" in err.message
        assert len(workers()) == 1 and workers()[0].pid != worker.pid
    finally:
        ctx.destroy(linger=0)
    still_right(daemon)
