"""The HTTP gateway dies with the coordinator that started it (stratad.proc.die_with): a SIGKILLed daemon must not
leave it holding the HTTP address, or the next `stratad serve` with the same config cannot start."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil

from daemon_harness import ROOT, Daemon
from stratad.gateway.launch import listen_socket
from stratad.gateway.local_client import LocalGateway, free_port


def run_py(code: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


def test_die_with_a_parent_already_gone_signals_at_once():
    """A parent that died before the prctl: the child is signalled then (pid 1 stands for the reparented case);
    its own parent named: it lives on."""
    r = run_py("import time\nfrom stratad.proc import die_with\ndie_with(1)\ntime.sleep(20)\n")
    assert r.returncode == -signal.SIGTERM, r.stderr
    r = run_py("import os\nfrom stratad.proc import die_with\nassert die_with(os.getppid())\nprint('alive')\n")
    assert r.returncode == 0 and r.stdout == "alive\n", r.stderr


CHILD = """
import os, signal, sys, time
from stratad.proc import die_with
def on_term(*_):
    open(sys.argv[2], "w").write("SIGTERM")
    os._exit(3)
signal.signal(signal.SIGTERM, on_term)
die_with(int(sys.argv[1]))
print("set", flush=True)
time.sleep(60)
"""
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]], stdout=subprocess.PIPE,
                         text=True)
assert child.stdout.readline() == "set\\n"
print(child.pid, flush=True)
time.sleep(60)
"""


def test_die_with_follows_a_parent_killed_later(tmp_path):
    """The parent SIGKILLed after the child set it up: the child gets SIGTERM (its handler runs: writes a mark,
    exits)."""
    mark = tmp_path / "mark"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(mark)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        child.wait(20)  # the signal comes at once; the bound only tells it from the child's own 60 s (a loaded
        assert time.monotonic() - t0 < 15 and mark.read_text() == "SIGTERM"  # CI box took 2.02 s once)
    finally:
        parent.kill()
        parent.wait()


def test_a_gateway_whose_parent_is_gone_does_not_start(tiny_model_path, tmp_path):
    """--parent-pid naming a process that is not its parent (it died while the gateway started): it exits before
    it listens."""
    port = free_port()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "stratad.gateway", "--runtime-dir", str(tmp_path), "--listen",
                        f"127.0.0.1:{port}", "--model", str(tiny_model_path), "--parent-pid", "1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == -signal.SIGTERM, r.stderr[-2000:]
    assert "listening on" not in r.stderr and time.monotonic() - t0 < 30
    listen_socket(f"127.0.0.1:{port}").close()


def gateway_of(d: Daemon) -> psutil.Process:
    (gw,) = [p for p in psutil.Process(d.proc.pid).children() if "stratad.gateway" in p.cmdline()]
    return gw


def test_a_sigkilled_coordinator_takes_its_gateway_and_frees_the_port(tiny_model_path, tmp_path):
    """The daemon with its gateway on a free port; the coordinator SIGKILLed: within a few seconds no gateway
    process (nor its intake worker) is left, the port binds again, and a daemon with the same config starts and
    its gateway serves there."""
    addr = f"127.0.0.1:{free_port()}"
    http = LocalGateway(int(addr.rpartition(":")[2]))
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu", http=addr)
    procs: list[psutil.Process] = []
    try:
        d.start()
        http.wait_healthy(60)
        gw = gateway_of(d)
        assert gw.cmdline()[gw.cmdline().index("--parent-pid") + 1] == str(d.proc.pid)
        deadline = time.monotonic() + 30  # its intake worker: started with it, before any big body
        while not any("spawn_main" in " ".join(p.cmdline()) for p in gw.children()):
            assert time.monotonic() < deadline, "the gateway's intake worker was not started"
            time.sleep(0.05)
        procs = [gw, *gw.children(recursive=True)]
        d.proc.kill()
        d.proc.wait()
        t0 = time.monotonic()
        _, alive = psutil.wait_procs(procs, timeout=5)
        assert not alive, f"left behind by the killed coordinator: {[p.cmdline() for p in alive]}"
        assert time.monotonic() - t0 < 5
        listen_socket(addr).close()  # as the daemon binds it (SO_REUSEADDR): free
        d.proc = None
        d.start()  # the same runtime dir and http: reclaims the leftovers, binds the address
        http.wait_healthy(60)
        assert gateway_of(d).pid != gw.pid
        assert d.stop() == 0
    finally:
        if d.proc is not None:
            d.stop()
        for p in procs:  # a failed run must not leave the gateway holding the port
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_stopped_gateway_releases_its_worker_quietly(tiny_model_path, tmp_path):
    """SIGTERM to the daemon with its gateway running (its intake worker started with it): exit 0, every process
    gone, and nothing in the log about leaked semaphores or a traceback. uvicorn re-raises the SIGTERM it stopped on
    once it has stopped; with the default action there the gateway's cleanup never ran, and multiprocessing's
    resource tracker reported the worker's queues as leaked at every stop (make demo printed it)."""
    addr = f"127.0.0.1:{free_port()}"
    http = LocalGateway(int(addr.rpartition(":")[2]))
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu", http=addr)
    d.start()
    try:
        http.wait_healthy(60)
        gw = gateway_of(d)
        deadline = time.monotonic() + 30
        while not any("spawn_main" in " ".join(p.cmdline()) for p in gw.children()):
            assert time.monotonic() < deadline, "the gateway's intake worker was not started"
            time.sleep(0.05)
        procs = [gw, *gw.children(recursive=True)]
    finally:
        assert d.stop() == 0
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, [p.cmdline() for p in alive]
    log = d.log_text()
    assert "leaked" not in log and "Traceback" not in log, log[-3000:]
