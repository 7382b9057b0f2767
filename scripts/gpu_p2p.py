#!/usr/bin/env python3
"""Peer copies between the GPUs of this machine (#5): whether each card can reach the other directly, and what a
copy costs both ways over each path a peer lane's input and result rows can take: "p2p" (cudaMemcpyPeerAsync with
peer access enabled: NVLink / PCIe P2P), "peer" (the same call before peer access is enabled: the driver picks the
path) and "staged" (RemotePool with the config's [gpu] peer_copy = "host": one card's copy engine into page-locked host memory,
the other's out of it; the two copies' times added).

    python3 scripts/gpu_p2p.py --json p2p.json

Sizes: 256 MiB (bandwidth), 64 KiB (a decode layer's rows: k experts x d_model floats) and 2 KiB (its int8 input),
each the median of --iters copies timed by CUDA events on the source device's stream.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import cupy as cp
import numpy as np

SIZES = (256 << 20, 64 << 10, 2 << 10)


def timed_copies(dst, a: int, src, b: int, n: int, iters: int) -> list[float]:
    """Seconds per copy of n bytes from src (device b) to dst (device a), issued on a stream of device b."""
    rt = cp.cuda.runtime
    with cp.cuda.Device(b):
        s = cp.cuda.Stream(non_blocking=True)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        rt.memcpyPeerAsync(dst.data.ptr, a, src.data.ptr, b, n, s.ptr)  # warm-up
        s.synchronize()
        out = []
        for _ in range(iters):
            e0.record(s)
            rt.memcpyPeerAsync(dst.data.ptr, a, src.data.ptr, b, n, s.ptr)
            e1.record(s)
            e1.synchronize()
            out.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return out


def staged_copies(dst, a: int, src, b: int, n: int, iters: int, host: np.ndarray) -> list[float]:
    """Seconds per copy of n bytes from src (device b) to page-locked host memory and on to dst (device a), each
    leg on its own device's stream (timed apart, added: RemotePool runs them one after the other)."""
    rt = cp.cuda.runtime
    legs = []
    for dev, d, s_, kind in ((b, host.ctypes.data, src.data.ptr, 2), (a, dst.data.ptr, host.ctypes.data, 1)):
        with cp.cuda.Device(dev):
            st = cp.cuda.Stream(non_blocking=True)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            rt.memcpyAsync(d, s_, n, kind, st.ptr)
            st.synchronize()
            t = []
            for _ in range(iters):
                e0.record(st)
                rt.memcpyAsync(d, s_, n, kind, st.ptr)
                e1.record(st)
                e1.synchronize()
                t.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
            legs.append(statistics.median(t))
    return [legs[0] + legs[1]]


def enable_peer(a: int, b: int) -> None:
    """Peer access both ways (there is no going back in this process: the host path is measured first)."""
    rt = cp.cuda.runtime
    for x, y in ((a, b), (b, a)):
        with cp.cuda.Device(x):
            try:
                rt.deviceEnablePeerAccess(y)
            except rt.CUDARuntimeError:  # already enabled
                pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    n_dev = cp.cuda.runtime.getDeviceCount()
    if n_dev < 2:
        print(f"{n_dev} GPU: nothing to measure")
        return 0
    rt = cp.cuda.runtime
    out = {"devices": [rt.getDeviceProperties(i)["name"].decode() for i in range(n_dev)]}
    bufs = {}
    for d in (0, 1):
        with cp.cuda.Device(d):
            bufs[d] = cp.zeros(SIZES[0], cp.uint8)
    rows = {(src, dst): {"from": src, "to": dst, "can_access_peer": bool(rt.deviceCanAccessPeer(dst, src))}
            for src, dst in ((0, 1), (1, 0))}
    host = cp.cuda.alloc_pinned_memory(SIZES[0])
    host = np.frombuffer(host, np.uint8, SIZES[0])
    for path in ("staged", "peer", "p2p"):  # p2p last: peer access cannot be switched off again in this process
        if path == "p2p":
            if not all(r["can_access_peer"] for r in rows.values()):
                break
            enable_peer(0, 1)
        for (src, dst), row in rows.items():
            for n in SIZES:
                if path == "staged":
                    t = staged_copies(bufs[dst], dst, bufs[src], src, n, a.iters, host)[0]
                else:
                    t = statistics.median(timed_copies(bufs[dst], dst, bufs[src], src, n, a.iters))
                row[f"{path}_{n}_us"] = round(t * 1e6, 2)
                row[f"{path}_{n}_GBps"] = round(n / t / 1e9, 2)
    out["pairs"] = list(rows.values())
    for row in out["pairs"]:
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
