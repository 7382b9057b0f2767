#!/usr/bin/env python3
"""Where a GPU lane's decode step spends its time (lane/cupy_card.py), on a generated or given model.

For each cache fraction: a prompt is read, then
  step     the whole decode step as the card replays it (CUDA graphs; host serves between layers when experts are
           missing), ms per token over --tokens tokens, host clock: the card's own greedy tokens, sampled on the
           card with the next step launched ahead, as a Generation (and the engine bench) runs them, so that the
           routing and the misses are the bench's (prompt tokens fed in miss about half the bytes partly resident);
  eager    the same step with graphs off (every launch from Python), ms per token;
  ops      each operation of the step captured alone as a graph and replayed --iters times between CUDA events
           (GPU time of its kernels without launch gaps), summed by kind over the 48 layers;
  serve    the host part between layers (doorbell wait, CPU pool, next launch): step time minus the graphs'
           device time, per layer;
  kernels  (every expert on the card) each kernel launch of one step captured alone and replayed --iters times:
           device ms per kernel name summed over the step, and launches per step.
  marginal (every expert on the card, --marginal) the step's graph captured again with every launch of one kernel
           doubled, for each kernel whose second launch leaves the state as the first did (not the o mat-vec or
           the down kernel, which add to the residual): the step's extra ms is that kernel's cost inside the real
           graph, PDL overlap and boundary waits included (the second launch finds its weights in L2: an estimate of
           what removing the launch would save, not of its bytes).
  plans    (every expert on the card, --plan-sweep) the step's ms with one mat-vec shape of the step (the qkv, o,
           router and head weights) on each other plan of weights.PLANS in turn, and a mix's stacked qkv pair on
           each of PAIR_PLANS: the plans inside the real graph, where the dense bench times them alone.
  timeline (--timeline; needs the cupti-python package) the replayed step's kernels as the GPU ran them, from
           CUPTI's kernel records (the device machine has no nsys): per kernel name its launches a step, its device
           time (start to end, PDL's early start included), what it adds to the step's critical path (its end
           minus the latest end before it), how long before that end it started (lead), its launch shape, and
           the step's busy time (some kernel running). At any fraction: partly resident, the kernels that read the
           misses from the arena (the same names) run among the card's, on a stream of their own. Unlike `kernels` and
           `marginal` it covers the o mat-vec and the down kernel and needs no replay of a kernel alone.
Prints a table last; --json writes everything.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profile_report import model_path, report  # noqa: E402
from lane.kernels import (attention, device, embedding, experts, gemm, matvec, norm, rope_kv, router,  # noqa: E402
                          sampling, weights)
from stratad.config import GpuOptions  # noqa: E402
from stratad.engine.sampling import SamplingParams  # noqa: E402
from stratad.model.gguf_file import ModelFile  # noqa: E402

# every kernel module that launches through its own `launch` name (patched to time or spy on the launches)
LAUNCHERS = (attention, embedding, experts, gemm, matvec, norm, rope_kv, router, sampling, weights)


def graph_time_ms(cp, stream, fn, iters: int) -> float:
    """Median device time of fn's launches, captured once and replayed."""
    stream.begin_capture()
    try:
        fn()
    finally:
        g = stream.end_capture()
    g.launch(stream)
    times = []
    for _ in range(iters):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        g.launch(stream)
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def kernel_times(cp, card, ops, iters: int) -> dict:
    """Device ms of one step by kernel name: the step's operations run once eagerly, each kernel launch captured
    alone and replayed (side effects repeat: only for steps without a doorbell, i.e. full coverage)."""
    from collections import defaultdict

    names = kernel_names(card)
    plain = experts.launch
    ms, count = defaultdict(float), defaultdict(int)

    def timed(fn, grid, block, args, shared_mem=0, pdl=True):
        f = getattr(fn, "kernel", fn)
        name = names.get(id(f), names.get(id(fn), "?"))
        ms[name] += graph_time_ms(cp, card.stream, lambda: plain(fn, grid, block, args, shared_mem, pdl), iters)
        count[name] += 1
        plain(fn, grid, block, args, shared_mem, pdl)

    for mod in LAUNCHERS:
        mod.launch = timed
    try:
        for op in ops:
            op()
        card.stream.synchronize()
    finally:
        for mod in LAUNCHERS:
            mod.launch = plain
    return {n: {"ms": ms[n], "launches": count[n]} for n in sorted(ms, key=ms.get, reverse=True)}


# kernels a decode step may launch twice without changing its state (they write what they read from elsewhere)
IDEMPOTENT = ("norm_matvec_", "attn_split_", "attn_combine", "route_pairs", "expert_gateup", "matvec_q8_0_r4_k1",
              "argmax", "rms_norm_rows")


def kernel_names(card) -> dict:
    """id(CuPy function) -> kernel name, for the dense op modules and the card's expert kernels."""
    names = {}
    for mod in device._mods.values():
        names.update({id(f): n for n, f in mod._fns.items()})
    for k in card.experts.kernels.values():
        names.update({id(f): n.lstrip("_") for n, f in vars(k).items() if type(f).__name__ == "Function"})
        names.update({id(f): n for n, f in k._extra.items()})
    return names


def own_tokens(card, kv, token: int, n: int) -> int:
    """n greedy decode steps from `token`, each fed the card's own choice (sampled on the card, the next step
    launched ahead, as a Generation runs them); returns the last token."""
    greedy = SamplingParams(temperature=0.0)
    for i in range(n):
        token, _ = card.forward_token([token], kv, greedy, 0.0, False, ahead=0.0 if i + 1 < n else None)
    return token


def decode_ms(card, kv, prompt, tokens: int) -> float:
    """ms a decode step over `tokens` steps replayed from the card's graphs (captured first)."""
    import cupy as cp

    card.forward([int(prompt[0])], kv)  # capture
    cp.cuda.runtime.deviceSynchronize()
    t = time.perf_counter()
    for i in range(tokens):
        card.forward([int(prompt[i])], kv)
    return (time.perf_counter() - t) / tokens * 1e3


def patched_ms(card, kv, prompt, tokens: int, mods, attr: str, value) -> float:
    """decode_ms with attr of each module in mods replaced by value (the step's graphs captured again), restored
    after."""
    old = [getattr(m, attr) for m in mods]
    for m in mods:
        setattr(m, attr, value)
    try:
        card._graphs.clear()
        return decode_ms(card, kv, prompt, tokens)
    finally:
        for m, o in zip(mods, old):
            setattr(m, attr, o)


def marginal_ms(card, kv, prompt, tokens: int) -> dict:
    """Per idempotent kernel name launched in a step: the step's ms with its launches doubled, less the step's ms
    (the mean of a plain run before and after)."""
    names = kernel_names(card)
    plain = experts.launch
    seen = set()

    def spy(fn, grid, block, args, shared_mem=0, pdl=True):
        seen.add(names.get(id(getattr(fn, "kernel", fn)), names.get(id(fn), "?")))
        plain(fn, grid, block, args, shared_mem, pdl)

    base0 = patched_ms(card, kv, prompt, tokens, LAUNCHERS, "launch", spy)
    out = {}
    for name in sorted(n for n in seen if n.startswith(IDEMPOTENT)):
        def twice(fn, grid, block, args, shared_mem=0, pdl=True, name=name):
            plain(fn, grid, block, args, shared_mem, pdl)
            if names.get(id(getattr(fn, "kernel", fn)), names.get(id(fn))) == name:
                plain(fn, grid, block, args, shared_mem, pdl)

        out[name] = patched_ms(card, kv, prompt, tokens, LAUNCHERS, "launch", twice)
    card._graphs.clear()
    base = (base0 + decode_ms(card, kv, prompt, tokens)) / 2
    return {"step_ms": base, "step_ms_first": base0,
            "extra_ms": {n: round(t - base, 4) for n, t in sorted(out.items(), key=lambda x: x[0])}}


def plan_sweep(card, kv, prompt, tokens: int, pairs: int = 2) -> dict:
    """Each mat-vec shape of the step given each other plan in turn (the rest at their defaults): the step's ms
    against the default's, measured in `pairs` alternating pairs from the same position (the cache cut back to
    where the sweep began), the delta the median of the pairs' (a sweep with one base run and the positions
    advancing through it read 0.2 ms apart for two entries that ran the same kernel, session 16). The single
    weights (weights.default_plan over PLANS) and the stacked pairs of a mix's qkv (weights.pair_plan over
    PAIR_PLANS; qtype -1 in the output)."""
    start = kv.length
    # (4, 1) is the tall matrices' default (the LM head) and has no norm_matvec instance: never an alternative
    chooser = {"default_plan": (weights.default_plan, weights.PLANS, lambda q, r, c: (int(q), int(r), int(c))),
               "pair_plan": (weights.pair_plan, weights.PAIR_PLANS, lambda r, c: (-1, int(r), int(c)))}
    shapes = {attr: {} for attr in chooser}  # key -> the arguments of a call

    def step_ms(attr, fn) -> float:
        kv.truncate(start)
        return patched_ms(card, kv, prompt, tokens, (weights,), attr, fn)

    def spied(attr):
        default, _, key = chooser[attr]

        def spy(*a):
            shapes[attr][key(*a)] = a
            return default(*a)
        return spy

    base = [step_ms(attr, spied(attr)) for attr in chooser]
    out = []
    for attr, (default, plans, key) in chooser.items():
        for shape, args in sorted(shapes[attr].items(), key=lambda e: e[0]):
            for plan in (p for p in plans if p not in ((4, 1), default(*args))):
                def pick(*a, shape=shape, plan=plan, default=default, key=key):
                    return plan if key(*a) == shape else default(*a)

                runs = [(step_ms(attr, default), step_ms(attr, pick)) for _ in range(pairs)]
                base += [b for b, _ in runs]
                out.append({"qtype": shape[0], "rows": shape[1], "cols": shape[2], "default": list(default(*args)),
                            "plan": list(plan), "step_ms": round(statistics.median(c for _, c in runs), 4),
                            "delta_ms": round(statistics.median(c - b for b, c in runs), 4),
                            "pairs": [[round(b, 4), round(c, 4)] for b, c in runs]})
    card._graphs.clear()
    return {"step_ms": round(statistics.median(base), 4), "pairs": pairs, "plans": out}


class KernelRecords:
    """CUPTI's kernel records from now on (enabled before the card exists, so that its graphs are instantiated
    under tracing and their kernel nodes are recorded)."""

    def __init__(self):
        from cupti import cupti

        self.cupti, self.kind, self.recs, self.shapes = cupti, cupti.ActivityKind.CONCURRENT_KERNEL, [], {}
        cupti.activity_register_callbacks(lambda: (8 << 20, 0), self._completed)
        cupti.activity_enable(self.kind)

    def _completed(self, acts):
        for a in acts:
            if a.kind == self.kind:
                self.recs.append((a.start, a.end, a.name))
                # the launch's shape: which kernels' blocks can share an SM (PDL starts a kernel under the last)
                self.shapes[a.name] = {"blocks": a.grid_x * a.grid_y * a.grid_z,
                                       "threads": a.block_x * a.block_y * a.block_z,
                                       "registers": a.registers_per_thread,
                                       "smem": a.static_shared_memory + a.dynamic_shared_memory}

    def now(self) -> int:
        return self.cupti.get_timestamp()

    def since(self, t0: int) -> list:
        self.cupti.activity_flush_all(1)
        return sorted(r for r in self.recs if r[0] >= t0)


def timeline(card, kv, token: int, tokens: int, records: KernelRecords) -> dict:
    """`tokens` replayed decode steps' kernel records (the card's own tokens from `token`, as the step is timed),
    summed by kernel name a step (module docstring)."""
    import cupy as cp

    token = own_tokens(card, kv, token, 1)  # the graph exists before the window (captured at most once)
    cp.cuda.runtime.deviceSynchronize()
    t0 = records.now()
    t = time.perf_counter()
    own_tokens(card, kv, token, tokens)
    cp.cuda.runtime.deviceSynchronize()
    wall_ms = (time.perf_counter() - t) / tokens * 1e3
    return {"wall_ms": wall_ms, **step_stats(records.since(t0), records.shapes)}


def step_stats(recs: list, shapes: dict) -> dict:
    """Kernel records (start ns, end ns, name), sorted by start, of whole decode steps (each begins with its
    embedding lookup) -> the steps' mean span and busy time, and per kernel name its launches, device time, path
    and lead a step (module docstring) with its launch shape from `shapes`."""
    steps, cur = [], []
    for r in recs:  # a step starts with its embedding lookup
        if r[2].startswith("embed_rows") and cur:
            steps.append(cur)
            cur = []
        cur.append(r)
    steps.append(cur)
    steps = [s for s in steps if s and s[0][2].startswith("embed_rows")]
    if not steps:
        raise RuntimeError("no decode step among CUPTI's kernel records")
    by = {}
    span = busy = 0
    for s in steps:
        last = s[0][0]
        busy_end = s[0][0]
        for start, end, name in s:
            e = by.setdefault(name, {"launches": 0, "device_us": 0.0, "path_us": 0.0, "lead_us": 0.0})
            e["launches"] += 1
            e["device_us"] += (end - start) / 1e3
            e["path_us"] += max(0, end - last) / 1e3
            e["lead_us"] += max(0, last - start) / 1e3  # started this long before its predecessor ended (PDL)
            busy += max(0, end - max(start, busy_end))
            busy_end = max(busy_end, end)
            last = max(last, end)
        span += last - s[0][0]
    n = len(steps)
    for name, e in by.items():
        for k in e:
            e[k] /= n
        e.update(shapes.get(name, {}))
    return {"steps": n, "span_ms": span / n / 1e6, "busy_ms": busy / n / 1e6,
            "kernels": dict(sorted(by.items(), key=lambda kv: -kv[1]["path_us"]))}


def profile(path: str, fraction: float, context: int, tokens: int, iters: int, host_experts: str = "card",
            marginal: bool = False, sweep: bool = False, trace: bool = False, pdl: bool = True) -> dict:
    import cupy as cp

    from lane.cupy_card import CupyCard
    from lane.gpu_model import Break

    model = ModelFile(path)
    c = model.config
    total = c.n_layer * c.n_expert
    n = int(fraction * total)
    # the engine bench's routing pass and prompt (stratad/bench/engine.py), so that the resident set and the
    # decoded tokens, hence the misses, are the bench's
    warm = [int(t) for t in np.random.default_rng(0).integers(0, 2000, 512)]
    prompt = [int(t) for t in np.random.default_rng(context).integers(0, 2000, size=context)]
    out = {"fraction": fraction, "context": context, "host_experts": host_experts, "pdl": pdl}
    records = KernelRecords() if trace else None  # before the card: its step timings then run under tracing too
    extra = ((len(IDEMPOTENT) + 8) * (tokens + 1) if marginal else 0) + (32 * (tokens + 1) if sweep else 0) + \
        ((tokens + 1) if trace else 0)
    for graphs in (True, False):
        card = CupyCard(model, 0, n, context + tokens + iters + 64 + extra, graphs=graphs,
                        host_experts=host_experts, options=GpuOptions(pdl=pdl))
        card.forward(warm, card.new_kv(), logits="none")  # routing profile with nothing resident
        order = np.lexsort((np.arange(total), -card.counts.reshape(-1)))
        card.pool.fill([(int(i // c.n_expert), int(i % c.n_expert)) for i in order[:n]])
        kv = card.new_kv()
        token = int(np.argmax(card.forward(prompt, kv, logits="last")[-1]))  # the greedy first token
        token = own_tokens(card, kv, token, 2)  # capture
        cp.cuda.runtime.deviceSynchronize()
        before = card.counters.copy()
        t = time.perf_counter()
        token = own_tokens(card, kv, token, tokens)
        out["step_ms" if graphs else "eager_ms"] = (time.perf_counter() - t) / tokens * 1e3
        if graphs:  # the share of the step's experts the card read from the arena (the bench's host_read_share)
            d = card.counters.minus(before)
            out["host_read_share"] = d.host_read / max(1, d.total)
        # a guess fetched ahead ([gpu] fetch_ahead) forks in one layer's op and joins in the next: no op is
        # captured alone
        ahead = card.experts.arena is not None and card.experts.arena.ahead and card.experts.full
        if graphs and ahead:
            out["ops_alone"] = "not timed: the next layer's misses are fetched ahead ([gpu] fetch_ahead)"
        if graphs and not ahead:
            w = card.decode_work
            # the operations, in order: embed, (attend + route + front, back) x layers, finish
            ops = [op for op in card.net.ops(w, 1) if not isinstance(op, Break)]
            with card.device, card.stream:
                t_each = [graph_time_ms(cp, card.stream, op, iters) for op in ops]
            L = c.n_layer
            out["embed_ms"] = t_each[0]
            out["attend_route_front_ms"] = float(sum(t_each[1:1 + 2 * L:2]))
            out["back_ms"] = float(sum(t_each[2:2 + 2 * L:2]))
            out["finish_ms"] = t_each[-1]
            out["device_sum_ms"] = float(sum(t_each))
            out["full_coverage"] = card.experts.full
            out["host_per_layer_us"] = (out["step_ms"] - out["device_sum_ms"]) / L * 1e3
            if card.experts.full:
                with card.device, card.stream:
                    out["kernels"] = kernel_times(cp, card, ops, iters)
                if marginal:
                    out["marginal"] = marginal_ms(card, kv, prompt, tokens)
                if sweep:
                    out["plan_sweep"] = plan_sweep(card, kv, prompt, tokens)
        if graphs:
            if trace:  # partly resident too: the arena's kernels on their side stream among the card's
                out["timeline"] = timeline(card, kv, token, tokens, records)
            cnt = card.counters
            out["cpu_share"] = cnt.cpu / max(1, cnt.total)
        card.close()
        del card
        cp.get_default_memory_pool().free_all_blocks()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="GGUF file (default: generate the a3b IQ3_S preset)")
    p.add_argument("--fractions", default="1.0,0.5")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--host-experts", choices=["cpu", "card"], default="card")
    p.add_argument("--marginal", action="store_true", help="each idempotent kernel's cost inside the step's graph")
    p.add_argument("--plan-sweep", action="store_true", help="each mat-vec shape on each other plan, in the graph")
    p.add_argument("--timeline", action="store_true", help="the step's kernels as the GPU ran them (CUPTI)")
    p.add_argument("--no-pdl", action="store_true", help="captured steps without programmatic dependent launch")
    p.add_argument("--json")
    a = p.parse_args()
    path = model_path(a.model)
    rows = [profile(path, float(f), a.context, a.tokens, a.iters, a.host_experts, a.marginal, a.plan_sweep,
                    a.timeline, not a.no_pdl)
            for f in a.fractions.split(",")]
    keys = ["fraction", "step_ms", "eager_ms", "device_sum_ms", "attend_route_front_ms", "back_ms", "finish_ms",
            "host_per_layer_us", "cpu_share", "host_read_share"]
    report(rows, keys, a.json)
    for r in rows:
        for name, k in r.get("kernels", {}).items():
            print(f"  {r['fraction']:.2f} {name:40s} {k['ms']:8.3f} ms {k['launches']:4d} launches")
        if "marginal" in r:
            m = r["marginal"]
            print(f"  {r['fraction']:.2f} step {m['step_ms']:.3f} ms (first run {m['step_ms_first']:.3f}); "
                  "launched twice, the step gains:")
            for name, ms in m["extra_ms"].items():
                print(f"  {r['fraction']:.2f}   {name:40s} {ms:+8.3f} ms")
        if "timeline" in r:
            tl = r["timeline"]
            print(f"  {r['fraction']:.2f} timeline over {tl['steps']} steps: wall {tl['wall_ms']:.3f} ms a step, "
                  f"kernels span {tl['span_ms']:.3f}, busy {tl['busy_ms']:.3f}; us a step: path / device / lead / launches; "
                  "blocks x threads, registers, shared memory a block")
            for name, k in tl["kernels"].items():
                print(f"  {r['fraction']:.2f}   {name:40s} {k['path_us']:8.1f} {k['device_us']:8.1f} "
                      f"{k['lead_us']:8.1f} {k['launches']:5.0f}"
                      f"  {k.get('blocks', 0):5d} x {k.get('threads', 0):4d}, {k.get('registers', 0):3d} regs, "
                      f"{k.get('smem', 0) / 1024:5.1f} KB")
        if "plan_sweep" in r:
            sw = r["plan_sweep"]
            print(f"  {r['fraction']:.2f} step {sw['step_ms']:.3f} ms at the default plans; with one shape's plan changed:")
            for e in sw["plans"]:
                print(f"  {r['fraction']:.2f}   qtype {e['qtype']:2d} {e['rows']:6d} x {e['cols']:5d} {e['default']} -> "
                      f"{e['plan']}: {e['step_ms']:.3f} ms ({e['delta_ms']:+.3f}, paired)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
