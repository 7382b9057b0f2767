"""The README's foreground flow, as a newcomer types it: `stratad serve ... --runtime-dir X` (the flag, no
STRATAD_RUNTIME_DIR), then a bare `stratactl status` and `stratactl generate` in another shell find that daemon;
Ctrl-C stops it cleanly and takes its registration away."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_harness import ROOT  # noqa: F401 - sets PYTHONPATH for the commands
from stratad import discovery
from stratad.config import default_runtime_dir


def command(name: str) -> list[str]:
    """The installed console script (what the README runs), else its module."""
    script = Path(sys.executable).with_name(name)
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", {"stratad": "stratad.cli", "stratactl": "stratad.ctl"}[name]]


def test_serve_with_runtime_dir_flag_then_bare_stratactl(tiny_model_path, tmp_path):
    if (Path(default_runtime_dir()) / "client.sock").exists():
        pytest.skip("a daemon is running in the default runtime dir: a bare stratactl would find it first")
    xdg = tmp_path / "xdg"  # this shell session's own registry of daemons
    xdg.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != discovery.ENV} | {"XDG_RUNTIME_DIR": str(xdg)}
    rt, log = tmp_path / "st", tmp_path / "serve.log"
    # README: stratad serve --model model.gguf --cards cpu,cpu --runtime-dir /tmp/st --expert-cache 0.5
    # (--http "": no gateway, so that the test does not take port 8080)
    serve = subprocess.Popen(command("stratad") + ["serve", "--model", str(tiny_model_path), "--cards", "cpu,cpu",
                                                   "--runtime-dir", str(rt), "--expert-cache", "0.5", "--http", ""],
                             env=env, cwd=tmp_path, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                             start_new_session=True)

    def stratactl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(command("stratactl") + list(args), env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)

    try:
        deadline = time.monotonic() + 60
        while True:
            assert serve.poll() is None, log.read_text()
            st = stratactl("status")
            if st.returncode == 0 and " starting " not in st.stdout and " down " not in st.stdout:
                break
            assert time.monotonic() < deadline, (st.stdout, st.stderr, log.read_text())
            time.sleep(0.5)
        assert f"model {tiny_model_path}" in st.stdout and st.stdout.count(" cpu ") >= 2, st.stdout
        gen = stratactl("generate", "Why is the sky blue?", "--max-tokens", "4")
        assert gen.returncode == 0 and gen.stdout.strip(), (gen.stdout, gen.stderr)
    finally:
        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C in its terminal
        rc = serve.wait(30)
    assert rc == 0, log.read_text()
    assert list((xdg / "stratad.daemons").iterdir()) == []
    st = stratactl("status")
    assert st.returncode == 3 and "no running stratad found" in st.stderr, (st.stdout, st.stderr)
