#!/usr/bin/env python3
"""A GPU lane's decode steps as the GPU runs them: per kernel, its time and the gap before it inside the graph.

The profile script times each kernel alone; in the step's graph, programmatic dependent launch overlaps a kernel's
prologue with its predecessor's tail, and every boundary costs a wait. This reads the real timeline:

  run       python3 scripts/gpu_decode_timeline.py --model M --context 1024 --tokens 16
            (a prompt, then decode steps replayed from the card's graphs; run it under
            `nsys profile -t cuda --cuda-graph-trace=node`, then `nsys stats -r cuda_gpu_trace -f csv`)
  summarise python3 scripts/gpu_decode_timeline.py --csv TRACE.csv [--json OUT]
            steps start at each embed_rows launch; the last --steps complete steps are averaged: per kernel name
            the launches a step, device us a step, and the gap us a step before its launches (negative: it
            overlapped its predecessor), then the step's wall and busy time.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIRST = "embed_rows"  # a decode step's first kernel


def run(path: str, context: int, tokens: int) -> None:
    from lane.cupy_card import CupyCard
    from stratad.model.gguf_file import ModelFile

    model = ModelFile(path)
    c = model.config
    total = c.n_layer * c.n_expert
    card = CupyCard(model, 0, total, context + tokens + 64)
    card.pool.fill([(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)])
    prompt = [int(t) for t in np.random.default_rng(context).integers(0, 2000, size=context)]
    kv = card.new_kv()
    card.forward(prompt, kv, logits="last")
    for i in range(tokens):
        card.forward([int(prompt[i])], kv)
    card.stream.synchronize()
    card.close()


def kernels_of(csv_path: str) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel in an nsys cuda_gpu_trace CSV, in start order."""
    rows = []
    with open(csv_path, newline="") as f:
        for r in csv.DictReader(f):
            keys = {k.split(" (")[0].strip(): k for k in r}
            name = r[keys["Name"]]
            if not name or name.startswith("[CUDA"):  # memcpy / memset rows
                continue
            start, dur = float(r[keys["Start"]]) / 1e3, float(r[keys["Duration"]]) / 1e3
            rows.append((name.split("(")[0].strip(), start, start + dur))
    rows.sort(key=lambda x: x[1])
    return rows


def summarise(rows: list[tuple[str, float, float]], steps: int) -> dict:
    starts = [i for i, (n, _, _) in enumerate(rows) if n == FIRST]
    if len(starts) < 2:
        raise SystemExit(f"fewer than two '{FIRST}' launches: no complete decode step in the trace")
    bounds = list(zip(starts[:-1], starts[1:]))[-steps:]
    dur, gap, count = defaultdict(float), defaultdict(float), defaultdict(int)
    walls, busy = [], []
    for a, b in bounds:
        step = rows[a:b]
        # the step ends where its last kernel ends (the next step's first launch waits on the host)
        walls.append(max(e for _, _, e in step) - step[0][1])
        busy.append(sum(e - s for _, s, e in step))
        prev_end = None
        for name, s, e in step:
            dur[name] += e - s
            count[name] += 1
            if prev_end is not None:
                gap[name] += s - prev_end
            prev_end = e if prev_end is None else max(prev_end, e)
    n = len(bounds)
    names = sorted(dur, key=lambda k: dur[k] + gap[k], reverse=True)
    return {"steps": n, "wall_us": float(np.mean(walls)), "busy_us": float(np.mean(busy)),
            "gaps_us": float(np.mean(walls) - np.mean(busy)),
            "kernels": {k: {"launches": count[k] / n, "us": dur[k] / n, "gap_us": gap[k] / n} for k in names}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--csv", help="summarise this nsys cuda_gpu_trace CSV instead of running")
    p.add_argument("--steps", type=int, default=8, help="the last complete steps to average")
    p.add_argument("--json")
    a = p.parse_args()
    if not a.csv:
        run(a.model, a.context, a.tokens)
        return 0
    out = summarise(kernels_of(a.csv), a.steps)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"{out['steps']} steps: wall {out['wall_us']:.0f} us, kernels busy {out['busy_us']:.0f} us, "
          f"gaps {out['gaps_us']:.0f} us")
    for name, k in out["kernels"].items():
        print(f"  {name[:44]:44s} {k['launches']:5.0f} launches {k['us']:9.1f} us  gap before {k['gap_us']:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
