"""How well a decode step could know a layer's routed experts one layer early: the next layer's router (with its
FFN RMSNorm) applied to this layer's FFN input, against the experts the next layer then routes to. Off the card,
that is what a fetch of the next layer's misses ahead of time (while this layer computes) would catch.

Runs the numpy reference forward pass token by token on random tokens, then, for each resident fraction, takes the
most-routed experts of each layer over the run as the resident ones (as a warmed cache holds them) and counts, per
token and layer: the misses, the share of them the prediction names, and how many experts the prediction would
fetch ahead (the bus bytes it spends, useful or not). Also the previous token's experts at the same layer, the
other cheap guess; and per cap ([gpu] fetch_ahead: at most that many guessed misses fetched a layer), what the
guesses catch and what they waste when the cap takes them in expert order (route_pairs' pair lists, as fetched
today) or by router weight.

    python3 scripts/route_prediction.py --model m.gguf [--tokens 200] [--fractions 0.5,0.25] [--caps 1,2,3,8]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stratad.engine.reference import ReferenceEngine, rms_norm, route  # noqa: E402
from stratad.model.gguf_file import ModelFile  # noqa: E402


def routed(eng: ReferenceEngine, layer: int, x: np.ndarray) -> list[int]:
    """The experts layer `layer`'s router picks for the FFN input x (1, d_model), by weight."""
    b = f"blk.{layer}."
    h = rms_norm(x, eng.w(b + "ffn_norm.weight"), eng.c.rms_eps)
    return route(h @ eng.w(b + "ffn_gate_inp.weight").T, eng.c.n_expert_used)[0][0].tolist()


def trace(eng: ReferenceEngine, tokens: np.ndarray) -> list[tuple[list[set], list[set]]]:
    """Per token: (each layer's routed experts, each layer's prediction of the next layer's), by weight."""
    c, kv, out = eng.c, eng.new_kv(), []
    for t in tokens:
        x = eng.embed(np.array([t]))
        ids, pred = [], []
        for i in range(c.n_layer):
            x = x + eng.attention(i, x, kv)
            ids.append(routed(eng, i, x))
            if i + 1 < c.n_layer:
                pred.append(routed(eng, i + 1, x))
            x = x + eng.moe(i, x)
        kv.length += 1
        out.append((ids, pred))
    return out


def summary(log, n_layer: int, n_expert: int, k: int, fractions: list[float], caps: list[int]) -> dict:
    counts = np.zeros((n_layer, n_expert))
    for ids, _ in log:
        for i, s in enumerate(ids):
            counts[i, s] += 1
    ordered = log
    log = [([set(s) for s in ids], [set(s) for s in pred]) for ids, pred in ordered]
    layers = range(1, n_layer)
    pairs = len(log) * len(layers)
    out = {"tokens": len(log), "layers": n_layer, "experts": n_expert, "k": k,
           "next_layer_overlap": sum(len(p[i - 1] & ids[i]) for ids, p in log for i in layers) / (k * pairs),
           "previous_token_overlap": sum(len(a[i] & b[i]) for (a, _), (b, _) in zip(log, log[1:])
                                         for i in range(n_layer)) / (k * n_layer * max(1, len(log) - 1)),
           "by_fraction": {}}
    for f in fractions:
        resident = [set(np.argsort(-counts[i], kind="stable")[: int(f * n_expert)].tolist()) for i in range(n_layer)]
        miss = caught = ahead = 0
        for ids, pred in log:
            for i in layers:
                m, p = ids[i] - resident[i], pred[i - 1] - resident[i]
                miss, caught, ahead = miss + len(m), caught + len(m & p), ahead + len(p)
        out["by_fraction"][str(f)] = {"misses_per_layer": miss / pairs, "predicted_share": caught / max(1, miss),
                                      "fetched_ahead_per_layer": ahead / pairs,
                                      "caps": capped(ordered, resident, layers, caps, miss, pairs)}
    return out


def capped(ordered, resident: list[set], layers, caps: list[int], miss: int, pairs: int) -> dict:
    """Per cap and order: the share of the misses the first `cap` guessed misses catch, and the guesses fetched and
    wrong a layer."""
    out = {}
    for cap in caps:
        for order in ("expert", "weight"):
            caught = fetched = 0
            for ids, pred in ordered:
                for i in layers:
                    g = [e for e in pred[i - 1] if e not in resident[i]]
                    g = (sorted(g) if order == "expert" else g)[:cap]
                    fetched += len(g)
                    caught += len(set(g) & (set(ids[i]) - resident[i]))
            out[f"{cap} by {order}"] = {"caught_share": round(caught / max(1, miss), 4),
                                        "fetched_per_layer": round(fetched / pairs, 3),
                                        "wrong_per_layer": round((fetched - caught) / pairs, 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--fractions", default="0.5,0.25")
    ap.add_argument("--caps", default="1,2,3,8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    model = ModelFile(a.model)
    c = model.config
    eng = ReferenceEngine(model)
    tokens = np.random.default_rng(a.seed).integers(0, c.vocab_size, a.tokens)
    doc = {"model": a.model, **summary(trace(eng, tokens), c.n_layer, c.n_expert, c.n_expert_used,
                                       [float(f) for f in a.fractions.split(",")],
                                       [int(n) for n in a.caps.split(",")])}
    print(json.dumps(doc, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
