"""The intake worker (stratad/intake_worker.py) shared by the coordinator's and the gateway's intakes: started with
its owner, replaced once when it dies (never closing a replacement), ignoring Ctrl-C, dying with its owner; and the
coordinator's bound on big frames in flight (coordinator/intake.py), alone and in the real daemon."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import psutil
import pytest

from coordinator.intake import MAX_WAITING, Intake
from daemon_harness import ROOT, Daemon, greedy, raw_socket
from protos import messages as M
from protos.codec import decode, encode
from stratad.intake_worker import WorkerPool
from stratad.prompts import HEAVY_BYTES, max_prompt_bytes, prompt_tokens


def _load(tag: str):
    return tag, os.getpid()


def _state(state):
    return state


def _sleep(state, seconds: float):
    time.sleep(seconds)
    return state


def workers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]


def wait_for(pred, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return got


@pytest.fixture
def pool():
    wp = WorkerPool(_load, "t")
    yield wp
    wp.close()
    psutil.wait_procs(workers(), timeout=10)


def test_start_spawns_and_loads_the_worker_before_any_request(pool):
    assert workers() == []
    pool.start()
    (w,) = wait_for(workers)
    assert pool.submit(_state).result(30) == ("t", w.pid)  # load(*args) ran there; tasks get what it returned


def test_a_dead_worker_is_replaced_once_and_the_replacement_is_kept(pool):
    """Two requests held by a worker that is killed both fail; the first seen starts a new worker; a request sent
    to it meanwhile is served, though the second failure is seen after it (it used to close the new pool)."""
    pool.start()
    (old,) = wait_for(workers)
    a, b = pool.submit(_sleep, 60), pool.submit(_sleep, 60)
    old.kill()
    for f in (a, b):
        assert isinstance(f.exception(10), BrokenProcessPool)
    assert pool.broken(a)
    new = [pool.submit(_sleep, 0.3)] + [pool.submit(_state) for _ in range(3)]  # some still queued in this process
    assert pool.broken(b)  # the dead pool's: the current one is left alone
    for f in new:
        assert f.result(30)[1] != old.pid  # none cancelled
        assert not pool.broken(f)
    assert len(workers()) == 1


def test_a_worker_found_dead_at_submit_is_replaced(pool):
    pool.start()
    (old,) = wait_for(workers)
    old.kill()
    old.wait(10)
    time.sleep(0.5)  # the executor's manager thread marks the pool broken
    assert pool.submit(_state).result(30)[1] != old.pid


def test_the_worker_ignores_ctrl_c(pool):
    pool.start()
    (w,) = wait_for(workers)
    assert pool.submit(_state).result(30)[1] == w.pid  # past its initializer
    os.kill(w.pid, signal.SIGINT)
    assert pool.submit(_sleep, 0.2).result(30)[1] == w.pid


def test_the_worker_dies_with_its_owner():
    owner = subprocess.Popen([sys.executable, "-c", "import os, time\nfrom stratad.intake_worker import WorkerPool\n"
                              "wp = WorkerPool(os.getpid)\nwp.start()\nprint('started', flush=True)\ntime.sleep(60)\n"],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert owner.stdout.readline() == "started\n"
        kids = lambda: [p for p in psutil.Process(owner.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        (w,) = wait_for(kids)
        owner.kill()
        owner.wait()
        t0 = time.monotonic()
        _, alive = psutil.wait_procs([w], timeout=5)
        assert not alive and time.monotonic() - t0 < 5
    finally:
        owner.kill()
        owner.wait()


# ---- the coordinator's intake: at most MAX_WAITING big frames in flight ---------------------------------------
def big_frame(i: int, words: int = 10_000) -> bytes:
    frame = encode(M.Generate(req_id=f"big{i}", prompt="word " * words, sampling=M.Sampling(max_tokens=4)))
    assert len(frame) > HEAVY_BYTES
    return frame


def test_big_frames_past_the_cap_are_answered_queue_full_in_order(tiny_model_path, tiny_model):
    ctx = 8192
    intake = Intake(str(tiny_model_path), prompt_tokens, ctx, max_prompt_bytes(tiny_model.tokenizer, ctx))
    intake.start()
    try:
        for i in range(MAX_WAITING):
            intake.add(("c", i), frame=big_frame(i))
        intake.add(("late", 0), frame=big_frame(99))  # the one past the cap
        intake.add(("late", 0), M.StatusRequest())  # behind it, in its order
        got = {}
        deadline = time.monotonic() + 60
        while sum(map(len, got.values())) < MAX_WAITING + 2:
            assert time.monotonic() < deadline
            for peer, msg, fut in intake.ready():
                got.setdefault(peer, []).append(msg if fut is None else fut.result())
            time.sleep(0.01)
        for i in range(MAX_WAITING):  # the worker's answers: each request, tokenised
            (g,) = got[("c", i)]
            assert isinstance(g, M.Generate) and g.req_id == f"big{i}" and g.prompt is None and g.tokens, g
        refused, status = got[("late", 0)]
        assert refused.code == M.ErrorCode.QUEUE_FULL and refused.req_id == "big99", refused
        assert f"{MAX_WAITING} large requests (over {HEAVY_BYTES} bytes) are being prepared" in refused.message
        assert status == M.StatusRequest()
        assert not intake.pending() and not intake.in_worker
        intake.add(("again", 0), frame=big_frame(100))  # answers taken: room again
        (peer, _, fut), = wait_for(intake.ready)
        assert fut.result().req_id == "big100"
        intake.add(("gone", 0), frame=big_frame(101))
        intake.drop(("gone", 0))  # a lost client's frames no longer count
        assert not intake.in_worker
    finally:
        intake.close()


def test_the_daemon_refuses_big_frames_past_the_cap_with_queue_full(tiny_model_path, tmp_path):
    """16 big frames at once from 16 clients (300 KB prompts the worker tokenises, then refuses: prompt_too_long):
    at least the first MAX_WAITING are prepared, those past the bound while they are get queue_full; the daemon
    serves as before, and a big frame sent afterwards is prepared again."""
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu").start()
    socks = []
    try:
        want = greedy(d)
        socks = [raw_socket(d) for _ in range(2 * MAX_WAITING)]
        frames = [big_frame(i, words=60_000) for i in range(len(socks))]
        go = threading.Barrier(len(socks))

        def send(i):
            go.wait()
            socks[i][1].send(frames[i])

        ts = [threading.Thread(target=send, args=(i,)) for i in range(len(socks))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        codes = []
        for i, (_, s) in enumerate(socks):
            assert s.poll(60_000), f"frame {i} unanswered"
            codes.append(decode(s.recv(), M.CoordinatorToClient).code)
        assert set(codes) <= {M.ErrorCode.PROMPT_TOO_LONG, M.ErrorCode.QUEUE_FULL}, codes
        assert codes.count(M.ErrorCode.PROMPT_TOO_LONG) >= MAX_WAITING, codes
        assert codes.count(M.ErrorCode.QUEUE_FULL) >= 1, codes  # 16 sent within milliseconds, each ~0.1 s of work
        assert "large requests (over" in d.log_text()
        _, s = socks[0]
        s.send(big_frame(999, words=60_000))
        assert s.poll(60_000) and decode(s.recv(), M.CoordinatorToClient).code == M.ErrorCode.PROMPT_TOO_LONG
        assert greedy(d) == want
    finally:
        for ctx, _ in socks:
            ctx.destroy(linger=0)
        assert d.stop() == 0


def test_small_messages_behind_a_big_frame_are_bounded(tiny_model_path, tiny_model):
    """A client's small messages waiting behind its big frame: at most BEHIND_COUNT and BEHIND_BYTES are held; one
    more is not queued (the caller answers it queue_full), and the room comes back as they are handled."""
    from coordinator.intake import BEHIND_BYTES, BEHIND_COUNT

    ctx = 8192
    intake = Intake(str(tiny_model_path), prompt_tokens, ctx, max_prompt_bytes(tiny_model.tokenizer, ctx))
    intake.start()
    try:
        intake.add(("c", 0), frame=big_frame(0))
        for _ in range(BEHIND_COUNT - 1):
            assert intake.add(("c", 0), M.StatusRequest(), size=10)
        assert not intake.add(("c", 0), M.StatusRequest(), size=10)  # the frame and BEHIND_COUNT - 1 behind it
        intake.add(("d", 0), frame=big_frame(1))
        assert intake.add(("d", 0), M.StatusRequest(), size=BEHIND_BYTES - 1)
        assert not intake.add(("d", 0), M.StatusRequest(), size=2)  # bytes
        assert intake.add(("e", 0), M.StatusRequest(), size=BEHIND_BYTES)  # another client's own room
        got = []
        deadline = time.monotonic() + 60
        while intake.pending():
            assert time.monotonic() < deadline
            got += intake.ready()
            time.sleep(0.01)
        assert len(got) == 1 + (BEHIND_COUNT - 1) + 2 + 1 and not intake.behind
        intake.add(("c", 0), frame=big_frame(2))
        assert intake.add(("c", 0), M.StatusRequest(), size=BEHIND_BYTES)  # room again
    finally:
        intake.close()


def test_the_daemon_refuses_a_flood_behind_a_big_frame_with_queue_full(tiny_model_path, tmp_path):
    """A client sends a big frame and then 3000 status requests at once: the first are answered in its order after
    the big one, those past the bound queue_full; every frame gets one answer and the daemon serves as before."""
    from coordinator.intake import BEHIND_COUNT

    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu").start()
    ctx_, s = raw_socket(d)
    try:
        want = greedy(d)
        n = 3000
        s.send(big_frame(0, words=60_000))
        status = encode(M.StatusRequest())
        for _ in range(n):
            s.send(status)
        answers = []
        while len(answers) < n + 1:
            assert s.poll(60_000), f"{len(answers)} of {n + 1} answered"
            answers.append(decode(s.recv(), M.CoordinatorToClient))
        full = [a for a in answers if isinstance(a, M.Error) and a.code == M.ErrorCode.QUEUE_FULL]
        statuses = [a for a in answers if isinstance(a, M.Status)]
        big = [a for a in answers if isinstance(a, M.Error) and a.code == M.ErrorCode.PROMPT_TOO_LONG]
        assert len(big) == 1 and len(full) + len(statuses) == n, [type(a).__name__ for a in answers[:5]]
        assert full and len(statuses) >= BEHIND_COUNT - 1, (len(full), len(statuses))
        assert "large requests" in full[0].message
        assert greedy(d) == want
    finally:
        ctx_.destroy(linger=0)
        assert d.stop() == 0
