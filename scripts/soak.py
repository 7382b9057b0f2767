"""Soak: hours of mixed traffic and faults against a daemon this script starts (CPU cards unless --cards).

Several clients stream (some cancel, some disconnect mid-stream, some stop reading), one sends bad frames, and a
fault thread SIGKILLs a random lane now and then; after each fault it checks that status answers and that a
reference greedy generation is unchanged. Prints a JSON summary (counts of what each kind of client saw, the
checks, the coordinator's RSS). Not part of CI.

    python scripts/soak.py --model tiny.gguf --minutes 5
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protos import messages as M  # noqa: E402
from protos.codec import encode  # noqa: E402
from stratad.client import DaemonUnavailable, RequestError  # noqa: E402
from stratad.local_daemon import LocalDaemon  # noqa: E402

PROMPTS = ["Why is the sky blue?", "Tell me about the experts on the cards.", "Write a poem about shared memory.",
           "What does a lane do when its card is busy?"]
REFERENCE = dict(prompt="The reference generation, greedy.", max_tokens=16, ignore_eos=True)
BAD_FRAMES = [b"[" * 5000, b"\xff\xfe", b'{"type":"generate"}', b'{"v":2,"type":"status_request"}', b"9" * 100000,
              b'{"type":"generate","req_id":"x","tokens":[1e999]}']


class Soak:
    def __init__(self, d: LocalDaemon, until: float, seed: int):
        self.d, self.until, self.rng = d, until, random.Random(seed)
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.lock = threading.Lock()
        self.failures: list[str] = []
        self.max_rss = 0

    def count(self, who: str, what: str) -> None:
        with self.lock:
            self.counts[who][what] += 1

    def reference(self) -> list[int]:
        with self.d.client(timeout_s=10, stream_timeout_s=60) as c:
            s = c.generate(**REFERENCE)
            s.result()
            return s.tokens

    def check(self, why: str, want: list[int]) -> None:
        """After a fault: status answers (lanes back) and the reference generation gives the same tokens."""
        try:
            self.d.wait_ready(60)
            got = self.reference()
            self.count("checks", "ok" if got == want else "changed")
            if got != want:
                self.failures.append(f"after {why}: reference tokens changed")
        except Exception as e:  # noqa: BLE001 - a failed check is the soak's finding, not its end
            self.count("checks", "failed")
            self.failures.append(f"after {why}: {type(e).__name__}: {e}")

    def streamer(self, kind: str) -> None:
        while time.monotonic() < self.until:
            try:
                with self.d.client(timeout_s=10, stream_timeout_s=60) as c:
                    n = self.rng.randint(8, 400)
                    s = c.generate(prompt=self.rng.choice(PROMPTS), max_tokens=n, temperature=0.7,
                                   seed=self.rng.randint(0, 1000))
                    stop_at = self.rng.randint(1, n)
                    for i, _ in enumerate(s):
                        if kind == "canceller" and i == stop_at:
                            s.cancel()
                        if kind == "disconnector" and i == stop_at:
                            s.close()
                            break
                    self.count(kind, s.finish_reason or "disconnected")
            except RequestError as e:
                self.count(kind, e.code.value)
            except DaemonUnavailable as e:
                self.count(kind, "unavailable")
                self.failures.append(f"{kind}: {e}")

    def slow_reader(self) -> None:
        """Starts a long stream and never reads it: the daemon must cut it off (client_too_slow), not wait."""
        while time.monotonic() < self.until:
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.connect(f"ipc://{self.d.runtime_dir / 'client.sock'}")
            s.send(encode(M.Generate(req_id=f"slow{self.rng.random()}", prompt=self.rng.choice(PROMPTS),
                                     sampling=M.Sampling(max_tokens=4000, ignore_eos=True))))
            time.sleep(self.rng.uniform(5, 20))
            ctx.destroy(linger=0)
            self.count("slow_reader", "abandoned")

    def bad_frames(self) -> None:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(f"ipc://{self.d.runtime_dir / 'client.sock'}")
        while time.monotonic() < self.until:
            s.send_multipart([self.rng.choice(BAD_FRAMES)] * self.rng.choice([1, 1, 2]))
            self.count("bad_frames", "answered" if s.poll(10000) and s.recv_multipart() else "unanswered")
            time.sleep(self.rng.uniform(0.05, 0.5))
        ctx.destroy(linger=0)

    def faults(self, want: list[int]) -> None:
        while time.monotonic() < self.until:
            time.sleep(self.rng.uniform(10, 30))
            try:
                lanes = self.d.status().lanes
            except Exception as e:  # noqa: BLE001
                self.failures.append(f"status before a fault: {e}")
                continue
            victim = self.rng.choice(lanes)
            if victim.pid:
                try:
                    os.kill(victim.pid, signal.SIGKILL)
                except ProcessLookupError:  # it exited between the status and the kill (a restart under way)
                    self.count("faults", "lane_already_gone")
                    continue
                self.count("faults", "lane_sigkill")
                self.check(f"SIGKILL of lane {victim.lane}", want)

    def rss(self) -> None:
        p = psutil.Process(self.d.proc.pid)
        while time.monotonic() < self.until:
            self.max_rss = max(self.max_rss, p.memory_info().rss)
            time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cards", default="cpu,cpu")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rt = Path(tempfile.mkdtemp(prefix="stratad-soak-"))
    cfg = rt / "soak.toml"  # a small client queue, so that the slow readers are cut off within their stall
    cfg.write_text("client_queue_messages = 256\n")
    d = LocalDaemon(a.model, a.cards, rt / "run", config=cfg, log=rt / "daemon.log").start()
    soak = Soak(d, time.monotonic() + a.minutes * 60, a.seed)
    t0 = time.monotonic()
    try:
        want = soak.reference()
        rss0 = psutil.Process(d.proc.pid).memory_info().rss
        workers = [threading.Thread(target=soak.streamer, args=(k,)) for k in ("reader", "canceller", "disconnector")]
        workers += [threading.Thread(target=f) for f in (soak.slow_reader, soak.bad_frames, soak.rss)]
        workers.append(threading.Thread(target=soak.faults, args=(want,)))
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        soak.check("the run", want)
        rss_end = psutil.Process(d.proc.pid).memory_info().rss
    finally:
        t_stop = time.monotonic()
        rc = d.stop()
        stop_s = time.monotonic() - t_stop
    log = (rt / "daemon.log").read_text(errors="replace")
    print(json.dumps({
        "minutes": round((time.monotonic() - t0) / 60, 2), "cards": a.cards,
        "clients": {k: dict(v) for k, v in soak.counts.items()}, "failures": soak.failures[:20],
        "n_failures": len(soak.failures), "rss_mb": {"start": rss0 >> 20, "max": soak.max_rss >> 20,
                                                     "end": rss_end >> 20},
        "stop": {"exit_status": rc, "seconds": round(stop_s, 2)}, "tracebacks_in_log": log.count("Traceback"),
        "cut_off_clients": log.count("stopped reading its replies"), "log": str(rt / "daemon.log")}, indent=1))
    return 0 if not soak.failures and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
