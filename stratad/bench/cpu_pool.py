"""CPU pool throughput: GB/s of expert bytes read by `CpuPool.run`, against the host's own memory bandwidth.

`python -m stratad.bench.cpu_pool [--threads N ...] [--qtype IQ3_S ...]` prints one JSON line per type and thread
count (`--qtype all`: every expert type).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from gguf import GGMLQuantizationType as T

from lane.cpu_pool import CpuPool, LayerJobs
from stratad.bench import hardware
from stratad.engine.canonical import quantize_act
from stratad.model.quants import EXPERT_TYPES, fmt, parse_type, random_rows

F32 = np.float32


def random_layer(qtype: T, n_expert: int, d_model: int, d_ff: int, seed: int = 0):
    """A layer's three expert tensors, uint8 (n_expert, rows, row_bytes), random valid blocks."""
    rng = np.random.default_rng(seed)
    gate = np.empty((n_expert, d_ff, fmt(qtype).row_bytes(d_model)), np.uint8)
    up = np.empty_like(gate)
    down = np.empty((n_expert, d_model, fmt(qtype).row_bytes(d_ff)), np.uint8)

    def rows(n, k):  # a float type's rows come as its floats: their bytes
        return np.ascontiguousarray(random_rows(qtype, rng, n, k, 0.02)).view(np.uint8).reshape(n, -1)
    for e in range(n_expert):
        gate[e], up[e], down[e] = rows(d_ff, d_model), rows(d_ff, d_model), rows(d_model, d_ff)
    return gate, up, down


def bench_cpu_pool(threads: int | None = None, qtype: T = T.IQ3_S, n_expert: int = 128, experts_per_token: int = 8,
                   tokens: int = 1, d_model: int = 2048, d_ff: int = 768, repeat: int = 30, seed: int = 0,
                   layer=None, bandwidth: bool = True) -> dict:
    """Default: the a3b shape, IQ3_S, 8 experts x 1 token. Each call draws different experts from an n_expert layer
    (128 at a3b/IQ3_S: 260 MB, beyond a last-level cache), so the weights stream from memory as they do in serving.
    Reports the median and best call and, with bandwidth=True, the host's single-thread copy and `threads`-thread
    read bandwidth as the floor. `layer` may pass pre-built (gate, up, down) tensors."""
    threads = threads or os.cpu_count() or 1
    gate, up, down = layer if layer is not None else random_layer(qtype, n_expert, d_model, d_ff, seed)
    n_expert = gate.shape[0]
    per_expert = gate[0].nbytes + up[0].nbytes + down[0].nbytes
    rng = np.random.default_rng(seed + 1)
    qa, da = quantize_act(rng.standard_normal((tokens, d_model)).astype(F32))
    times = []
    with CpuPool(threads) as pool:
        for i in range(repeat + 2):
            es = rng.choice(n_expert, experts_per_token, replace=False)
            pairs = np.array([(t, e) for t in range(tokens) for e in es], np.int32)
            jobs = LayerJobs(gate, up, down, int(qtype), int(qtype), int(qtype), pairs, qa, da)
            t0 = time.perf_counter()
            pool.run(jobs)
            if i >= 2:  # the first calls compile / load the cache and start threads
                times.append(time.perf_counter() - t0)
    nb = experts_per_token * per_expert
    res = {"qtype": T(qtype).name, "d_model": d_model, "d_ff": d_ff, "experts": experts_per_token, "tokens": tokens,
           "threads": pool.threads, "expert_mb": per_expert / 1e6,
           "layer_mb": (gate.nbytes + up.nbytes + down.nbytes) / 1e6,
           "ms": float(np.median(times)) * 1e3, "gb_s": nb / float(np.median(times)) / 1e9,
           "best_gb_s": nb / min(times) / 1e9}
    if bandwidth:
        res["host_copy_gb_s_1thread"] = hardware.host_bandwidth_gbs()
        res["host_read_gb_s"] = hardware.host_read_bandwidth(threads)
        res["fraction_of_host_read"] = res["gb_s"] / res["host_read_gb_s"]
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="CPU pool throughput (GB/s of expert bytes read)")
    ap.add_argument("--threads", type=int, nargs="*", default=[os.cpu_count() or 1])
    ap.add_argument("--qtype", nargs="+", default=["IQ3_S"], help="expert types (gate, up and down alike), or all")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--n-expert", type=int, default=128)
    a = ap.parse_args(argv)
    qtypes = list(EXPERT_TYPES) if a.qtype == ["all"] else [parse_type(name) for name in a.qtype]
    for qt in qtypes:
        layer = random_layer(qt, a.n_expert, 2048, 768)
        for th in a.threads:
            print(json.dumps(bench_cpu_pool(th, qt, experts_per_token=a.experts, tokens=a.tokens, layer=layer)),
                  flush=True)
        del layer  # not held while the next one is made


if __name__ == "__main__":
    main()
