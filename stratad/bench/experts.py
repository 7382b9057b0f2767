"""The GPU expert kernels (lane/kernels/experts.py) at the a3b shape against the card's copy rate, per expert type:
`stratad bench --scenario experts`. Each result holds its fraction of the copy rate (issue #27 asks >= 20 % of
every type's decode kernels) and whether the kernels gave canonical.expert's bits.

Cases (max_pairs = 256 for all, so one captured graph serves every size; n_pairs lives on the device):
  decode8    one token x 8 experts (8 distinct slots)            - decode; decodeN: N experts (N = 1..64), so
             that a gate/up item count against the SM count shows (a3b: 24 items an expert)
  decode8c   decode8 with the down kernel's combine into the residual, as a decode step with every expert on the
             card runs it (counts, fences, the last warp of a chunk adding the 8 rows in router order)
  tok8x8     8 tokens x 8 experts, router order (~64 slots)      - small prefill chunk
  tok32x8    32 tokens x 8 experts, router order (~110 slots)    - prefill chunk
  shared256  32 tokens all on the same 8 slots, sorted by slot   - weight reuse across pairs
  bus1, bus2, bus8  one token x 1 / 2 / 8 experts read in place from page-locked host memory over the bus, laid
             out as an arena layer (three expert-major tensors); a decode step fetches its misses onto the card
             first (lane/kernels/fetch.cu) and reads them in place only where a matrix is not whole 16-byte words;
             their fraction is of the card's upload rate (host -> device DMA), not of the copy rate
Each timed unit is a CUDA graph of `reps` runs over different pair lists (rotating over a pool of `slots` experts,
more than the L2 holds), replayed `iters` times between CUDA events; time per run = total / (iters * reps).
Bytes = distinct slots a run touches x slot bytes (the weights; activations are < 0.1 %). The copy ceiling is a
device-to-device memcpy of 1 GiB, counting bytes read plus written.

prompt=True times the tiled kernels (run_tiled) on one layer of a prompt chunk instead: `prompt_tokens` tokens x 8
experts routed over 128 experts with a skewed router (expert e drawn with weight (e + 1)^-skew), pairs grouped by
expert and cut into tiles as build_pairs does; reports ms per chunk-layer, the chunk's expert time over 48 layers,
and the integer MAC rate (3 x d_model x d_ff MACs a pair), each variant's bits checked against canonical.expert on
a sample of pairs.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
import time

import numpy as np

from stratad.bench.graph_timing import graph_ms
from stratad.engine import canonical
from stratad.model.quants import decode_int, parse_type, random_rows

F32 = np.float32
VARIANTS = {  # Tuning overrides (lane/kernels/experts.py); tests/test_gpu_experts.py checks each one's bits
    "default": {},
    "iq3-slow": {"iq3_fast": 0},
    "gu8w": {"gu_warps": 8, "gu_min_blocks": 3},
    "gu32w": {"gu_warps": 32, "gu_min_blocks": 1},
    "deep": {"gu_stages": 2, "dn_stages": 4, "dn_rows": 8},
    "dn8w": {"dn_warps": 8, "dn_min_blocks": 4},  # down blocks of 8 warps: on warp items a barrier over fewer loads of h
    "hgroup": {"h_in_down": 0},  # decode gate/up items a block's 32-row group, h quantised there
    "hwarp": {"h_in_down": 2},  # decode gate/up items a warp's rows for every type, h quantised by the down kernel
    "mma-mpw1": {"mma_mpw": 1},  # tensor-core prompt tiles: 32 warps a block, one m-tile each
    "mma-mpw4": {"mma_mpw": 4},  # 8 warps, all four m-tiles each
    "mma-unroll1": {"mma_unroll": 1},  # one leaf a loop iteration (the default is two)
    "mma-mt2": {"mma_mt": 2},  # tensor-core tiles of 32 / 16 pairs at most (the plan's where 64 do not fit)
    "mma-mt1": {"mma_mt": 1},
    "simt": {"prompt": "simt"},  # prompt tiles on the dp4a kernels instead of tensor cores
    "simt-tile16": {"prompt": "simt", "tile_p": 16},
    "simt-tile16-deep": {"prompt": "simt", "tile_p": 16, "gu_stages": 2},
    "simt-tile4": {"prompt": "simt", "tile_p": 4},
}

ONE_TOKEN = re.compile(r"(decode|bus)([1-9]|[1-5][0-9]|6[0-4])")  # one token x N experts, N = 1..64


def make_pairs(rng, case, perm, r, max_pairs):
    n_slots = len(perm)
    one = ONE_TOKEN.fullmatch(case)
    if one:
        n = int(one.group(2))
        slots = [perm[(n * r + i) % n_slots] for i in range(n)]
        pr = [(0, int(s)) for s in slots]
    elif case in ("tok8x8", "tok32x8"):
        nt = 8 if case == "tok8x8" else 32
        pr = [(t, int(s)) for t in range(nt) for s in rng.choice(n_slots, 8, replace=False)]
    elif case == "shared256":
        slots = perm[(8 * r) % n_slots:(8 * r) % n_slots + 8]
        pr = sorted([(t, int(s)) for t in range(32) for s in slots], key=lambda p: p[1])
    else:
        raise ValueError(case)
    a = np.full((max_pairs, 2), -1, np.int32)
    a[:len(pr)] = pr
    return a, len(pr), len({p[1] for p in pr})


def arena_layer(cp, slots: list, gap: int = 0) -> tuple:
    """(gate, up, down) byte rows of each expert as an arena layer holds them: three expert-major tensors in
    page-locked host memory, each 4 KiB-aligned, `gap` bytes (a multiple of 4 KiB) apart. Returns (the memory, to
    keep alive; ExpertKernels.layout args)."""
    sizes = [slots[0][i].nbytes for i in range(3)]
    offs = np.cumsum([0] + [-(-len(slots) * n // 4096) * 4096 + gap for n in sizes])
    mem = cp.cuda.alloc_pinned_memory(int(offs[-1]))
    buf = np.frombuffer(mem, np.uint8, int(offs[-1]))
    for i in range(3):
        buf[offs[i]:offs[i] + len(slots) * sizes[i]] = np.stack([s[i] for s in slots]).reshape(-1)
    ptr = buf.ctypes.data
    return mem, (ptr + int(offs[0]), sizes[0], ptr + int(offs[1]), ptr + int(offs[2]), sizes[2])


def layer_name(qts: tuple) -> str:
    """A layer's types as --types names them: TYPE, or GATE_UP+DOWN where they differ."""
    return qts[0].name if qts[0] == qts[1] else f"{qts[0].name}+{qts[1].name}"


def random_expert(qts: tuple, rng, d_model: int, d_ff: int) -> tuple:
    """One expert's raw (gate, up, down) rows of the layer types qts (gate/up, down)."""
    return (random_rows(qts[0], rng, d_ff, d_model, 1 / np.sqrt(d_model)),
            random_rows(qts[0], rng, d_ff, d_model, 1 / np.sqrt(d_model)),
            random_rows(qts[1], rng, d_model, d_ff, 1 / np.sqrt(d_ff)))


def reference_expert(qts: tuple, mats: tuple, qa, da) -> np.ndarray:
    """canonical.expert of one expert's raw rows on quantised activations."""
    return canonical.expert(decode_int(qts[0], mats[0]), decode_int(qts[0], mats[1]), decode_int(qts[1], mats[2]),
                            qa, da)


def bench_type(cp, qts, variant, opts: "Options", copy_bw, rng, upload_bw=None) -> dict:
    from lane.kernels.experts import ExpertKernels, Tuning, combine_rows_ref

    d_model, d_ff, max_pairs = opts.d_model, opts.d_ff, 256
    k = ExpertKernels(d_model, d_ff, *qts, max_pairs, tuning=Tuning(**VARIANTS[variant]))
    n_uniq = 16
    uniq = [random_expert(qts, rng, d_model, d_ff) for _ in range(n_uniq)]
    uniq_dev = cp.asarray(np.stack([k.pack_slot(*m) for m in uniq]))
    pool = cp.empty((opts.slots, k.slot_stride), cp.uint8)
    for s in range(opts.slots):
        pool[s] = uniq_dev[s % n_uniq]
    T_ = 32
    x = rng.standard_normal((T_, d_model), dtype=F32)
    qa = cp.empty((T_, d_model), cp.int8)
    da = cp.empty((T_, d_model // 32), cp.float32)
    k.quantize(cp.asarray(x), qa, da)
    out = cp.full((max_pairs, d_model), np.nan, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    res = {"qtype": layer_name(qts), "variant": variant, "layout": k.describe(), "cases": {}}

    # exactness spot check on the a3b shape: one decode set against canonical.expert
    perm = rng.permutation(opts.slots)
    pr, n, _ = make_pairs(rng, "decode8", perm, 0, max_pairs)
    pairs = cp.asarray(pr)
    n_dev = cp.asarray(np.array([n], np.int32))
    k.run(pool.data.ptr, pairs, n_dev, qa, da, out)
    cp.cuda.get_current_stream().synchronize()
    qa_ref, da_ref = canonical.quantize_act(x)
    ref = np.stack([reference_expert(qts, uniq[s % n_uniq], qa_ref[t:t + 1], da_ref[t:t + 1])[0] for t, s in pr[:n]])
    got = out.get()[:n]
    res["exact_decode8"] = bool(np.array_equal(got.view(np.uint32), ref.view(np.uint32)))
    # the combine (decode8c): x += the 8 rows in router order, against combine_rows_ref on the same rows
    rowmap = cp.arange(n, dtype=cp.int32)
    w8 = rng.uniform(0.01, 0.3, (1, n)).astype(F32)
    xr = cp.asarray(rng.standard_normal((1, d_model), dtype=F32))
    want_x = combine_rows_ref(xr.get(), w8, list(ref))
    cmb = (rowmap, cp.asarray(w8), xr)
    k.run(pool.data.ptr, pairs, n_dev, qa, da, out, combine=cmb)
    cp.cuda.get_current_stream().synchronize()
    res["exact_decode8c"] = bool(np.array_equal(xr.get().view(np.uint32), want_x.view(np.uint32)))

    host = host_where = None  # the bus cases' arena layer
    for case in opts.cases.split(","):
        bus = case.startswith("bus")
        if bus and host is None:
            host, args = arena_layer(cp, [uniq[s % n_uniq] for s in range(opts.slots)])
            host_where = k.layout(*args)
        where = host_where if bus else pool.data.ptr
        ceil = upload_bw if bus else copy_bw  # what the case's bytes are held against
        combine = cmb if case == "decode8c" else None  # x keeps adding up over the timed runs: only its time counts
        sets = [make_pairs(rng, "decode8" if case == "decode8c" else case, perm, r, max_pairs)
                for r in range(opts.reps)]
        pairs_l = [cp.asarray(s[0]) for s in sets]
        n_dev = cp.asarray(np.array([sets[0][1]], np.int32))
        distinct = float(np.mean([s[2] for s in sets]))
        runs = [lambda p=p: k.run(where, p, n_dev, qa, da, out, combine, stream=stream) for p in pairs_l]
        gus = [lambda p=p: k.run_gate_up(where, p, n_dev, qa, da, stream=stream) for p in pairs_l]
        dns = [lambda p=p: k.run_down(where, p, n_dev, out, combine, stream=stream) for p in pairs_l]
        t_run = graph_ms(cp, stream, runs, opts.iters, 2)
        t_gu = graph_ms(cp, stream, gus, opts.iters, 2)
        t_dn = graph_ms(cp, stream, dns, opts.iters, 2)
        per = opts.iters * opts.reps
        us = [t * 1e3 / per for t in t_run]
        us_gu = [t * 1e3 / per for t in t_gu]
        us_dn = [t * 1e3 / per for t in t_dn]
        b_all = distinct * k.slot_bytes
        b_gu = distinct * 2 * k.gate_bytes
        b_dn = distinct * k.down_bytes
        best = min(us)
        res["cases"][case] = {
            "n_pairs": sets[0][1], "distinct_slots": distinct, "bytes": b_all,
            "us_run": us, "us_gate_up": us_gu, "us_down": us_dn,
            "GBps": b_all / (best * 1e-6) / 1e9, "GBps_gate_up": b_gu / (min(us_gu) * 1e-6) / 1e9,
            "GBps_down": b_dn / (min(us_dn) * 1e-6) / 1e9,
            "floor_us": b_all / (ceil * 1e9) * 1e6,
        }
        res["cases"][case]["frac_upload" if bus else "frac_copy"] = res["cases"][case]["GBps"] / ceil
    stream.synchronize()
    pool = uniq_dev = host = None  # before the pools give their blocks back
    cp.get_default_memory_pool().free_all_blocks()
    return res


def prompt_pairs(rng, n_tok: int, n_expert: int, k: int, skew: float, tile_p: int):
    """A prompt chunk's routing: (pairs (P, 2) of (token, expert) grouped by expert, tiles (max_tiles, 2) of (first
    pair, count), number of tiles)."""
    from lane.kernels.experts import max_tiles, tiles_ref

    w = (np.arange(n_expert) + 1.0) ** -skew
    ids = np.stack([rng.choice(n_expert, k, replace=False, p=w / w.sum()) for _ in range(n_tok)])
    pr = sorted(((t, int(e)) for t in range(n_tok) for e in ids[t]), key=lambda p: p[1])
    pairs = np.array(pr, np.int32)
    return (pairs, *tiles_ref(pairs[:, 1], max_tiles(len(pr), n_expert, tile_p), tile_p))


def bench_prompt(cp, qts, variant, opts: "Options", rng) -> dict:
    from lane.kernels.experts import ExpertKernels, Tuning

    d_model, d_ff, n_expert, T_ = opts.d_model, opts.d_ff, 128, opts.prompt_tokens
    tuning = Tuning(**VARIANTS[variant])
    k = ExpertKernels(d_model, d_ff, *qts, T_ * 8, tuning=tuning)
    pairs_h, tiles_h, n_tiles = prompt_pairs(rng, T_, n_expert, 8, opts.skew, k.tile_p)  # tiles of k's prompt kernel
    P = pairs_h.shape[0]
    mats = [random_expert(qts, rng, d_model, d_ff) for _ in range(8)]
    packed = cp.asarray(np.stack([k.pack_slot(*m) for m in mats]))
    pool = cp.empty((n_expert, k.slot_stride), cp.uint8)
    for e in range(n_expert):
        pool[e] = packed[e % len(mats)]
    x = rng.standard_normal((T_, d_model), dtype=F32)
    qa = cp.empty((T_, d_model), cp.int8)
    da = cp.empty((T_, d_model // 32), cp.float32)
    k.quantize(cp.asarray(x), qa, da)
    out = cp.full((P, d_model), np.nan, cp.float32)
    pairs, tiles = cp.asarray(pairs_h), cp.asarray(tiles_h)
    n_dev = cp.asarray(np.array([n_tiles], np.int32))
    stream = cp.cuda.Stream(non_blocking=True)
    tiled = [lambda: k.run_tiled(pool.data.ptr, pairs, tiles, n_dev, qa, da, out, stream=stream)]
    ms = [t / opts.iters for t in graph_ms(cp, stream, tiled, opts.iters, 2)]
    qa_ref, da_ref = canonical.quantize_act(x)
    got = out.get()
    sample = rng.choice(P, 16, replace=False)
    ref = np.stack([reference_expert(qts, mats[int(pairs_h[i, 1]) % len(mats)], qa_ref[pairs_h[i, 0]:pairs_h[i, 0] + 1],
                                     da_ref[pairs_h[i, 0]:pairs_h[i, 0] + 1])[0] for i in sample])
    best = min(ms)
    pool = packed = None
    cp.get_default_memory_pool().free_all_blocks()
    return {"qtype": layer_name(qts), "variant": variant, "layout": k.describe(), "tokens": T_, "pairs": P,
            "tiles": n_tiles, "skew": opts.skew, "ms_per_layer": ms, "ms_chunk_48_layers": 48 * best,
            "tmac_s": P * 3 * d_model * d_ff / (best * 1e-3) / 1e12,
            "exact_sample": bool(np.array_equal(got[sample].view(np.uint32), ref.view(np.uint32)))}


FRACTION_MIN = 0.2  # issue #27: no type's decode kernels below this fraction of the copy rate


@dataclasses.dataclass
class Options:
    """What `stratad bench --scenario experts` varies (its flags of the same names)."""
    types: str = "all"  # comma list of expert types, or all
    variants: str = "default"  # comma list of VARIANTS; 'type:variant' applies to that type only
    cases: str = "decode8,decode8c"
    slots: int = 128
    reps: int = 16
    iters: int = 20
    d_model: int = 2048
    d_ff: int = 768
    prompt: bool = False
    prompt_tokens: int = 1024
    skew: float = 1.0

    @classmethod
    def from_args(cls, ns) -> "Options":
        """From the parsed command line: its flags leave no attribute where not given (argparse.SUPPRESS), so a
        default is only ever this class's."""
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})


def expert_types(spec: str) -> list[tuple]:
    """The layers of a --types value: all (every expert type), or a comma list of TYPE (gate/up and down of that
    type) or GATE_UP+DOWN (a mixed layer, as llama.cpp's mixes write them); (gate/up type, down type) each.
    ValueError naming a type that is none."""
    from stratad.model import quants

    if spec == "all":
        return [(t, t) for t in quants.EXPERT_TYPES]
    layers = []
    for entry in spec.split(","):
        names = entry.split("+")
        if len(names) > 2:
            raise ValueError(f"{entry}: a layer is TYPE or GATE_UP+DOWN")
        layers.append(tuple(parse_type(n) for n in (names * 2)[:2]))
    bad = sorted({t.name for lt in layers for t in lt if t not in quants.EXPERT_TYPES})
    if bad:
        raise ValueError(f"not an expert type: {', '.join(bad)}")
    return layers


CASES = ("decode8", "decode8c", "tok8x8", "tok32x8", "shared256", "bus1", "bus2", "bus8")  # and decodeN, busN


def variants(spec: str) -> list[str]:
    """A --variants value's entries (NAME or TYPE:NAME of VARIANTS); ValueError naming one that is none."""
    out = spec.split(",")
    bad = [v for v in out if v.split(":")[-1] not in VARIANTS or (":" in v and v.count(":") > 1)]
    if bad:
        raise ValueError(f"unknown variant {', '.join(bad)}; the variants: {', '.join(VARIANTS)}")
    return out


def cases(spec: str) -> list[str]:
    """A --cases value's cases; ValueError naming one that is none."""
    out = spec.split(",")
    bad = [c for c in out if c not in CASES and not ONE_TOKEN.fullmatch(c)]
    if bad:
        raise ValueError(f"unknown case {', '.join(bad)}; the cases: {', '.join(CASES)}, decodeN, busN (N <= 64)")
    return out


def summary(results: list, opts: Options, copy_bw: float, copy_all: list) -> dict:
    """The scenario's JSON body: each result, the floor, and (decode cases) the target and the types whose default
    kernels are below it."""
    out = {"scenario": "experts", "options": dataclasses.asdict(opts), "copy_GBps": copy_bw, "copy_GBps_runs": copy_all,
           "floor": "the weights a run reads (distinct slots x slot bytes) at the card's device-to-device copy rate "
                    "(bytes read + written)", "results": results}
    if not opts.prompt and "decode8" in opts.cases.split(","):  # the target is held against decode8's fraction
        out["targets"] = {"fraction_min": FRACTION_MIN}
        out["below_target"] = sorted({r["qtype"] for r in results
                                      if r["variant"] == "default" and r["fraction"] < FRACTION_MIN})
    return out


def run(opts: Options) -> dict:
    """Every type and variant asked for; a progress line a result on stderr, a table at the end."""
    import cupy as cp

    from stratad.bench.hardware import gpu_copy_bandwidth, gpu_upload_bandwidth

    types = expert_types(opts.types)
    copy_bw, copy_all = gpu_copy_bandwidth(cp)
    upload_bw = gpu_upload_bandwidth(cp)[0] if any(c.startswith("bus") for c in opts.cases.split(",")) else None
    rng = np.random.default_rng(int(time.time()))
    results = []
    for qts in types:
        tname = layer_name(qts)
        for v in opts.variants.split(","):
            if ":" in v:
                vt, v = v.split(":")
                if vt != tname:
                    continue
            t0 = time.time()
            if opts.prompt:
                r = bench_prompt(cp, qts, v, opts, rng)
                line = {k: r[k] for k in ("qtype", "variant", "tiles", "ms_chunk_48_layers", "tmac_s", "exact_sample")}
            else:
                r = bench_type(cp, qts, v, opts, copy_bw, rng, upload_bw)
                if "decode8" in r["cases"]:
                    r["fraction"] = round(r["cases"]["decode8"]["frac_copy"], 4)
                line = {"type": tname, "variant": v, "exact": r["exact_decode8"] and r["exact_decode8c"],
                        "fraction": r.get("fraction"), **{c: round(d["us_run"][0], 2) for c, d in r["cases"].items()}}
            r["wall_s"] = time.time() - t0
            results.append(r)
            print(json.dumps(line), file=sys.stderr, flush=True)
    out = summary(results, opts, copy_bw, copy_all)
    if upload_bw is not None:
        out["upload_GBps"] = upload_bw
    if not opts.prompt:
        _table(out)
    return out


def _table(doc: dict) -> None:
    print(f"copy {doc['copy_GBps']:.0f} GB/s (read+write)", file=sys.stderr)
    print(f"{'type':7} {'variant':16} {'case':10} {'pairs':>5} {'slots':>6} {'us/run':>8} {'gu us':>7} {'dn us':>7} "
          f"{'GB/s':>6} {'gu GB/s':>7} {'dn GB/s':>7} {'%ceil':>7} {'floor':>6} exact", file=sys.stderr)
    print("(%ceil: of the copy rate; of the upload rate, marked u, for the bus cases)", file=sys.stderr)
    for r in doc["results"]:
        for c, d in r["cases"].items():
            pct = f"{100 * d['frac_upload']:5.1f}%u" if "frac_upload" in d else f"{100 * d['frac_copy']:5.1f}% "
            print(f"{r['qtype']:7} {r['variant']:16} {c:10} {d['n_pairs']:5d} {d['distinct_slots']:6.1f} "
                  f"{min(d['us_run']):8.2f} {min(d['us_gate_up']):7.2f} {min(d['us_down']):7.2f} {d['GBps']:6.0f} "
                  f"{d['GBps_gate_up']:7.0f} {d['GBps_down']:7.0f} {pct} "
                  f"{d['floor_us']:6.2f} {r['exact_decode8c' if c == 'decode8c' else 'exact_decode8']}",
                  file=sys.stderr)
