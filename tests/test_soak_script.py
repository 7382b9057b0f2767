"""scripts/soak.py's own accounting (no daemon): a client thread that meets an exception it did not expect is a
failure of the soak, not a thread that dies silently; an oversized request answered with something other than an
Error is a failure naming what came."""
from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest

from protos import messages as M
from protos.codec import encode

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def soak(monkeypatch):
    spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "big_requests", lambda: {"content": b"{}"})  # not the 35 MB of real frames
    return mod, mod.Soak(None, time.monotonic() + 60, 0, ["lane_sigkill"])


def test_a_thread_that_raises_is_a_failure(soak):
    _, s = soak

    def broken():
        raise AttributeError("'Accepted' object has no attribute 'code'")

    t = threading.Thread(target=s.guarded("oversized", broken))
    t.start()
    t.join(10)
    assert s.counts["threads"]["oversized_died"] == 1
    (f,) = s.failures
    assert "thread oversized died: AttributeError: 'Accepted' object has no attribute 'code'" in f
    assert "Traceback" in f
    s.guarded("fine", lambda: None)()
    assert len(s.failures) == 1


class FakeSocket:
    def __init__(self, reply: bytes):
        self.reply = reply

    def send(self, frame):
        pass

    def poll(self, timeout_ms):
        return True

    def recv(self):
        return self.reply


class FakeContext:
    def destroy(self, linger=0):
        pass


def test_an_oversized_request_accepted_is_a_failure_naming_it(soak, monkeypatch):
    mod, s = soak
    monkeypatch.setattr(mod.time, "sleep", lambda _s: None)
    turns = iter([True, False])
    monkeypatch.setattr(s, "running", lambda: next(turns))
    monkeypatch.setattr(s.rng, "choice", lambda kinds: "content")
    reply = encode(M.Accepted(req_id="big-content", prompt_tokens=5, queue_position=0))
    monkeypatch.setattr(s, "socket", lambda **_: (FakeContext(), FakeSocket(reply)))
    s.oversized()
    (f,) = s.failures
    assert "oversized content: got accepted after" in f and "wanted prompt_too_long" in f, f
    assert s.counts["oversized"]["content:unexpected"] == 1
