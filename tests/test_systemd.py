"""The systemd unit: verified by systemd-analyze where it is installed; the sd_notify protocol spoken for real."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_harness import ROOT
from stratad import sd_notify

UNIT = ROOT / "systemd" / "stratad.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies(tmp_path):
    exe = Path(sys.executable).with_name("stratad")
    text = UNIT.read_text().replace("/opt/stratad/.venv/bin/stratad", str(exe))
    unit = tmp_path / "stratad.service"
    unit.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "stratad.service" not in r.stderr, r.stderr


def test_unit_declares_notify_watchdog_and_runtime_dir():
    text = UNIT.read_text()
    for line in ("Type=notify", "WatchdogSec=", "RuntimeDirectoryMode=0700", "KillSignal=SIGTERM",
                 "ExecStart=/opt/stratad/.venv/bin/stratad serve --config /etc/stratad/stratad.toml"):
        assert line in text


def test_sd_notify_sends_datagrams(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sd_notify.notify("READY=1")
    assert srv.recv(100) == b"READY=1"
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sd_notify.watchdog_interval_s() == 15.0
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not sd_notify.notify("READY=1")
    srv.close()


def test_default_config_is_valid():
    from stratad import config

    cfg = config.load(str(ROOT / "systemd" / "stratad.toml"), {})
    assert cfg.runtime_dir == "/run/stratad" and cfg.expert_cache.auto
    assert cfg.http == "127.0.0.1:8080" and cfg.api_key_file is None  # `systemctl start stratad` brings the gateway up
