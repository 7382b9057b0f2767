#!/usr/bin/env python3
"""What a phase boundary costs on this GPU: a grid barrier inside a persistent kernel (one block an SM, cooperative
launch) against a kernel boundary (a launch doing only the PDL handshake, replayed from a graph with and without
programmatic edges). The persistent decode plan (docs/perf-notes.md) rests on the first being the smaller.
Prints one JSON line; --json writes it."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2000, help="barrier rounds (two barriers each)")
    p.add_argument("--launches", type=int, default=400, help="boundary-only launches in the graph")
    p.add_argument("--json")
    a = p.parse_args()

    import cupy as cp

    from lane.kernels.grid_sync import GridSync, barrier_rounds_ref

    gs = GridSync()
    s = cp.cuda.Stream(non_blocking=True)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()

    def timed(fn, reps=5) -> float:
        ms = []
        for _ in range(reps):
            e0.record(s)
            fn()
            e1.record(s)
            e1.synchronize()
            ms.append(cp.cuda.get_elapsed_time(e0, e1))
        return float(np.median(ms))

    with s:
        gs.rounds(10)  # load, warm
        out = cp.empty((gs.blocks,), cp.int64)
        barrier_ms = timed(lambda: gs.rounds(a.rounds, out))
        assert np.array_equal(out.get(), barrier_rounds_ref(gs.blocks, a.rounds))
        res = {"blocks": gs.blocks, "barrier_us": barrier_ms * 1e3 / (2 * a.rounds)}
        for pdl in (True, False):
            s.begin_capture()
            gs.boundaries(a.launches, pdl=pdl)
            g = s.end_capture()
            g.launch(s)
            res[f"boundary_us_{'pdl' if pdl else 'plain'}"] = timed(lambda g=g: g.launch(s)) * 1e3 / a.launches
    res["device"] = cp.cuda.runtime.getDeviceProperties(gs.device.id)["name"].decode()
    print(json.dumps(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
