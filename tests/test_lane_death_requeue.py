"""A lane that dies before it has sent a request anything (here: while it reads a long prompt) loses nothing: the
coordinator queues the request again and another lane serves it from the start, with the tokens an undisturbed
run gives. A lane that dies after streaming fails its request with lane_failed (tests/test_daemon.py)."""
from __future__ import annotations

import os
import signal
import time

from daemon_harness import Daemon

WORDS = "the lanes read a long prompt in chunks while the coordinator watches them ".split()


def test_lane_killed_before_its_first_token_requeues(tiny_model, tiny_model_path, tmp_path):
    prompt = tiny_model.tokenizer.encode(" ".join(WORDS[i % len(WORDS)] for i in range(3000)))[:2500]
    conf = tmp_path / "d.toml"
    conf.write_text("prefix_cache = false\n")  # each run reads the prompt afresh: the same bits either way
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu,cpu", config=conf).start()
    try:
        with d.client() as c:
            want = c.generate(tokens=prompt, max_tokens=6, ignore_eos=True)
            want.result()
            s = c.generate(tokens=prompt, max_tokens=6, ignore_eos=True)
            deadline = time.monotonic() + 30
            while not (busy := [ln for ln in d.status().lanes if ln.req_id == s.req_id]):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            os.kill(busy[0].pid, signal.SIGKILL)  # still reading the prompt: nothing streamed yet
            s.result()
        assert list(s.tokens) == list(want.tokens) and s.finish_reason == "length"
        assert "queued again" in d.log_text()
        d.wait_ready(30, restarts=1)
    finally:
        d.stop()
