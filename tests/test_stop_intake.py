"""A stop (SIGTERM) of the real daemon (one CPU card, tiny model) with a client's messages waiting in the intake behind
its big frames, which the intake worker is still tokenising: every message gets its answer, in the client's order.
A request is refused shutting_down with its req_id where it is known (a small frame's; a big frame the worker has
decoded by the end of the stop, or still in the worker: read off its head), a status request is answered with the
status, a cancel as ever. Before, the stop dropped the status request and the cancel, and refused big frames with no
req_id even once the worker had decoded them."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest

from daemon_harness import Daemon, raw_socket
from protos import messages as M
from protos.codec import decode, encode
from stratad.client import RequestError
from stratad.prompts import HEAVY_BYTES

SLOW = 2  # big frames of 400 KB of text (under the tiny model's byte bound): ~0.2 s each in the worker; too long
# for the context (8192 tokens) once tokenised, which the coordinator checks after a stop's refusal


def frames() -> list[tuple[str | None, bytes]]:
    """(req_id or None, frame) of what the client sends, in order."""
    out = [(f"slow{i}", encode(M.Generate(req_id=f"slow{i}", prompt="word " * 80000,
                                          sampling=M.Sampling(max_tokens=4)))) for i in range(SLOW)]
    # a request that fits: its token ids make it a big frame (35 KB), prepared by the worker at once
    out.append(("big-ok", encode(M.Generate(req_id="big-ok", tokens=(1000,) * 7000, sampling=M.Sampling(max_tokens=4)))))
    out.append((None, encode(M.StatusRequest())))
    out.append(("small", encode(M.Generate(req_id="small", tokens=(5, 6, 7), sampling=M.Sampling(max_tokens=4)))))
    out.append(("nothing", encode(M.Cancel(req_id="nothing"))))
    assert all(len(f) > HEAVY_BYTES for _, f in out[:SLOW + 1]) and all(len(f) < HEAVY_BYTES for _, f in out[SLOW + 1:])
    return out


def answers_until_exit(d: Daemon, s, timeout_s: float) -> list:
    """What comes on s until the daemon has exited (within timeout_s) and nothing more came for 0.3 s."""
    got, deadline, quiet_since = [], time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if s.poll(100):
            got.append(decode(s.recv(), M.CoordinatorToClient))
            quiet_since = None
        elif d.proc.poll() is not None:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 0.3:
                break
    return got


def stop_with_the_intake_full(d: Daemon, stream=None) -> list:
    """Sends frames() on a bare socket, SIGTERMs the coordinator once it has them, returns the answers."""
    ctx, s = raw_socket(d)
    try:
        sent = frames()
        for _, f in sent:
            s.send(f)
        time.sleep(0.1)  # read by the coordinator (a few ms): the slow frames are still in the worker
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        if stream is not None:
            with pytest.raises(RequestError) as e:
                for _ in stream:
                    pass
            assert e.value.code == M.ErrorCode.SHUTTING_DOWN
        got = answers_until_exit(d, s, 10.0)
        try:
            rc = d.proc.wait(1)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0  # a slow stop shows its log: where the time went (once > 11 s on a loaded box)
        assert rc == 0 and took < 10, (rc, took, d.log_text()[-4000:])
        d.proc = None
    finally:
        ctx.destroy(linger=0)
    assert len(got) == len(sent), got  # each answered once
    for (req_id, _), msg in zip(sent[:SLOW + 2], got):  # the big frames, the status request
        if req_id is None:
            assert isinstance(msg, M.Status), msg
            continue
        assert isinstance(msg, M.Error) and msg.req_id == req_id, (req_id, msg)
        if msg.code == M.ErrorCode.PROMPT_TOO_LONG:  # tokenised and handled before the SIGTERM
            assert msg.req_id == req_id and req_id != "big-ok", msg
        else:
            assert msg.code == M.ErrorCode.SHUTTING_DOWN and msg.message == "the daemon is stopping", msg
    small, cancel = got[-2:]
    assert isinstance(small, M.Error) and (small.req_id, small.code) == ("small", M.ErrorCode.SHUTTING_DOWN), small
    assert isinstance(cancel, M.Error) and (cancel.req_id, cancel.code) == ("nothing", M.ErrorCode.UNKNOWN_REQUEST)
    log = d.log_text()
    assert "Traceback" not in log, log[-3000:]
    assert "lanes stopped" in log and "stopped: everything released" in log, log[-3000:]
    assert d.leftovers() == []
    return got


def config(tmp_path, grace: float):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"stop_grace_s = {grace}\n")
    return cfg


def test_a_stop_with_idle_lanes_answers_everything_in_the_intake(tiny_model_path, tmp_path):
    """Nothing runs: the stop ends at once, with the slow frames still in the worker (refused with the req_id on their
    heads)."""
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu", config=config(tmp_path, 3.0)).start()
    try:
        got = stop_with_the_intake_full(d)
    finally:
        if d.proc is not None:
            d.stop()
    assert (got[SLOW].req_id, got[SLOW].code) == (frames()[SLOW][0], M.ErrorCode.SHUTTING_DOWN)  # behind the slow ones


def test_a_stop_waiting_for_a_stream_answers_prepared_frames_with_their_req_id(tiny_model_path, tmp_path):
    """A stream runs: the stop waits stop_grace_s (3 s) for it, and meanwhile the worker finishes the big frames
    (about 0.5 s): each is refused shutting_down with its req_id (the slow ones' length is checked after that)."""
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu", config=config(tmp_path, 3.0)).start()
    try:
        with d.client(stream_timeout_s=30) as c:
            stream = c.generate(tokens=[5, 6, 7], max_tokens=6000, ignore_eos=True)
            it = iter(stream)
            next(it)
            got = stop_with_the_intake_full(d, it)
    finally:
        if d.proc is not None:
            d.stop()
    for (req_id, _), msg in zip(frames()[:SLOW + 1], got):
        assert (msg.req_id, msg.code) == (req_id, M.ErrorCode.SHUTTING_DOWN), msg
