"""Stopping the real daemon (two CPU cards, tiny model) as systemd does (SIGTERM to the coordinator) and as Ctrl-C
does (SIGINT to the whole process group) with its lanes idle, generating, and one reading a long prompt while the
other writes a finished request's KV to the host cache: each time exit 0, no traceback in the log, every lane gone
by itself (lane/stop.py), nothing left behind (segments, sockets, the runtime dir's files, child processes)."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from daemon_harness import Daemon
from protos import messages as M
from stratad.client import RequestError
from stratad.model.generated_vocab import warmup_text

STATES = ("idle", "generating", "prompt_and_kv_write")


def tokens(model, n: int) -> list[int]:
    ids = model.tokenizer.encode(warmup_text())
    return (ids * (n // len(ids) + 1))[:n]


def make_busy(d: Daemon, c, state: str, model) -> list:
    """Puts the lanes in `state`; the streams left open (each must end with shutting_down)."""
    if state == "generating":
        streams = [c.generate(tokens=tokens(model, 20 + i), max_tokens=5000, ignore_eos=True) for i in range(2)]
        for s in streams:
            next(iter(s))
        assert all(ln.req_id for ln in d.status().lanes)
        return streams
    if state == "prompt_and_kv_write":
        long = c.generate(tokens=tokens(model, 6000), max_tokens=4)  # read in 1024-token chunks
        deadline = time.monotonic() + 10
        while not any(ln.req_id == long.req_id for ln in d.status().lanes) and time.monotonic() < deadline:
            time.sleep(0.02)
        short = c.generate(tokens=tokens(model, 400)[::-1], max_tokens=1)
        short.result()  # its Done is sent before its lane writes the sequence's 25 new blocks to the host cache
        return [long]
    return []


def running(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of procs still running after up to timeout_s (psutil.wait_procs took 1.6 s for processes gone at once)."""
    def runs(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in procs if runs(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


def stop_in(d: Daemon, state: str, sig: signal.Signals, model) -> None:
    d.start()
    children = psutil.Process(d.proc.pid).children(recursive=True)  # lanes, the intake worker, its resource tracker
    assert len(children) >= 3
    log_from = len(d.log_text())
    with d.client(stream_timeout_s=30) as c:
        streams = make_busy(d, c, state, model)
        t0 = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(d.proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: every process of the group gets it
        else:
            d.proc.send_signal(signal.SIGTERM)
        for s in streams:
            with pytest.raises(RequestError) as e:
                s.result()
            assert e.value.code == M.ErrorCode.SHUTTING_DOWN, e.value
    rc = d.proc.wait(10)
    took = time.monotonic() - t0
    d.proc = None
    log = d.log_text()[log_from:]
    assert rc == 0 and took < 5.0, (state, rc, took, log[-3000:])  # no lane waited for and killed (5 s)
    for bad in ("Traceback", "Exception ignored", "KeyboardInterrupt", "at the stop", "did not stop", "restarting"):
        assert bad not in log, (state, bad, log[-3000:])
    assert not running(children, 2.0), state
    assert d.leftovers() == [] and list(d.runtime_dir.iterdir()) == [], state


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stops_leave_nothing_and_no_traceback_whatever_the_lanes_do(tiny_model_path, tiny_model, tmp_path, sig):
    cfg = tmp_path / "c.toml"
    cfg.write_text("stop_grace_s = 0\n")  # the lanes are stopped mid-work, not after it
    d = Daemon(tiny_model_path, tmp_path / "run", config=cfg)
    try:
        for state in STATES:
            stop_in(d, state, sig, tiny_model)
    finally:
        d.stop()


def test_a_stop_while_the_lanes_start_is_clean(tiny_model_path, tmp_path):
    """systemctl stop right after start: SIGTERM as soon as both lanes are spawned (still importing, before their
    handler: they die of it, which is no fault at this point), then again once one lane is ready and the other still
    in its routing warm-up. Exit 0, no warning, nothing left behind."""
    import subprocess

    for when in ("spawned", "one_ready"):
        d = Daemon(tiny_model_path, tmp_path / f"run-{when}")
        with open(d.log, "ab") as out:
            d.proc = subprocess.Popen(d.argv(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        lanes: list[psutil.Process] = []
        while len(lanes) < 2 and time.monotonic() < deadline:
            lanes = [p for p in psutil.Process(d.proc.pid).children() if "lane.main" in " ".join(p.cmdline())]
            time.sleep(0.005)
        assert len(lanes) == 2, d.log_text()
        if when == "one_ready":
            while " ready (" not in d.log_text() and time.monotonic() < deadline:
                time.sleep(0.005)
        d.proc.send_signal(signal.SIGTERM)
        rc = d.proc.wait(10)
        d.proc = None
        log = d.log_text()
        assert rc == 0, (when, rc, log[-3000:])
        assert not any(bad in log for bad in ("Traceback", "WARNING", "ERROR", "restarting")), (when, log[-3000:])
        assert not running(lanes, 2.0), when
        assert d.leftovers() == [] and list(d.runtime_dir.iterdir()) == [], when


def test_a_slow_release_step_is_named_in_the_log(tmp_path, caplog):
    """The coordinator's close() times each release step: one over a second is logged by name (a stop that stalls
    after its lanes have stopped says where), and the steps after it still run."""
    from coordinator.daemon import Coordinator
    from stratad.config import DaemonConfig

    released = []

    class SlowStore:
        def close(self):
            time.sleep(1.1)
            released.append("kv")

    class Io:
        def close(self):
            released.append("io")

    co = Coordinator(DaemonConfig(model=str(tmp_path / "m.gguf"), runtime_dir=str(tmp_path / "run")))
    co.kv_store, co.io = SlowStore(), Io()
    with caplog.at_level("WARNING", logger="stratad.coordinator"):
        co.close()
    assert released == ["kv", "io"]
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert len(slow) == 1 and slow[0].startswith("releasing the host conversation cache took 1."), slow


def test_a_lane_leaving_ignores_a_late_sigterm():
    """A lane that leaves by itself (the coordinator's Shutdown) may get the coordinator's SIGTERM while Python
    finalises, where the interpreter puts each Python-handled signal back to its default action: it exited -15 there
    once (CI). SIGTERMs sent without pause for the lane's whole life, its close and finalisation included: exit 0."""
    import subprocess
    import sys
    code = ("import time; from lane.stop import StopSignal; s = StopSignal(); print('up', flush=True)\n"
            "while not s.set: time.sleep(0.001)\n"
            "s.close()\n")
    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert p.stdout.readline() == b"up\n"
        while p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.0002)
        assert p.wait() == 0
