"""The real daemon as a subprocess on CPU cards, with what tests need beside the LocalDaemon: log, leftovers."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from stratad import shm
from stratad.local_daemon import LocalDaemon

ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


class Daemon(LocalDaemon):
    """http: no gateway unless a test asks for one (then on a free port: stratad.gateway.local_client.free_port)."""

    def __init__(self, model: Path, runtime_dir: Path, cards: str = "cpu,cpu", extra: list[str] | None = None,
                 config: Path | None = None, http: str | None = ""):
        super().__init__(model, cards, runtime_dir, extra or [], config,
                         log=runtime_dir.parent / f"{runtime_dir.name}.log", http=http)

    def wait_ready(self, timeout_s: float = 60.0, restarts: int | None = None) -> None:
        try:
            super().wait_ready(timeout_s, restarts)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{e}:\n{self.log_text()}") from None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def lane_pids(self) -> list[int]:
        return [ln.pid for ln in self.status().lanes]

    def leftovers(self) -> list[str]:
        segs = [str(p) for p in shm.SHM_DIR.glob(shm.prefix_for(self.runtime_dir).lstrip("/") + "*")]
        socks = [str(p) for p in self.runtime_dir.glob("*.sock")]
        return segs + socks


class RoleWatch:
    """Samples the lanes' (role, busy) while a test runs: `seen`, and `samples` with the time each was asked for."""

    def __init__(self, d: Daemon):
        self.d, self.samples, self.stop = d, [], threading.Event()
        self.t = threading.Thread(target=self.run)

    @property
    def seen(self) -> list[tuple]:
        return [roles for _, roles in self.samples]

    def run(self):
        while not self.stop.is_set():
            asked = time.monotonic()
            st = self.d.status()
            self.samples.append((asked, tuple((ln.role.value, ln.req_id is not None) for ln in st.lanes)))
            time.sleep(0.02)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()


def split_then_rejoin(d: Daemon, first: dict, second: dict, timeout_s: float = 60.0):
    """A long request A; B splits a peer off while A streams and then idles; A goes on until B's lane has
    rejoined it as a peer (or timeout_s), then is cancelled. first / second: generate() arguments. A ignores the
    stop tokens (a greedy stream that stopped early would end before the rejoin: compare it with ignore_eos too).
    Returns (A's stream, B's stream, the roles seen)."""
    with RoleWatch(d) as w, d.client(stream_timeout_s=600) as c:
        a = c.generate(max_tokens=3000, digest=True, ignore_eos=True, **first)
        it = iter(a)
        next(it)
        b = c.generate(max_tokens=5, digest=True, **second)
        b.result()
        b_done = time.monotonic()
        deadline, cancelled = b_done + timeout_s, False
        for _ in it:
            # only a status asked for once B was done: one asked before still shows A's lead with its peer from
            # before the split (on a loaded box the watch had no sample between B's start and its end, and A was
            # cancelled at once, its rejoin never seen)
            rejoined = any(asked > b_done and ("lead", True) in s and ("peer", False) in s
                           for asked, s in w.samples[-3:])
            if not cancelled and (rejoined or time.monotonic() > deadline):
                a.cancel()
                cancelled = True
        return a, b, w.seen


def beside(d: Daemon, first: dict, second: dict, n: int | None = None, until=None, timeout_s: float = 20.0):
    """A long request A and, once it streams, B beside it; then A is cancelled, so the two run together for all of
    B however loaded the box is. B runs n tokens to its end, or (n None) streams until until(roles seen since B
    was sent) holds, or for timeout_s, and is cancelled. Two requests of fixed lengths, the second sent at the
    first's third chunk, had overlapped on a loaded box too briefly for the role watch to see them together (or
    not at all), and a status request took up to 0.75 s there: what a test must see is waited for. first / second:
    generate() arguments; a request cancelled ignores the stop tokens (compare it with ignore_eos too,
    max_tokens_of). Returns (A's stream, B's stream, the roles seen)."""
    with RoleWatch(d) as w, d.client(stream_timeout_s=600) as c:
        a = c.generate(max_tokens=3000, digest=True, ignore_eos=True, **first)
        it = iter(a)
        next(it)
        if n is not None:
            b = c.generate(max_tokens=n, digest=True, **second)
            b.result()
        else:
            b = c.generate(max_tokens=3000, digest=True, ignore_eos=True, **second)
            sent, cancelled = time.monotonic(), False
            for _ in b:
                if not cancelled and (until([s for asked, s in w.samples if asked > sent]) or
                                      time.monotonic() > sent + timeout_s):
                    b.cancel()
                    cancelled = True
        a.cancel()
        for _ in it:
            pass
        assert a.finish_reason == "cancelled", f"A ended ({a.finish_reason}) before B; roles seen last: {w.seen[-3:]}"
    return a, b, w.seen


def max_tokens_of(stream) -> int:
    """The max_tokens with which a fresh request gives this finished stream's digest: a stop token's step is in
    the digest (its logits were read) but not in generated_tokens, so a stream that stopped needs one more."""
    return stream.stats.generated_tokens + (stream.finish_reason == "stop")


def rejoined_after_split(seen) -> bool:
    split = next((i for i, s in enumerate(seen) if ("solo", True) in s), None)
    return split is not None and any(("lead", True) in s and ("peer", False) in s for s in seen[split:])


def run_chats(d: Daemon, jobs: list[tuple[str, int]], request, stagger_first: bool = True,
              timeout_s: float = 120.0, digest: bool = True) -> dict:
    """The requests at once, each asking for a digest (unless not `digest`: then only tokens come back, and a GPU
    lane launches its steps ahead): request(name) gives generate()'s prompt arguments. With stagger_first the first
    is already streaming when the others start (so a peer splits off). name -> stream."""
    out, errors, first = {}, [], threading.Event()

    def go(name, n, k):
        try:
            with d.client() as c:
                s = c.generate(max_tokens=n, digest=digest, **request(name))
                for i, _ in enumerate(s):
                    if k == 0 and i == 2:
                        first.set()
                out[name] = s
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            first.set()

    ts = [threading.Thread(target=go, args=(name, n, k)) for k, (name, n) in enumerate(jobs)]
    for k, t in enumerate(ts):
        t.start()
        if k == 0 and stagger_first and len(ts) > 1:
            first.wait(timeout_s / 2)
    for t in ts:
        t.join(timeout_s)
    assert not errors, errors
    return out



GREEDY_PROMPT = "Why do the experts sit on the cards?"


def greedy(d: Daemon, n: int = 12) -> list[int]:
    """A short greedy generation: the same tokens before and after a fault say the daemon still computes right."""
    with d.client(timeout_s=10, stream_timeout_s=30) as c:
        s = c.generate(prompt=GREEDY_PROMPT, max_tokens=n, ignore_eos=True)
        s.result()
        return s.tokens


def raw_socket(d: Daemon, rcvhwm: int = 1000, rcvbuf: int = -1):
    """A bare DEALER on the daemon's client socket (for what the client library would not send or would read);
    rcvhwm / rcvbuf small: a client that stops reading fills up soon. Returns (context, socket)."""
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, rcvhwm)
    s.setsockopt(zmq.RCVBUF, rcvbuf)
    s.connect(f"ipc://{d.runtime_dir / 'client.sock'}")
    return ctx, s


def curve_tcp(tmp: Path, config: Path) -> tuple[str, dict]:
    """A TCP listener with CURVE keys (server and one authorised client's, made under tmp) written to config.
    Returns (endpoint, the client's curve_server_key / curve_keypair arguments)."""
    import zmq.auth

    from stratad.gateway.local_client import free_port

    keys, authorized = tmp / "keys", tmp / "authorized"
    keys.mkdir()
    authorized.mkdir()
    server_pub, server_sec = zmq.auth.create_certificates(keys, "server")
    client_pub, client_sec = zmq.auth.create_certificates(keys, "client")
    os.rename(client_pub, authorized / "client.key")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config.write_text(f'tcp = "{endpoint}"\ncurve_secret_key_file = "{server_sec}"\n'
                      f'curve_authorized_dir = "{authorized}"\n')
    return endpoint, dict(curve_server_key=zmq.auth.load_certificate(server_pub)[0],
                          curve_keypair=zmq.auth.load_certificate(client_sec))


def coordinator_rss(d: Daemon) -> int:
    import psutil

    return psutil.Process(d.proc.pid).memory_info().rss


class RssPeak:
    """The coordinator's RSS sampled every 10 ms while the block runs: base (at its start) and peak."""

    def __init__(self, d: Daemon):
        self.d = d
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, coordinator_rss(self.d))
            time.sleep(0.01)

    def __enter__(self) -> RssPeak:
        self.base = self.peak = coordinator_rss(self.d)
        self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sampler.join()


class Stalls:
    """The spans of time during which this test process did not run: not scheduled on a loaded machine, or one of
    its threads holding the GIL in C code (a 7 MB json.dumps). A thread that means to wake every TICK_S records
    each wake-up that came more than LATE_S late. A pause that a test measures between two of the daemon's replies
    is the daemon's only where this process was running and waiting for them: while it waits (a poll, the GIL
    released) the thread wakes on time, and nothing of the pause is taken off. Measured on the 2-core box with
    three busy loops beside the tests: this process stalled up to 1.5 s at a time, and a reading stream's pauses
    of 1.0-2.1 s were such stalls (the coordinator had used 0.02-0.14 s of CPU meanwhile, and the chunks it had
    relayed came in a burst of 200-270 right after)."""

    TICK_S = 0.005
    LATE_S = 0.02  # scheduling noise: wake-ups came up to ~12 ms late with six busy loops, on a process that sleeps

    def __init__(self):
        self.spans: list[tuple[float, float]] = []  # (from, to), in order
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            stopping = self._stop.wait(self.TICK_S)
            now = time.monotonic()
            if now - last > self.TICK_S + self.LATE_S:
                self.spans.append((last + self.TICK_S, now))
            last = now
            if stopping:
                return

    def close(self) -> None:
        """Stops the thread, once it has recorded a stall still under way (read the spans after this)."""
        self._stop.set()
        self._t.join()

    def within(self, a: float, b: float) -> float:
        """Seconds of [a, b] during which this process was stalled."""
        out = 0.0
        for s, e in reversed(self.spans):
            if e <= a:
                break
            out += max(0.0, min(e, b) - max(s, a))
        return out


# The longest a reading client's stream may pause because of another client (a stalled or slow reader, a flood, a
# big frame or body), and the longest a status request may take meanwhile: the daemon's part of it, what this test
# process was stalled itself taken off (Stalls). A loop waiting on a client that stopped reading waits for good,
# and 7 MB fields tokenised on a loop paused streams for seconds (issue 26).
MAX_GAP_S = 1.0


class Gaps:
    """The pauses between a stream's chunks (and before the first), as it is iterated, less the time this test
    process itself was stalled in them (Stalls): `longest` is the longest pause the daemon made the reader wait.
    `timed(...)` records a call to the daemon (a status request) the same way. Read `longest` and `slowest_call`
    after close() (or the with block): a stall is recorded once it has ended."""

    def __init__(self):
        self.last, self.n = time.monotonic(), 0
        self.stalls = Stalls()
        self.pauses: list[tuple[float, float]] = []  # (from, to) of each gap
        self.calls: list[tuple[float, float]] = []

    def tick(self) -> None:
        now = time.monotonic()
        self.pauses.append((self.last, now))
        self.last, self.n = now, self.n + 1

    @contextlib.contextmanager
    def timed(self):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.calls.append((t0, time.monotonic()))

    def _worst(self, spans) -> tuple[float, float]:
        """(the daemon's part, the whole) of the longest of spans, by the daemon's part."""
        return max(((b - a - self.stalls.within(a, b), b - a) for a, b in spans), default=(0.0, 0.0))

    @property
    def longest(self) -> float:
        return self._worst(self.pauses)[0]

    @property
    def slowest_call(self) -> float:
        return self._worst(self.calls)[0]

    def close(self) -> None:
        self.stalls.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        (p, pw), (c, cw) = self._worst(self.pauses), self._worst(self.calls)
        stalled = sum(e - s for s, e in self.stalls.spans)
        return (f"longest pause {p:.3f} s of the daemon's ({pw:.3f} s in all), slowest call {c:.3f} s ({cw:.3f} s), "
                f"{self.n} chunks; this process stalled {len(self.stalls.spans)} times, {stalled:.2f} s together, "
                f"at most {max((e - s for s, e in self.stalls.spans), default=0.0):.3f} s")
