"""The real daemon as a subprocess on CPU cards, with what tests need beside the LocalDaemon: log, leftovers."""
from __future__ import annotations

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
    """Samples the lanes' (role, busy) while a test runs."""

    def __init__(self, d: Daemon):
        self.d, self.seen, self.stop = d, [], threading.Event()
        self.t = threading.Thread(target=self.run)

    def run(self):
        while not self.stop.is_set():
            st = self.d.status()
            self.seen.append(tuple((ln.role.value, ln.req_id is not None) for ln in st.lanes))
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
        deadline, cancelled = time.monotonic() + timeout_s, False
        for _ in it:
            rejoined = any(("lead", True) in s and ("peer", False) in s for s in w.seen[-3:])
            if not cancelled and (rejoined or time.monotonic() > deadline):
                a.cancel()
                cancelled = True
        return a, b, w.seen


def max_tokens_of(stream) -> int:
    """The max_tokens with which a fresh request gives this finished stream's digest: a stop token's step is in
    the digest (its logits were read) but not in generated_tokens, so a stream that stopped needs one more."""
    return stream.stats.generated_tokens + (stream.finish_reason == "stop")


def rejoined_after_split(seen) -> bool:
    split = seen.index(next(s for s in seen if ("solo", True) in s))
    return any(("lead", True) in s and ("peer", False) in s for s in seen[split:])


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


class Gaps:
    """The longest pause between a stream's chunks (and before the first), as it is iterated."""

    def __init__(self):
        self.last, self.longest, self.n = time.monotonic(), 0.0, 0

    def tick(self) -> None:
        now = time.monotonic()
        self.longest, self.last, self.n = max(self.longest, now - self.last), now, self.n + 1
