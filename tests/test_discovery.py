"""How stratactl and the client find a daemon: $STRATAD_RUNTIME_DIR for both, a daemon started with another runtime
dir found through the user's registry, options after the subcommand, and an error that names every place looked."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_harness import Daemon
from stratad import ctl, discovery, shm
from stratad.client import Client, DaemonUnavailable
from stratad.config import default_runtime_dir


@pytest.fixture
def session(tmp_path, monkeypatch):
    """This user's session, as far as finding a daemon goes: its own XDG_RUNTIME_DIR, no STRATAD_RUNTIME_DIR."""
    if (Path(default_runtime_dir()) / "client.sock").exists():
        pytest.skip("a daemon is running in the default runtime dir: it would be found first")
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.delenv(discovery.ENV, raising=False)
    return xdg


def serve(model: Path, rt: Path, log: Path) -> subprocess.Popen:
    """`stratad serve` told its runtime dir only by STRATAD_RUNTIME_DIR; returns once it answers."""
    proc = subprocess.Popen([sys.executable, "-m", "stratad.cli", "serve", "--model", str(model), "--cards", "cpu",
                             "--http", ""],
                            env=dict(os.environ, **{discovery.ENV: str(rt)}), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            with Client(runtime_dir=str(rt), timeout_s=2) as c:
                if all(ln.role.value not in ("starting", "down") for ln in c.status().lanes):
                    return proc
        except DaemonUnavailable:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError(log.read_text())


def test_stratactl_finds_a_daemon_started_with_another_runtime_dir(tiny_model_path, tmp_path, session, capsys):
    rt = tmp_path / "st"
    proc = serve(tiny_model_path, rt, tmp_path / "serve.log")
    try:
        assert (rt / "client.sock").exists()  # the daemon took STRATAD_RUNTIME_DIR
        assert discovery.lookup().path == rt.resolve()
        for argv in (["status", "--json"], ["--json", "status"], ["status", "--runtime-dir", str(rt), "--json"]):
            assert ctl.main(argv) == 0, argv
            assert [ln["card"] for ln in json.loads(capsys.readouterr().out)["lanes"]] == ["cpu"]
        with Client() as c:  # the client library's default finds it the same way
            assert len(c.status().lanes) == 1 and c.runtime_dir == rt.resolve()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert list((session / "stratad.daemons").iterdir()) == []  # a clean stop takes its record away
    assert ctl.main(["status"]) == 3
    err = capsys.readouterr().err
    for place in (f"{discovery.ENV} is not set", f"{Path(default_runtime_dir()) / 'client.sock'}",
                  f"no running daemon registered in {session / 'stratad.daemons'}"):
        assert place in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(DaemonUnavailable, match="no running stratad found: .*no running daemon registered"):
        with Client() as c:  # the library names the places it looked too
            c.status()


def fake_daemon(rt: Path, pid: int) -> None:
    """What a running daemon leaves for discovery: its pid file and client socket in rt, its record."""
    rt.mkdir(parents=True)
    (rt / "stratad.pid").write_text(f"{pid}\n")
    (rt / "client.sock").touch()
    reg = discovery.registry_dir()
    reg.mkdir(parents=True, exist_ok=True)
    (reg / str(pid)).write_text(f"{rt}\n")


def test_dead_records_are_skipped_and_several_daemons_are_named_not_picked(tmp_path, session, monkeypatch):
    dead = subprocess.Popen(["true"])
    dead.wait()
    fake_daemon(tmp_path / "gone", dead.pid)  # killed without its stop: record, pid file and socket left
    assert discovery.lookup().path is None
    live = subprocess.Popen(["sleep", "60"])
    try:
        fake_daemon(tmp_path / "a", live.pid)
        assert discovery.lookup().path == tmp_path / "a"
        record = discovery.register(tmp_path / "b")  # this process as a second daemon
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "stratad.pid").write_text(f"{os.getpid()}\n")
        (tmp_path / "b" / "client.sock").touch()
        assert discovery.dead_records() == [(discovery.registry_dir() / str(dead.pid), tmp_path / "gone")]
        found = discovery.lookup()
        assert found.path is None
        assert f"2 daemons registered in {discovery.registry_dir()}, none picked: {tmp_path / 'a'}, " \
               f"{tmp_path / 'b'}" in found.message()
        discovery.unregister(record)
        assert discovery.lookup().path == tmp_path / "a"
        monkeypatch.setenv(discovery.ENV, str(tmp_path / "b"))  # the session's variable wins
        assert discovery.lookup().path == tmp_path / "b"
    finally:
        live.kill()
        live.wait()


def test_a_start_reclaims_what_a_killed_daemon_left_in_another_runtime_dir(tiny_model_path, tmp_path, session):
    """A daemon killed outright leaves its segments in /dev/shm and its record; its runtime dir may be gone (a
    test's or a script's temporary one), so no start there will reclaim them: the next daemon's start does,
    whatever its own directory. A daemon still running elsewhere keeps its segments."""
    def segments(rt):
        return sorted(p.name for p in shm.SHM_DIR.glob(shm.prefix_for(rt).lstrip("/") + "*"))

    killed, running, fresh = (Daemon(tiny_model_path, tmp_path / n, cards="cpu") for n in ("killed", "running", "new"))
    killed.start()
    running.start()
    try:
        os.killpg(killed.proc.pid, signal.SIGKILL)
        killed.proc.wait()
        killed.proc = None
        left = segments(killed.runtime_dir)
        assert left and len(discovery.dead_records()) == 1
        shutil.rmtree(killed.runtime_dir)
        kept = segments(running.runtime_dir)
        fresh.start()
        try:
            assert segments(killed.runtime_dir) == [] and discovery.dead_records() == []
            assert all(name in fresh.log_text() for name in left)  # named in its "reclaimed leftovers" line
            assert segments(running.runtime_dir) == kept
            assert running.status().lanes  # and it serves on
        finally:
            assert fresh.stop() == 0
    finally:
        assert running.stop() == 0
    assert segments(running.runtime_dir) == [] and segments(fresh.runtime_dir) == []
