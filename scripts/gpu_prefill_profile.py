#!/usr/bin/env python3
"""Where a GPU lane's prompt reading spends its time (lane/cupy_card.py), on a generated or given model.

A prompt of each length is read in the card's chunks with CUDA events around each kind of work on the card's
stream, summed over layers and chunks:
  dense      the projections (q/k/v, o, router, LM head: cuBLAS fp16 on dequantised weights),
  attention  prompt attention (PrefillAttention),
  experts    the experts' front half: quantise, pairs and tiles, staging the experts no card holds, the kernels,
  combine    the experts' back half (weighted sum into the residual);
other is the rest of the wall time (norms, RoPE and KV append, embedding, host work between launches).
Prints a table last; --json writes everything.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profile_report import model_path, report  # noqa: E402
from stratad.config import GPU_PROMPT_CHUNK  # noqa: E402
from stratad.model.gguf_file import ModelFile  # noqa: E402

KINDS = ("dense", "attention", "experts", "combine")


def profile(path: str, fraction: float, context: int, host_experts: str, chunk: int) -> dict:
    import cupy as cp

    from lane.cupy_card import CupyCard

    model = ModelFile(path)
    c = model.config
    total = c.n_layer * c.n_expert
    n = int(fraction * total)
    card = CupyCard(model, 0, n, context + 64, host_experts=host_experts, prompt_chunk=chunk)
    card.pool.fill([(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)][:n])
    prompt = [int(t) for t in np.random.default_rng(context).integers(0, 2000, size=context)]
    card.forward(prompt[:chunk], card.new_kv(), logits="last")  # compile, cuBLAS handles, workspaces
    marks = []

    def timed(kind, fn):
        def run(*args, **kwargs):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(card.stream)
            out = fn(*args, **kwargs)
            e1.record(card.stream)
            marks.append((kind, e0, e1))
            return out
        return run

    card.net._proj = timed("dense", card.net._proj)
    card.net.prefill_attn = timed("attention", card.net.prefill_attn)
    card.experts.front = timed("experts", card.experts.front)
    card.experts.back = timed("combine", card.experts.back)
    cp.cuda.runtime.deviceSynchronize()
    t = time.perf_counter()
    card.forward(prompt, card.new_kv(), logits="last")
    wall_ms = (time.perf_counter() - t) * 1e3
    sums = dict.fromkeys(KINDS, 0.0)
    for kind, e0, e1 in marks:
        sums[kind] += cp.cuda.get_elapsed_time(e0, e1)
    card.close()
    out = {"fraction": fraction, "context": context, "host_experts": host_experts,
           "prompt_chunk": chunk,
           "prefill_tok_s": round(context / wall_ms * 1e3, 1), "wall_ms": round(wall_ms, 1)}
    out |= {f"{k}_ms": round(v, 1) for k, v in sums.items()}
    out["other_ms"] = round(wall_ms - sum(sums.values()), 1)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="GGUF file (default: generate the a3b IQ3_S preset)")
    p.add_argument("--fractions", default="1.0,0.5")
    p.add_argument("--contexts", default="1024,32768")
    p.add_argument("--host-experts", choices=["cpu", "card"], default="card")
    p.add_argument("--prompt-chunks", default=str(GPU_PROMPT_CHUNK), help="comma list: tokens a prompt chunk, each a row")
    p.add_argument("--json")
    a = p.parse_args()
    path = model_path(a.model)
    rows = [profile(path, float(f), int(n), a.host_experts, int(ch)) for f in a.fractions.split(",")
            for n in a.contexts.split(",") for ch in a.prompt_chunks.split(",")]
    keys = ["fraction", "context", "prompt_chunk", "prefill_tok_s", "wall_ms"] + \
        [f"{k}_ms" for k in KINDS] + ["other_ms"]
    report(rows, keys, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
