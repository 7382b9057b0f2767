"""A minimal HTTP client of the gateway on this machine (the standard library only), for the demo and the overhead
bench: wait until it serves, post a JSON body, read a stream's server-sent events as they arrive."""
from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalGateway:
    def __init__(self, port: int, host: str = "127.0.0.1", timeout_s: float = 120.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until /health answers 200 (the gateway listens and the daemon's lanes serve)."""
        deadline, last = time.monotonic() + timeout_s, "no answer"
        while time.monotonic() < deadline:
            try:
                c = self._conn()
                c.request("GET", "/health")
                r = c.getresponse()
                last = f"{r.status} {r.read()[:200]!r}"
                c.close()
                if r.status == 200:
                    return
            except OSError as e:
                last = str(e)
            time.sleep(0.1)
        raise TimeoutError(f"the gateway on {self.host}:{self.port} did not serve within {timeout_s} s ({last})")

    def post(self, path: str, body: dict) -> dict:
        c = self._conn()
        try:
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            data = json.loads(r.read())
            if r.status != 200:
                raise RuntimeError(f"POST {path}: {r.status} {data}")
            return data
        finally:
            c.close()

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """The stream's data events as they arrive, parsed (the closing [DONE] ends the iteration)."""
        c = self._conn()
        try:
            c.request("POST", path, json.dumps(body | {"stream": True}), {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                raise RuntimeError(f"POST {path}: {r.status} {r.read()[:500]!r}")
            for line in r:
                if not line.startswith(b"data: "):
                    continue  # event names, comments, the blank line between events
                if line.strip() == b"data: [DONE]":
                    return
                yield json.loads(line[6:])
        finally:
            c.close()
