"""The real daemon as a subprocess on two CPU cards with the tiny model: serving, queueing, failures, cleanup."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from daemon_harness import ROOT, Daemon
from protos import messages as M
from protos.codec import decode, encode
from stratad import shm
from stratad.client import AsyncClient, Client, DaemonUnavailable, RequestError
from stratad.engine.reference import ReferenceEngine
from stratad.engine.sampling import SamplingParams
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import slot_bytes

CHAT_A = [{"role": "user", "content": "Tell me about the experts on the cards."}]
CHAT_B = [{"role": "user", "content": "Why do two chats share one pool of slots?"}]


@pytest.fixture(scope="module")
def daemon(tiny_model_path, tmp_path_factory):
    d = Daemon(tiny_model_path, tmp_path_factory.mktemp("rt") / "run", extra=["--expert-cache", "0.5"]).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    m = ModelFile(tiny_model_path)
    return m, ReferenceEngine(m, "canonical")


def ref_tokens(reference, messages, n):
    m, eng = reference
    prompt = m.tokenizer.encode(m.tokenizer.apply_chat_template(messages))
    return list(eng.generate(prompt, SamplingParams(max_tokens=n)))


def test_two_concurrent_clients_on_two_lanes_match_reference(daemon, reference):
    out = {}

    def run(name, messages):
        with daemon.client() as c:
            s = c.generate(messages=messages, max_tokens=24)
            s.result()
            out[name] = s

    ts = [threading.Thread(target=run, args=(n, m)) for n, m in (("a", CHAT_A), ("b", CHAT_B))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert {out["a"].stats.lane, out["b"].stats.lane} == {0, 1}
    assert out["a"].tokens == ref_tokens(reference, CHAT_A, 24)
    assert out["b"].tokens == ref_tokens(reference, CHAT_B, 24)
    for s in out.values():
        st = s.stats
        assert st.generated_tokens == len(s.tokens)
        assert st.experts_card > 0 and st.experts_cpu > 0  # half the experts cached: both paths used
        assert st.expert_bytes == slot_bytes(reference[0]) and st.experts_staged == 0  # CPU cards stage nothing
        assert st.experts_host_read == 0  # and compute their misses on the CPU pool
        assert st.experts_card + st.experts_peer + st.experts_cpu == \
            (st.prompt_tokens + st.generated_tokens - 1) * 4 * 4 or s.finish_reason == "stop"


def test_third_request_is_queued_then_served(daemon):
    with daemon.client() as c:
        busy = [c.generate(messages=CHAT_A, max_tokens=2000, req_id=f"q{i}") for i in range(2)]
        assert all(next(iter(s)).tokens for s in busy)  # both lanes are generating
        third = c.generate(messages=CHAT_B, max_tokens=20, req_id="q2")
        it3 = iter(third)
        assert third.wait_accepted().queue_position == 1  # tokens come only once a lane frees
        assert daemon.status().queue == ("q2",)
        busy[0].cancel()
        first3 = next(it3)
        for _ in it3:
            pass
        assert first3.tokens and third.finish_reason in ("length", "stop")
        assert third.stats.queue_s > 0
        busy[1].cancel()
        busy[1].result()


def test_cancel_mid_stream_frees_the_lane(daemon):
    with daemon.client() as c:
        s = c.generate(messages=CHAT_A, max_tokens=500)
        n = 0
        for _ in s:
            n += 1
            if n == 3:
                s.cancel()
        assert s.finish_reason == "cancelled"
        assert s.stats.generated_tokens < 500
        assert c.generate(messages=CHAT_B, max_tokens=4).result() is not None


def test_cancel_during_a_long_prompt(daemon):
    """A prompt of several chunks: a cancel is honoured between chunks, before the first token, and the lane serves
    the next request."""
    with daemon.client() as c:
        s = c.generate(tokens=[(7 * i) % 1000 + 3 for i in range(3500)], max_tokens=5)
        s.cancel()
        s.result()
        assert s.finish_reason == "cancelled" and s.stats.generated_tokens == 0
        nxt = c.generate(prompt="hello", max_tokens=3)
        nxt.result()
        assert nxt.stats.generated_tokens == 3


def test_client_disconnect_frees_the_lane(daemon):
    with daemon.client() as c:
        s = c.generate(messages=CHAT_A, max_tokens=2000)
        it = iter(s)
        next(it)
        s.close()  # the client goes away without cancelling
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(ln.req_id is None for ln in daemon.status().lanes):
            break
        time.sleep(0.1)
    assert all(ln.req_id is None for ln in daemon.status().lanes)


def test_malformed_frames_get_errors_and_the_daemon_keeps_serving(daemon):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"ipc://{daemon.runtime_dir / 'client.sock'}")
    import random

    rng = random.Random(7)
    frames = [b"", b"\xff\xfe\x00", b"[1,2]", b"{}", b'{"type":"generate"}', b'{"v":99,"type":"status_request"}',
              b'{"type":"generate","req_id":"x","prompt":"a","tokens":[1]}', b"x" * (9 << 20),
              b'{"type":"generate","req_id":"x","tokens":[99999999]}']
    frames += [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))) for _ in range(30)]
    for f in frames:
        s.send(f)
        assert s.poll(5000), f"no reply to {f[:40]!r}"
        reply = decode(s.recv(), M.CoordinatorToClient)
        assert isinstance(reply, M.Error), f[:40]
        assert reply.message
    s.send_multipart([b"a", b"b"])
    assert s.poll(5000) and isinstance(decode(s.recv(), M.CoordinatorToClient), M.Error)
    s.close(0)
    ctx.term()
    with daemon.client() as c:
        assert c.generate(messages=CHAT_A, max_tokens=3).result() is not None


def test_bad_requests(daemon):
    with daemon.client() as c:
        with pytest.raises(RequestError) as e:
            c.generate(prompt="word " * 5000, max_tokens=10).result()
        assert e.value.code == M.ErrorCode.PROMPT_TOO_LONG and "context length" in e.value.message
        with pytest.raises(RequestError) as e:
            c.generate(prompt="x", max_tokens=0)
        assert e.value.code == M.ErrorCode.BAD_REQUEST
        with pytest.raises(RequestError) as e:
            c.generate(tokens=[5, 10**9]).result()
        assert "outside the vocabulary" in e.value.message
        s1 = c.generate(prompt="hello", max_tokens=50, req_id="dup")
        next(iter(s1))
        with pytest.raises(RequestError) as e:
            c.generate(prompt="hello", req_id="dup").result()
        assert e.value.code == M.ErrorCode.DUPLICATE_REQUEST
        s1.result()


def test_stop_strings_and_sampling(daemon, reference):
    with daemon.client() as c:
        full = c.generate(messages=CHAT_A, max_tokens=24).result()
        stop = full[6:9]
        s = c.generate(messages=CHAT_A, max_tokens=24, stop=[stop])
        text = s.result()
        assert s.finish_reason == "stop" and stop not in text and full.startswith(text)
        a = c.generate(messages=CHAT_B, max_tokens=16, temperature=0.9, top_p=0.9, seed=5)
        b = c.generate(messages=CHAT_B, max_tokens=16, temperature=0.9, top_p=0.9, seed=5)
        assert a.result() == b.result()


def test_asyncio_client(daemon):
    async def go():
        async with AsyncClient(runtime_dir=str(daemon.runtime_dir)) as c:
            st = await c.status()
            s = c.generate(messages=CHAT_A, max_tokens=5)
            pieces = [ch async for ch in s]
            return st, s, pieces

    st, s, pieces = asyncio.run(go())
    assert len(st.lanes) == 2 and s.finish_reason in ("length", "stop") and pieces


def test_stratactl(daemon):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, "-m", "stratad.ctl", "--runtime-dir", str(daemon.runtime_dir)]
    out = subprocess.run(base + ["status"], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0 and ("solo" in out.stdout or "peer" in out.stdout) and "card%" in out.stdout
    assert "expert profile at start: routing warm-up" in out.stdout
    # the tiny model's types: IQ3_S experts, Q8_0 attention, embedding and head (the generator's defaults)
    assert "tensor types: IQ3_S file; experts IQ3_S x12; attention Q8_0 x16; embedding Q8_0; head Q8_0" in out.stdout
    js = json.loads(subprocess.run(base + ["status", "--json"], capture_output=True, text=True, env=env,
                                   timeout=30).stdout)
    assert [ln["card"] for ln in js["lanes"]] == ["cpu", "cpu"]
    out = subprocess.run(base + ["generate", "hi", "--max-tokens", "5"], capture_output=True, text=True, env=env,
                         timeout=30)
    assert out.returncode == 0 and "tok/s" in out.stderr and "GiB read" in out.stderr
    out = subprocess.run(base + ["generate", "hi", "--max-tokens", "7", "--ignore-eos"], capture_output=True,
                         text=True, env=env, timeout=30)
    assert out.returncode == 0 and "[7 tokens (length)" in out.stderr, out.stderr


def test_lane_killed_mid_generation(daemon):
    with daemon.client() as c:
        s = c.generate(messages=CHAT_A, max_tokens=2000)
        it = iter(s)
        next(it)
        victim = next(ln for ln in daemon.status().lanes if ln.req_id == s.req_id)
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(RequestError) as e:
            for _ in it:
                pass
        assert e.value.code == M.ErrorCode.LANE_FAILED and f"lane {victim.lane}" in e.value.message
    daemon.wait_ready(30, restarts=1)
    st = daemon.status()
    assert st.lanes[victim.lane].restarts >= 1 and st.lanes[victim.lane].pid != victim.pid
    with daemon.client() as c:
        outs = [c.generate(messages=CHAT_B, max_tokens=4) for _ in range(2)]
        assert all(o.result() is not None for o in outs)


def test_daemon_absent_is_a_clear_error(tmp_path):
    with Client(runtime_dir=str(tmp_path), timeout_s=1) as c:
        with pytest.raises(DaemonUnavailable, match="is the daemon running"):
            c.status()


def run_serve(args, timeout=30):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "stratad.cli", "serve", "--http", "", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_bad_config_and_missing_model(tmp_path, tiny_model_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'model = "{tiny_model_path}"\nbogus_key = 3\n')
    r = run_serve(["--config", str(cfg), "--runtime-dir", str(tmp_path / "rt")])
    assert r.returncode == 2 and "bogus_key" in r.stderr
    cfg.write_text(f'model = "{tiny_model_path}"\nexpert_cache = "lots"\n')
    r = run_serve(["--config", str(cfg), "--runtime-dir", str(tmp_path / "rt")])
    assert r.returncode == 2 and "expert_cache" in r.stderr
    r = run_serve(["--model", str(tmp_path / "nope.gguf"), "--cards", "cpu", "--runtime-dir", str(tmp_path / "rt")])
    assert r.returncode == 2 and "no such model file" in r.stderr
    cfg.write_text(f'model = "{tiny_model_path}"\ntcp = "tcp://127.0.0.1:25999"\n')  # TCP without CURVE keys
    r = run_serve(["--config", str(cfg), "--cards", "cpu", "--runtime-dir", str(tmp_path / "rt")])
    assert r.returncode == 2 and "CURVE" in r.stderr
    assert not list(shm.SHM_DIR.glob(shm.prefix_for(tmp_path / "rt").lstrip("/") + "*"))


def test_clean_stop_releases_everything_and_restart_reclaims(tiny_model_path, tmp_path):
    rt = tmp_path / "run"
    d = Daemon(tiny_model_path, rt, cards="cpu").start()
    with d.client() as c:
        s = c.generate(messages=CHAT_A, max_tokens=3000)
        next(iter(s))
        assert d.leftovers()  # segments and sockets exist while serving
        lane_pid = d.lane_pids()[0]
        d.proc.send_signal(signal.SIGTERM)
        # the in-flight request gets finished or a clear error, never silence
        try:
            s.result()
            assert s.finish_reason in ("length", "stop")
        except RequestError as e:
            assert e.code == M.ErrorCode.SHUTTING_DOWN
    assert d.stop() == 0
    assert d.leftovers() == []
    with pytest.raises(ProcessLookupError):
        os.kill(lane_pid, 0)
    # a crash (SIGKILL of everything) leaves segments and sockets: the next start reclaims them
    d = Daemon(tiny_model_path, rt, cards="cpu").start()
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    d.proc = None
    stale = shm.Segment(shm.prefix_for(rt) + "lane7-slots", 4096, create=True)
    stale.owner = False
    stale.close()
    assert d.leftovers()
    d.start()
    assert "reclaimed leftovers" in d.log_text()
    assert not any("lane7" in p for p in d.leftovers())
    with d.client() as c:
        assert c.generate(messages=CHAT_B, max_tokens=3).result() is not None
    d.stop()
    assert d.leftovers() == []


def test_second_daemon_on_the_same_runtime_dir_is_refused(daemon):
    rt = daemon.runtime_dir
    before = sorted(p.name for p in rt.iterdir()), daemon.leftovers()
    r = run_serve(["--model", str(daemon.model), "--cards", "cpu", "--runtime-dir", str(rt)])
    assert r.returncode == 2 and "another stratad" in r.stderr
    # the refused one leaves the running daemon's lock, pid file, sockets and segments alone, and it still serves
    assert (sorted(p.name for p in rt.iterdir()), daemon.leftovers()) == before
    assert {"stratad.lock", "stratad.pid", "client.sock", "lanes.sock"} <= set(before[0])
    with daemon.client() as c:
        assert c.generate(messages=CHAT_A, max_tokens=2).result() is not None


def test_runtime_dir_lock(tmp_path, monkeypatch):
    """RuntimeDir: a refused acquire touches nothing of the holder's; release leaves the directory empty (the lock
    file unlinked while still held); a lock won on a file a release unlinked meanwhile is dropped and taken again
    on the file at the path (else two daemons could each hold a lock of their own)."""
    import fcntl

    from coordinator import runtime
    from coordinator.runtime import RuntimeDir, RuntimeDirError

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    rt = tmp_path / "run"
    a = RuntimeDir(rt)
    a.acquire()
    (rt / "client.sock").touch()
    held = sorted(p.name for p in rt.iterdir())
    b = RuntimeDir(rt)
    with pytest.raises(RuntimeDirError, match="another stratad"):
        b.acquire()
    b.release()  # what a refused start's close() does
    assert sorted(p.name for p in rt.iterdir()) == held == ["client.sock", "stratad.lock", "stratad.pid"]
    a.release()
    assert list(rt.iterdir()) == []
    # a release between a starter's open and its flock: the starter locks the unlinked file, sees it, retries
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            (rt / "stratad.lock").unlink()
        return real_flock(fd, op)

    monkeypatch.setattr(runtime.fcntl, "flock", flock)
    c = RuntimeDir(rt)
    c.acquire()
    assert len(calls) == 2 and os.fstat(c._lock_fd).st_ino == os.stat(rt / "stratad.lock").st_ino
    with pytest.raises(RuntimeDirError):
        RuntimeDir(rt).acquire()
    c.release()
    assert list(rt.iterdir()) == []


@pytest.mark.parametrize("what", ["a file", "under a file", "socket a directory", "lock a directory"])
def test_a_runtime_dir_that_cannot_be_taken_is_named(tiny_model_path, tmp_path, what):
    """`stratad serve --runtime-dir X` where X is a file, lies under one, or holds a directory where its socket or
    lock goes: exit 2 with one line naming it (each was a traceback), and nothing of the daemon's left there."""
    rt = tmp_path / "run"
    if what in ("a file", "under a file"):
        rt.write_text("not a directory\n")
        rt = rt / "sub" if what == "under a file" else rt
    else:
        (rt / ("client.sock" if what == "socket a directory" else "stratad.lock")).mkdir(parents=True)
    before = sorted(tmp_path.rglob("*"))
    r = subprocess.run([sys.executable, "-m", "stratad.cli", "serve", "--model", str(tiny_model_path), "--cards",
                        "cpu", "--runtime-dir", str(rt)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert str(rt.parent if what == "under a file" else rt) in line, line
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("setting,problem", [
    ("api_key_file = '{d}/nokey'", "api_key_file = '{d}/nokey': the HTTP gateway cannot read its key (No such file"),
    ("api_key_file = '{d}/empty'", "api_key_file = '{d}/empty': the HTTP gateway cannot read its key (api_key_file "),
    ("api_key_file = '{d}'", "api_key_file = '{d}': the HTTP gateway cannot read its key (Is a directory)"),
    ("curve_secret_key_file = '{d}/nokey'\ncurve_authorized_dir = '{d}'", "curve_secret_key_file {d}/nokey: "),
    ("curve_secret_key_file = '{d}/empty'\ncurve_authorized_dir = '{d}'", "curve_secret_key_file {d}/empty: "),
    ("curve_secret_key_file = '{d}/empty'\ncurve_authorized_dir = '{d}/nodir'",
     "curve_authorized_dir {d}/nodir is not a directory")])
def test_a_key_file_that_cannot_be_read_stops_the_start(tiny_model_path, tmp_path, setting, problem):
    """The gateway's API key and the TCP listener's CURVE keys, missing, empty or a directory: `stratad serve` exits
    2 with one line naming the setting before any lane starts (a missing CURVE file was a traceback; a bad API
    key file left a daemon whose gateway exited and was restarted for ever), and leaves the runtime dir empty."""
    (tmp_path / "empty").write_text("")
    from stratad.gateway.local_client import free_port

    port = free_port()
    listener = f"http = '127.0.0.1:{port}'" if setting.startswith("api") else f"tcp = 'tcp://127.0.0.1:{port}'"
    cfg = tmp_path / "c.toml"
    cfg.write_text(listener + "\n" + setting.format(d=tmp_path) + "\n")
    rt = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "stratad.cli", "serve", "--config", str(cfg), "--model",
                        str(tiny_model_path), "--cards", "cpu", "--runtime-dir", str(rt)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "lane 0" not in r.stderr, r.stderr
    (error,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert error.startswith("error: " + problem.format(d=tmp_path)), error
    assert not rt.exists() or list(rt.iterdir()) == []


def test_curve_tcp_listener(tiny_model_path, tmp_path):
    import zmq.auth

    keys = tmp_path / "keys"
    authorized = tmp_path / "authorized"
    keys.mkdir()
    authorized.mkdir()
    server_pub, server_sec = zmq.auth.create_certificates(keys, "server")
    client_pub, client_sec = zmq.auth.create_certificates(keys, "client")
    os.rename(client_pub, authorized / "client.key")
    port = 25000 + os.getpid() % 5000
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'tcp = "tcp://127.0.0.1:{port}"\ncurve_secret_key_file = "{server_sec}"\n'
                   f'curve_authorized_dir = "{authorized}"\n')
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu", config=cfg).start()
    try:
        spub, _ = zmq.auth.load_certificate(server_pub)
        cpub, csec = zmq.auth.load_certificate(client_sec)
        with Client(endpoint=f"tcp://127.0.0.1:{port}", timeout_s=10, curve_server_key=spub,
                    curve_keypair=(cpub, csec)) as c:
            assert c.status().lanes
        intruder_pub, intruder_sec = zmq.curve_keypair()
        with Client(endpoint=f"tcp://127.0.0.1:{port}", timeout_s=2, curve_server_key=spub,
                    curve_keypair=(intruder_pub, intruder_sec)) as c:
            with pytest.raises(DaemonUnavailable):
                c.status()
        plain = zmq.Context().socket(zmq.DEALER)
        plain.connect(f"tcp://127.0.0.1:{port}")
        plain.send(encode(M.StatusRequest()))
        assert not plain.poll(1500)  # an unauthenticated client gets nothing
        plain.close(0)
    finally:
        d.stop()


def test_full_queue_is_refused_and_nothing_accepted_is_lost(tiny_model_path, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("queue_limit = 1\n")
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu", config=cfg).start()
    try:
        with d.client() as c:
            running = c.generate(messages=CHAT_A, max_tokens=60)
            next(iter(running))
            queued = c.generate(messages=CHAT_B, max_tokens=5)
            assert queued.wait_accepted().queue_position == 1
            with pytest.raises(RequestError) as e:
                c.generate(messages=CHAT_B, max_tokens=5).result()
            assert e.value.code == M.ErrorCode.QUEUE_FULL and "queue is full" in e.value.message
            running.result()
            assert queued.result() is not None and queued.finish_reason in ("length", "stop")
    finally:
        d.stop()


def test_lane_that_cannot_start_is_given_up_with_a_clear_error(tiny_model_path, tmp_path):
    """A GPU card on a machine without one: the lane fails at start and says why (no CuPy, or no such device);
    after a few tries the daemon gives up with that reason."""
    r = run_serve(["--model", str(tiny_model_path), "--cards", "7", "--runtime-dir", str(tmp_path / "rt")], timeout=60)
    assert r.returncode == 3
    assert "failed to start 3 times" in r.stderr and "no lane could be started" in r.stderr
    try:
        import cupy  # noqa: F401
        reason = "card 7: "
    except ImportError:
        reason = "card 7 is a GPU card but CuPy is not installed"
    assert f"lane 0 exited with status 5: {reason}" in r.stderr, r.stderr[-2000:]
    assert not list(shm.SHM_DIR.glob(shm.prefix_for(tmp_path / "rt").lstrip("/") + "*"))


def test_lane_says_when_its_card_runs_out_of_memory(tiny_model_path):
    """A GPU card whose expert slots and workspaces do not fit: the lane's reason names the sizes and the settings
    that shrink them."""
    import lane.main

    from stratad.config import LaneConfig, load

    a = LaneConfig.for_lane(load(None, {"model": "m", "prompt_chunk": 2048}), lane=0, card="1",
                            endpoint="ipc:///tmp/x", model="m", model_hash="h", shm_prefix="/p",
                            context_length=65536, cpu_threads=1)
    oom = type("OutOfMemoryError", (MemoryError,), {})("Out of memory allocating 1,073,741,824 bytes")
    why = lane.main.card_failure(a, M.Placement(epoch=0, n_slots=40, experts=()), ModelFile(tiny_model_path), oom)
    assert why.startswith("card 1: out of GPU memory building the lane (40 expert slots")
    assert "65536 tokens" in why and "2048 tokens" in why
    assert "lower expert_cache (or set it to auto), context_length or prompt_chunk" in why
    fit = lane.main.card_failure(a, M.Placement(epoch=0, n_slots=40, experts=(), fit=True), ModelFile(tiny_model_path),
                                 oom)  # expert_cache = auto: nothing but the card's own needs was allocated
    assert fit.startswith("card 1: out of GPU memory building the lane before any expert slot")
    assert "65536 tokens" in fit and "lower context_length or prompt_chunk" in fit


@pytest.mark.parametrize("content,problem", [(None, "cannot read it (FileNotFoundError"),
                                               (b"", "cannot read it (EOFError"),
                                               (np.ones((2, 3)), "float64 of shape (2, 3), expected (4, 16)")])
def test_a_configured_profile_that_cannot_be_used_stops_the_start(tiny_model_path, tmp_path, content, problem):
    """profile = FILE (a starting expert profile the operator chose) that is missing, unreadable or of another
    shape: exit 2 with one line naming it (a missing or empty file was a traceback)."""
    prof = tmp_path / "p.npy"
    if isinstance(content, bytes):
        prof.write_bytes(content)
    elif content is not None:
        np.save(prof, content)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"profile = '{prof}'\n")
    r = subprocess.run([sys.executable, "-m", "stratad.cli", "serve", "--config", str(cfg), "--model",
                        str(tiny_model_path), "--cards", "cpu", "--runtime-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (error,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert error.startswith(f"error: profile {prof}: ") and problem in error, error


def test_learned_profile_kept_between_runs(tiny_model_path, tmp_path):
    """With state_dir, a graceful stop saves what the cards learned; the next start fills the caches from it (no
    warm-up), and status says where the profile came from. A file that does not fit, or that numpy cannot
    read (an empty one, a damaged header), is ignored, not fatal."""
    state = tmp_path / "state"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{state}"\nprofile_save_s = 3600.0\n')
    d = Daemon(tiny_model_path, tmp_path / "run1", cards="cpu", config=cfg).start()
    try:
        assert d.status().profile == "routing warm-up"
        with d.client() as c:
            c.generate(prompt="Learn which experts this traffic uses.", max_tokens=12).result()
    finally:
        assert d.stop() == 0
    saved = list(state.glob("profile-*.npy"))
    assert len(saved) == 1 and not list(state.glob("*.tmp"))
    p = np.load(saved[0])
    m = ModelFile(tiny_model_path)
    assert p.shape == (m.config.n_layer, m.config.n_expert) and p.sum() == pytest.approx(1.0) and (p > 0).any()

    d = Daemon(tiny_model_path, tmp_path / "run2", cards="cpu", config=cfg).start()
    try:
        assert d.status().profile == f"saved {saved[0]}"
        assert "routing warm-up" not in d.log_text()
    finally:
        d.stop()

    for run, data in (("run3", None), ("run4", b"")):  # another model's shape; an empty file (numpy: EOFError)
        np.save(saved[0], np.ones((2, 3))) if data is None else saved[0].write_bytes(data)
        d = Daemon(tiny_model_path, tmp_path / run, cards="cpu", config=cfg).start()  # ignored with a warning
        try:
            assert d.status().profile == "routing warm-up"
            assert "starting without it" in d.log_text()
        finally:
            d.stop()

