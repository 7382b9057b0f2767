"""Soak: hours of mixed traffic and faults against a daemon this script starts (CPU cards unless --cards).

Clients: streamers (one Client each, kept across daemon restarts: some read to the end, some cancel, some disconnect
mid-stream), a slow reader that stops reading (cut off: client_too_slow), a client sending bad frames, one sending
oversized requests (7 MB tools / tool-call arguments / prefill / content, 150,000 messages, a 12 MB frame, a 64 MB
frame, a prompt the library refuses), and one flooding status requests without reading. A fault thread, every
10-30 s, does one of: SIGKILL a random lane; SIGKILL the coordinator and start it again (streams open then must get
DaemonUnavailable within 5 s, the lanes and the prompt worker must follow it, the restart must reclaim what it left in
/dev/shm, and the same Client objects must work again); Ctrl-C (SIGINT to the process group) and start again (exit
status 0, nothing left in /dev/shm or the runtime dir). After each fault it checks that status answers and that a
reference greedy generation is unchanged. Prints a JSON summary (what each kind of client saw, the faults, the
checks, the coordinator's RSS, every unexpected outcome). Not part of CI.

    nice -n 19 python scripts/soak.py --model stratad/model/data/tiny-chat.gguf --minutes 5 [--out summary.json]
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
import traceback
from pathlib import Path

import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protos import messages as M  # noqa: E402
from protos.codec import decode, encode  # noqa: E402
from stratad import shm  # noqa: E402
from stratad.client import DaemonUnavailable, RequestError  # noqa: E402
from stratad.local_daemon import LocalDaemon  # noqa: E402

PROMPTS = ["Why is the sky blue?", "Tell me about the experts on the cards.", "Write a poem about shared memory.",
           "What does a lane do when its card is busy?"]
REFERENCE = dict(prompt="The reference generation, greedy.", max_tokens=16, ignore_eos=True)
BAD_FRAMES = [b"[" * 5000, b"\xff\xfe", b'{"type":"generate"}', b'{"v":2,"type":"status_request"}', b"9" * 100000,
              b'{"type":"generate","req_id":"x","tokens":[1e999]}']
EXPECTED_CODES = {"lane_failed", "shutting_down", "queue_full"}  # what a well-formed request may meet in a soak
UNAVAILABLE_WITHIN_S = 5.0  # a stream open when the coordinator dies learns it within this
# an oversized request is refused within this: decoded in the intake worker, which the soak's nice 19 on a busy box
# slows (150,000 messages: 0.4 s on an idle core; 2-4 s seen); other clients are not paused by it (tests/test_faults)
REFUSED_WITHIN_S = 5.0


def big_requests() -> dict[str, bytes]:
    """Frames that fit the 8 MiB limit but no context: each must be refused (prompt_too_long) without a pause."""
    big, hi = "word " * 1_400_000, {"role": "user", "content": "hi"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": {"a": big}}}]}
    bodies = {
        "tools": dict(messages=[hi], tools=[{"type": "function", "function": {"name": "f", "description": big}}]),
        "tool_call_arguments": dict(messages=[hi, call, hi]),
        "prefill": dict(messages=[hi], prefill=big),
        "content": dict(messages=[{"role": "user", "content": big}]),
        "messages": dict(messages=[{"role": "user", "content": ""}] * 150_000),
    }
    return {k: json.dumps(dict(type="generate", req_id=f"big-{k}", sampling={"max_tokens": 4}, **b),
                          separators=(",", ":")).encode() for k, b in bodies.items()}


class Soak:
    def __init__(self, d: LocalDaemon, until: float, seed: int, fault_kinds: list[str]):
        self.d, self.until, self.rng, self.fault_kinds = d, until, random.Random(seed), fault_kinds
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.lock = threading.Lock()
        self.failures: list[str] = []
        self.down = threading.Event()  # set from a coordinator fault until the new one serves
        self.t_killed, self.fault = 0.0, ""
        self.epoch = 0  # +1 when a coordinator fault starts and when it ends: a wait that saw it change met one
        self.unavailable_after_s: list[float] = []  # kill -> DaemonUnavailable, for streams open at the kill
        self.restart_s: list[float] = []
        self.rss_mb: list[dict] = []  # per coordinator incarnation: start, max, end
        self.refused_s: list[float] = []  # oversized requests: send -> refusal
        self.frames = big_requests()

    def running(self) -> bool:
        return time.monotonic() < self.until

    def in_fault(self, since_epoch: int) -> bool:
        """The daemon is down or restarting, or was since since_epoch was read."""
        return self.down.is_set() or self.epoch != since_epoch

    def count(self, who: str, what: str) -> None:
        with self.lock:
            self.counts[who][what] += 1

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(f"{time.strftime('%H:%M:%S')} {what}")

    def guarded(self, name: str, f, *args):
        """f(*args) as a thread's target: an exception it did not expect ends the thread as a failure of the soak,
        with its traceback, instead of a thread dying silently while the summary says nothing failed."""
        def run():
            try:
                f(*args)
            except Exception as e:  # noqa: BLE001 - recorded: the soak's finding
                self.count("threads", f"{name}_died")
                self.fail(f"thread {name} died: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        return run

    def socket(self, **opts) -> tuple[zmq.Context, zmq.Socket]:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        for k, v in opts.items():
            s.setsockopt(getattr(zmq, k), v)
        s.connect(f"ipc://{self.d.runtime_dir / 'client.sock'}")
        return ctx, s

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
                self.fail(f"after {why}: reference tokens changed")
        except Exception as e:  # noqa: BLE001 - a failed check is the soak's finding, not its end
            self.count("checks", "failed")
            self.fail(f"after {why}: {type(e).__name__}: {e}")

    # ---- clients --------------------------------------------------------------------------------------------
    def streamer(self, kind: str) -> None:
        """One Client for the whole run (each request has its own connection): after a coordinator restart the
        same object must work again."""
        rng = random.Random(self.rng.random())
        c = self.d.client(timeout_s=10, stream_timeout_s=60)
        was_down = False
        while self.running():
            e0 = self.epoch
            try:
                n = rng.randint(8, 400)
                s = c.generate(prompt=rng.choice(PROMPTS), max_tokens=n, temperature=0.7, seed=rng.randint(0, 1000))
                stop_at = rng.randint(1, n)
                for i, _ in enumerate(s):
                    if kind == "canceller" and i == stop_at:
                        s.cancel()
                    if kind == "disconnector" and i == stop_at:
                        s.close()
                        break
                self.count(kind, s.finish_reason or "disconnected")
                if was_down:
                    self.count(kind, "served_again_after_restart")
                    was_down = False
            except RequestError as e:
                self.count(kind, e.code.value)
                if e.code.value not in EXPECTED_CODES:
                    self.fail(f"{kind}: {e}")
            except DaemonUnavailable as e:
                t = time.monotonic()
                if self.in_fault(e0):
                    self.count(kind, "unavailable_in_fault")
                    if self.fault == "coordinator_sigkill" and "went away during request" in str(e):
                        self.unavailable_after_s.append(t - self.t_killed)
                    was_down = True
                    time.sleep(0.2)
                else:
                    self.count(kind, "unavailable")
                    self.fail(f"{kind}: {e}")
            time.sleep(rng.uniform(0, 1))  # think time: keeps the shared box's load modest
        c.close()

    def slow_reader(self) -> None:
        """Starts a long stream and never reads it: the daemon must cut it off (client_too_slow), not wait."""
        while self.running():
            ctx, s = self.socket(RCVHWM=1, RCVBUF=4096)
            s.send(encode(M.Generate(req_id=f"slow{self.rng.random()}", prompt=self.rng.choice(PROMPTS),
                                     sampling=M.Sampling(max_tokens=4000, ignore_eos=True))))
            time.sleep(self.rng.uniform(5, 20))
            ctx.destroy(linger=0)
            self.count("slow_reader", "abandoned")

    def bad_frames(self) -> None:
        while self.running():
            ctx, s = self.socket()
            while self.running():
                e0 = self.epoch
                s.send_multipart([self.rng.choice(BAD_FRAMES)] * self.rng.choice([1, 1, 2]))
                if s.poll(10000):
                    s.recv_multipart()
                    self.count("bad_frames", "answered")
                elif self.in_fault(e0):
                    self.count("bad_frames", "unanswered_in_fault")
                    break  # a new connection for the next daemon
                else:
                    self.count("bad_frames", "unanswered")
                    self.fail("bad frame unanswered in 10 s")
                time.sleep(self.rng.uniform(0.05, 0.5))
            ctx.destroy(linger=0)

    def oversized(self) -> None:
        """7 MB fields and 150,000 messages (prompt_too_long within REFUSED_WITHIN_S), a 12 MB frame (bad_frame
        naming the limit, as soon), a 64 MB one (the connection dropped unread: no answer), a prompt the library
        refuses."""
        kinds = list(self.frames) + ["frame_12mb", "frame_64mb", "library_refuses"]
        while self.running():
            kind = self.rng.choice(kinds)
            time.sleep(self.rng.uniform(2, 8))
            if kind == "library_refuses":
                try:
                    with self.d.client(timeout_s=10) as c:
                        c.generate(prompt="x" * (9 << 20))
                    self.fail("a 9 MB prompt was not refused by the library")
                except RequestError as e:
                    self.count("oversized", f"{kind}:{e.code.value}")
                continue
            frame = self.frames.get(kind) or (b"[" * (12 << 20) if kind == "frame_12mb" else b"{" * (64 << 20))
            ctx, s = self.socket()
            t0, e0 = time.monotonic(), self.epoch
            s.send(frame)
            answered = s.poll(3000 if kind == "frame_64mb" else 30000)
            took = time.monotonic() - t0
            want = {"frame_12mb": "bad_frame", "frame_64mb": None}.get(kind, "prompt_too_long")
            reply = decode(s.recv(), M.CoordinatorToClient) if answered else None
            got = None if reply is None else reply.code.value if isinstance(reply, M.Error) else reply.type
            ctx.destroy(linger=0)
            if got == want and (got is None or took < REFUSED_WITHIN_S):
                self.count("oversized", f"{kind}:{got or 'dropped'}")
                if got is not None:
                    self.refused_s.append(took)
            elif self.in_fault(e0):
                self.count("oversized", f"{kind}:in_fault")
            else:
                self.count("oversized", f"{kind}:unexpected")
                self.fail(f"oversized {kind}: got {got} after {took:.2f} s, wanted {want}")

    def status_flood(self) -> None:
        """3,000 status requests, never read; the connection dropped a few seconds later."""
        status = encode(M.StatusRequest())
        while self.running():
            time.sleep(self.rng.uniform(5, 20))
            ctx, s = self.socket(RCVHWM=1, RCVBUF=4096, SNDTIMEO=5000)
            sent = 0
            try:
                for _ in range(3000):
                    s.send(status)
                    sent += 1
            except zmq.Again:
                pass
            time.sleep(self.rng.uniform(1, 5))
            ctx.destroy(linger=0)
            self.count("status_flood", "sent_3000" if sent == 3000 else "send_blocked")

    # ---- faults ---------------------------------------------------------------------------------------------
    def faults(self, want: list[int]) -> None:
        while self.running():
            time.sleep(self.rng.uniform(10, 30))
            if not self.running():
                break
            kind = self.rng.choice(self.fault_kinds)
            try:
                if kind == "lane_sigkill":
                    self.kill_lane(want)
                else:
                    self.restart(kind, want)
            except Exception as e:  # noqa: BLE001 - the fault thread goes on
                self.fail(f"{kind}: {type(e).__name__}: {e}")
                self.count("faults", f"{kind}_error")
                if self.d.proc is None or self.d.proc.poll() is not None:
                    self.start_again(f"after the {kind} error")

    def kill_lane(self, want: list[int]) -> None:
        try:
            lanes = self.d.status().lanes
        except Exception as e:  # noqa: BLE001
            self.fail(f"status before a fault: {e}")
            return
        victim = self.rng.choice(lanes)
        if not victim.pid:
            return
        try:
            os.kill(victim.pid, signal.SIGKILL)
        except ProcessLookupError:  # it exited between the status and the kill (a restart under way)
            self.count("faults", "lane_already_gone")
            return
        self.count("faults", "lane_sigkill")
        self.check(f"SIGKILL of lane {victim.lane}", want)

    def segments(self) -> dict[str, int]:
        """This daemon's segments in /dev/shm: name -> inode (a segment made again under the same name is new)."""
        out = {}
        for p in shm.SHM_DIR.glob(shm.prefix_for(self.d.runtime_dir).lstrip("/") + "*"):
            try:
                out[p.name] = p.stat().st_ino
            except FileNotFoundError:
                pass
        return out

    def restart(self, kind: str, want: list[int]) -> None:
        proc = psutil.Process(self.d.proc.pid)
        children = proc.children(recursive=True)
        self.rss_mb[-1]["end"] = proc.memory_info().rss >> 20
        self.down.set()
        self.epoch += 1
        self.t_killed, self.fault = time.monotonic(), kind
        if kind == "coordinator_sigkill":
            self.d.proc.kill()
        else:
            os.killpg(self.d.proc.pid, signal.SIGINT)  # Ctrl-C in its terminal: the whole process group
        try:
            rc = self.d.proc.wait(30)
        except Exception:  # noqa: BLE001
            self.fail(f"{kind}: the daemon did not end in 30 s")
            os.killpg(self.d.proc.pid, signal.SIGKILL)
            rc = self.d.proc.wait()
        took = time.monotonic() - self.t_killed
        gone, alive = psutil.wait_procs(children, timeout=10)  # lanes and the prompt worker follow it
        for p in alive:
            self.fail(f"{kind}: {p.name()} {p.pid} outlived its coordinator")
            p.kill()
        self.d.proc = None
        left = self.segments()
        socks = list(self.d.runtime_dir.glob("*.sock"))
        if kind == "sigint":
            self.count("faults", "sigint_stop")
            if rc != 0 or took > 10 or left or socks:
                self.fail(f"SIGINT: exit status {rc} after {took:.1f} s, left {len(left)} segments, {socks}")
        else:
            self.count("faults", "coordinator_sigkill")
            self.count("faults", f"coordinator_sigkill_left_{'segments' if left else 'nothing'}")
        self.start_again(kind)
        if kind == "coordinator_sigkill" and left:
            now = self.segments()
            stale = [name for name, ino in left.items() if now.get(name) == ino]
            if stale:
                self.fail(f"restart after SIGKILL: old segments still there: {stale}")
            else:
                self.count("faults", "restart_reclaimed")
        self.check(f"{kind} and restart", want)

    def start_again(self, why: str) -> None:
        t0 = time.monotonic()
        try:
            self.d.start()
        finally:
            self.epoch += 1
            self.down.clear()
        self.restart_s.append(time.monotonic() - t0)
        self.rss_mb.append({"start": psutil.Process(self.d.proc.pid).memory_info().rss >> 20, "max": 0})

    def rss(self) -> None:
        while self.running():
            try:
                mb = psutil.Process(self.d.proc.pid).memory_info().rss >> 20
                cur = self.rss_mb[-1]
                cur["max"] = max(cur["max"], mb)
            except (AttributeError, psutil.Error):  # between a fault and the restart
                pass
            time.sleep(1)


def dist(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median": round(xs[len(xs) // 2], 3) if xs else None,
            "p99": round(xs[int(0.99 * (len(xs) - 1))], 3) if xs else None, "max": round(xs[-1], 3) if xs else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cards", default="cpu,cpu")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default="lane_sigkill:3,coordinator_sigkill:1,sigint:1",
                    help="the fault kinds and their weights (default: %(default)s)")
    ap.add_argument("--out", help="also write the JSON summary here")
    a = ap.parse_args()
    rt = Path(tempfile.mkdtemp(prefix="stratad-soak-"))
    (rt / "xdg").mkdir(mode=0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(rt / "xdg")  # the daemon's registration stays out of the user's registry
    cfg = rt / "soak.toml"  # a small client queue, so that the slow readers are cut off within their stall
    cfg.write_text("client_queue_messages = 256\nstop_grace_s = 2.0\n")
    d = LocalDaemon(a.model, a.cards, rt / "run", config=cfg, log=rt / "daemon.log").start()
    kinds = [k for item in a.faults.split(",") for k, w in [item.split(":")] for _ in range(int(w))]
    soak = Soak(d, time.monotonic() + a.minutes * 60, a.seed, kinds)
    soak.rss_mb.append({"start": psutil.Process(d.proc.pid).memory_info().rss >> 20, "max": 0})
    t0 = time.monotonic()
    rc, stop_s = None, None
    try:
        want = soak.reference()
        workers = [threading.Thread(target=soak.guarded(k, soak.streamer, k))
                   for k in ("reader", "canceller", "disconnector")]
        workers += [threading.Thread(target=soak.guarded(f.__name__, f)) for f in (
            soak.slow_reader, soak.bad_frames, soak.oversized, soak.status_flood, soak.rss)]
        workers.append(threading.Thread(target=soak.guarded("faults", soak.faults, want)))
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        soak.check("the run", want)
        soak.rss_mb[-1]["end"] = psutil.Process(d.proc.pid).memory_info().rss >> 20
    finally:
        t_stop = time.monotonic()
        rc = d.stop()
        stop_s = time.monotonic() - t_stop
    log = (rt / "daemon.log").read_text(errors="replace")
    late = [x for x in soak.unavailable_after_s if x > UNAVAILABLE_WITHIN_S]
    if late:
        soak.fail(f"{len(late)} streams learned of a coordinator's death after more than {UNAVAILABLE_WITHIN_S} s")
    summary = {
        "minutes": round((time.monotonic() - t0) / 60, 2), "model": a.model, "cards": a.cards, "seed": a.seed,
        "fault_mix": a.faults,
        "clients": {k: dict(v) for k, v in soak.counts.items() if k not in ("faults", "checks")},
        "faults": dict(soak.counts["faults"]), "checks": dict(soak.counts["checks"]),
        "coordinator_death_to_client_error_s": dist(soak.unavailable_after_s),
        "oversized_refused_s": dist(soak.refused_s),
        "restart_s": {"n": len(soak.restart_s), "max": round(max(soak.restart_s, default=0), 2),
                      "mean": round(sum(soak.restart_s) / len(soak.restart_s), 2) if soak.restart_s else None},
        "rss_mb": {"incarnations": len(soak.rss_mb), "start": soak.rss_mb[0]["start"],
                   "max": max(r["max"] for r in soak.rss_mb), "end": soak.rss_mb[-1].get("end"),
                   "max_growth_in_one": max(r["max"] - r["start"] for r in soak.rss_mb)},
        "stop": {"exit_status": rc, "seconds": round(stop_s, 2)},
        "log": {"tracebacks": log.count("Traceback"), "cut_off_clients": log.count("stopped reading its replies"),
                "reclaimed_leftovers": log.count("reclaimed leftovers"), "path": str(rt / "daemon.log")},
        "n_failures": len(soak.failures), "failures": soak.failures[:40],
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if not soak.failures and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
