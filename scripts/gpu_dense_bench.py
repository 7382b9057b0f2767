#!/usr/bin/env python3
"""Time the dense-path GPU kernels (lane/kernels: matvec, gemm, norm, attention, ...) at the a3b shape against the
copy bandwidth.

Each decode kernel is timed as a CUDA graph of launches replayed between CUDA events (median of --repeats), so
launch overhead is the graph's (~1 us), not Python's. Weights smaller than ~3x the L2 are rotated over several
copies inside the graph so every launch reads from DRAM (--warm: one copy, read from L2 after the first launch, as
a weight prefetched into L2 would be; --match TEXT: only the mat-vec cases whose name holds TEXT). Attention runs
over 48 layer caches (as a decode step does). Batched (prefill) GEMMs are event-timed eagerly (cuBLAS per-call
temporaries cannot be captured).
Floor = bytes that must move / measured copy bandwidth. Prints a table last; --json writes everything.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as T  # noqa: E402

from stratad.bench.graph_timing import graph_ms  # noqa: E402
from lane.kernels import (attention, device, embedding, gemm, matvec, norm, rope_kv, router, sampling,  # noqa: E402
                          weights)
from stratad.model import quants  # noqa: E402

F32 = np.float32
L2_BYTES = 60 << 20
A3B = dict(d=2048, n_head=32, n_kv=4, hd=128, n_exp=128, k=8, vocab=151936, n_layer=48, max_ctx=131072)


def graph_us(cp, fns, iters=20, repeats=5):
    """Median microseconds per call of fns (a list of launches, each taking the stream, captured as one graph)."""
    cp.cuda.Device().synchronize()  # inputs were written on the null stream: let them land first
    s = cp.cuda.Stream(non_blocking=True)
    out = [t * 1e3 / (iters * len(fns)) for t in graph_ms(cp, s, [lambda f=f: f(s) for f in fns], iters, repeats)]
    return float(np.median(out)), out


def eager_us(cp, fn, iters=10, warm=3):
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for _ in range(warm):
            fn(s)
        s.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        out = []
        for _ in range(iters):
            e0.record(s)
            fn(s)
            e1.record(s)
            e1.synchronize()
            out.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return float(np.median(out)), out


def rand_raw(rng, qt, rows, cols):
    raw = quants.random_rows(qt, rng, rows, cols, 1 / np.sqrt(cols))
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)


def weight_copies(cp, rng, qt, rows, cols, max_copies=16):
    """A weight and the copies its launches rotate over so that each reads from DRAM (max_copies = 1, --warm: none,
    so that after the first launch it reads from L2, as a weight prefetched into L2 would)."""
    raw = rand_raw(rng, qt, rows, cols)
    w0 = weights.DenseWeight.upload(raw, qt, cols)
    n = 1 if w0.nbytes >= 3 * L2_BYTES else min(max_copies, math.ceil(3 * L2_BYTES / w0.nbytes))
    ws = [w0] + [weights.DenseWeight(w0.data.copy(), qt, cols) for _ in range(n - 1)]
    return ws


def rec(name, us, nbytes, bw, **kw):
    r = {"name": name, "us": us, "bytes": nbytes, "GBps": nbytes / (us * 1e-6) / 1e9 if us else None,
         "floor_us": nbytes / (bw * 1e9) * 1e6}
    r["frac_copy"] = r["GBps"] / bw if r["GBps"] else None
    r.update(kw)
    return r


def bench_matvec(cp, rng, bw, out, warm=False, match=""):
    c = A3B
    cases = [("q 2048->4096", T.Q8_0, 4096, 2048), ("k/v 2048->512", T.Q8_0, 512, 2048),
             ("o 4096->2048", T.Q8_0, 2048, 4096), ("qkv 2048->5120", T.Q8_0, 5120, 2048),
             ("router 2048->128", T.F32, 128, 2048), ("lm_head 2048->151936", T.Q8_0, c["vocab"], 2048),
             ("q 2048->4096", T.F16, 4096, 2048), ("q 2048->4096", T.BF16, 4096, 2048),
             ("q 2048->4096", T.F32, 4096, 2048), ("lm_head 2048->151936", T.F16, c["vocab"], 2048),
             ("lm_head 2048->151936", T.BF16, c["vocab"], 2048),
             # llama.cpp mixes' types: iq3_s's q / o, q4_k_m's, their LM head; read as the file holds them
             # (matvec.cuh FileBlk) and, for the A/B, packed (weights.PackedRows, what they were read as before)
             ("q 2048->4096", T.IQ3_S, 4096, 2048), ("o 4096->2048", T.IQ3_S, 2048, 4096),
             ("q 2048->4096", T.Q4_K, 4096, 2048), ("o 4096->2048", T.Q4_K, 2048, 4096),
             ("v 2048->512", T.Q6_K, 512, 2048), ("lm_head 2048->151936", T.Q6_K, c["vocab"], 2048)]
    for name, qt, rows, cols in cases:
        if match not in f"{name} {qt.name}":
            continue
        ws = weight_copies(cp, rng, qt, rows, cols, 1 if warm else 16)
        xh = rng.standard_normal(cols, dtype=F32)
        x, xq = cp.asarray(xh), cp.asarray(matvec.quantize_row(xh))  # float x, and x on 8 bits (qx)
        y = cp.empty(rows, cp.float32)
        forms = ["file", "packed"] if qt in device.FILE_BLK and qt != T.Q8_0 else [""]
        for form in forms:
            if form == "packed":
                for w in ws:
                    w.packed = weights.PackedRows.pack(w)
            packed = ws[0].packed is not None
            default = ws[0].plan()
            plans = weights.PLANS if qt in device.FILE_BLK or packed or name.startswith("router") else [default]
            for qx in (False, True) if ws[0].takes_qx else (False,):
                xb = xq.nbytes if qx else 4 * cols
                nbytes = (ws[0].packed.nbytes if packed else ws[0].nbytes) + 4 * rows + xb  # what the kernel reads
                res = {}
                for plan in plans:
                    # 16 launches an iteration whatever the copies, so that --warm's graphs amortise their start alike
                    us, _ = graph_us(cp, [lambda s, w=ws[j % len(ws)], p=plan, q=qx:
                                          matvec.matvec(w, xq if q else x, y, plan=p, qx=q, stream=s)
                                          for j in range(16)])
                    res[f"r{plan[0]}k{plan[1]}"] = us
                best = min(res, key=res.get)
                dkey = f"r{default[0]}k{default[1]}"
                label = " ".join(t for t in (qt.name, form, "qx" if qx else "") if t)
                out.append(rec(f"matvec {name} {label}", res[dkey], nbytes, bw, plan=dkey, plans=res, best=best,
                               copies=len(ws)))
        del ws
        cp.get_default_memory_pool().free_all_blocks()


def bench_batched(cp, rng, bw, out):
    for name, rows, cols in [("q 2048->4096", 4096, 2048), ("k/v 2048->512", 512, 2048), ("o 4096->2048", 2048, 4096),
                             ("qkv 2048->5120", 5120, 2048)]:
        raw = rand_raw(rng, T.Q8_0, rows, cols)
        W = weights.DenseWeight.upload(raw, T.Q8_0, cols)
        us, _ = eager_us(cp, lambda s: W.dequantized(cache=False, stream=s))
        out.append(rec(f"dequant->f16 {name}", us, W.nbytes + 2 * rows * cols, bw))
        for Tn in (512, 2048):
            X = cp.asarray(rng.standard_normal((Tn, cols), dtype=F32))
            Y = cp.empty((Tn, rows), cp.float32)
            flop = 2.0 * Tn * rows * cols
            for cache in (True, False):
                W.drop_cache()
                if cache:
                    W.dequantized()
                us, _ = eager_us(cp, lambda s: gemm.dense_batched(W, X, Y, cache=cache, stream=s), iters=10)
                nbytes = W.nbytes + 4 * Tn * (rows + cols)
                out.append(rec(f"batched {name} T={Tn} f16{'' if cache else ' +dequant'}",
                               us, nbytes, bw, TFLOPs=flop / (us * 1e-6) / 1e12))
            W.drop_cache()
        del W
        cp.get_default_memory_pool().free_all_blocks()


def bench_small(cp, rng, bw, out):
    c = A3B
    d, nh, nkv, hd = c["d"], c["n_head"], c["n_kv"], c["hd"]
    x = cp.asarray(rng.standard_normal((1, d), dtype=F32))
    w = cp.asarray(rng.uniform(0.5, 1.5, d).astype(F32))
    y = cp.empty_like(x)
    us, _ = graph_us(cp, [lambda s: norm.rms_norm(x, w, 1e-6, y, stream=s)] * 8)
    out.append(rec("rms_norm d_model 2048", us, 3 * 4 * d, bw))
    xh = cp.asarray(rng.standard_normal((nh, hd), dtype=F32))
    wh = cp.asarray(rng.uniform(0.5, 1.5, hd).astype(F32))
    yh = cp.empty_like(xh)
    us, _ = graph_us(cp, [lambda s: norm.rms_norm(xh, wh, 1e-6, yh, stream=s)] * 8)
    out.append(rec("rms_norm per-head 32x128", us, 2 * 4 * nh * hd, bw))
    rope = rope_kv.RopeTable(c["max_ctx"], hd, 1e6)
    K, V = rope_kv.alloc_kv_cache(nkv, c["max_ctx"], hd)
    qkv = cp.asarray(rng.standard_normal((1, (nh + 2 * nkv) * hd), dtype=F32))
    q_out = cp.empty((1, nh, hd), cp.float32)
    pos = cp.asarray(np.array([77777], np.int32))
    us, _ = graph_us(cp, [lambda s: rope_kv.qk_norm_rope_kv(qkv, wh, wh, 1e-6, rope, pos, q_out, K, V, n_head=nh,
                                                      n_kv=nkv, stream=s)] * 8)
    out.append(rec("qk_norm_rope_kv T=1", us, 4 * qkv.size + 4 * q_out.size + 2 * 2 * nkv * hd, bw))
    lg = cp.asarray(rng.standard_normal((1, c["n_exp"]), dtype=F32))
    ids, wts = cp.empty((1, c["k"]), cp.int32), cp.empty((1, c["k"]), cp.float32)
    us, _ = graph_us(cp, [lambda s: router.route(lg, c["k"], ids, wts, stream=s)] * 8)
    out.append(rec("route 128 -> top 8", us, 4 * 128, bw))
    V_ = c["vocab"]
    logits = cp.asarray(rng.standard_normal(V_, dtype=F32) * F32(3))
    tok = cp.zeros(1, cp.int32)
    am = sampling.Argmax(V_)
    us, _ = graph_us(cp, [lambda s: am(logits, tok, stream=s)] * 8)
    out.append(rec("argmax 151936", us, 4 * V_, bw))
    smp = sampling.DeviceSampler(V_)
    st1 = device.module("sampling.cu").fn("topk_stage1")
    us, _ = graph_us(cp, [lambda s: st1((smp.nb,), (1024,), (logits, np.int32(V_), smp.cand))] * 4)
    out.append(rec("sample stage 1 (38 block sorts of 4096)", us, 4 * V_, bw))
    for tk, tp in [(40, 0.9), (0, 1.0)]:
        params = cp.asarray(sampling.sampling_params(0.7, tk, tp, 0.37))
        us, _ = graph_us(cp, [lambda s: smp(logits, params, tok, stream=s)] * 4)
        out.append(rec(f"sample 151936 top_k={tk} top_p={tp}", us, 4 * V_, bw))
    cdf = sampling.CdfSampler(V_)
    params = cp.asarray(sampling.sampling_params(0.7, 0, 1.0, 0.37))
    us, _ = graph_us(cp, [lambda s: cdf(logits, params, tok, stream=s)] * 4)
    out.append(rec("sample 151936 whole vocabulary (cdf)", us, 4 * V_, bw))
    raw = rand_raw(rng, T.Q8_0, 4096, d)
    tab = weights.DenseWeight.upload(raw, T.Q8_0, d)
    toks = cp.asarray(np.array([1234], np.int32))
    e = cp.empty((1, d), cp.float32)
    us, _ = graph_us(cp, [lambda s: embedding.embed(tab, toks, e, stream=s)] * 8)
    out.append(rec("embed Q8_0 row 2048", us, tab.row_bytes + 4 * d, bw))


def bench_attention(cp, rng, bw, out, n_layers=48):
    c = A3B
    nh, nkv, hd, mc = c["n_head"], c["n_kv"], c["hd"], c["max_ctx"]
    caches = []
    for _ in range(n_layers):
        K = cp.random.standard_normal((nkv, mc, hd), dtype=cp.float32).astype(cp.float16)
        V = cp.random.standard_normal(rope_kv.v_cache_shape(nkv, hd, mc), dtype=cp.float32).astype(cp.float16)
        caches.append((K, V))
    q = cp.asarray(rng.standard_normal((1, nh, hd), dtype=F32))
    qkv = cp.asarray(rng.standard_normal((1, (nh + 2 * nkv) * hd), dtype=F32))
    hw = cp.asarray(rng.uniform(0.5, 1.5, hd).astype(F32))
    rope = rope_kv.RopeTable(mc, hd, 1e6)
    o = cp.empty((1, nh * hd), cp.float32)
    main = ("pipe", "plain")  # the register prefetch and the plain loop, each with the fused step
    variants = [("pipe", True, 64, None), ("plain", False, 64, None), ("plain cmin256", False, 256, None),
                ("plain cols32", False, 64, 32), ("plain cols4", False, 64, 4)]
    for vname, pipe, chunk_min, cols in variants:
        att = attention.DecodeAttention(nh, nkv, hd, mc, chunk_min=chunk_min, pipelined=pipe, combine_cols=cols)
        for ctx in (1024, 8192, 32768, 65536, 131072):
            if vname not in main and ctx == 65536:
                continue
            pos = cp.asarray(np.array([ctx - 1], np.int32))
            us, _ = graph_us(cp, [lambda s, K=K, V=V: att(q, K, V, pos, o, stream=s) for K, V in caches], iters=5)
            kv_bytes = ctx * nkv * hd * 2 * 2
            out.append(rec(f"attention ctx={ctx} {vname}", us, kv_bytes, bw,
                           nsplit=att.nsplit(1), capacity=att.capacity))
            if vname in main:  # the decode step's launch with qk_norm_rope_kv's work (K / V loads the step sees)
                us, _ = graph_us(cp, [lambda s, K=K, V=V: att.step(qkv, hw, hw, 1e-6, rope, pos, K, V, o, stream=s)
                                      for K, V in caches], iters=5)
                out.append(rec(f"attention ctx={ctx} {vname} step (+q/k norm, RoPE, KV append)", us, kv_bytes, bw))
    del caches
    cp.get_default_memory_pool().free_all_blocks()


def bench_prefill(cp, rng, bw, out, T=1024):
    """One layer's prompt attention for a chunk of T tokens after pos0 cached ones; TFLOP/s counts the causal QK^T
    and PV multiply-adds. Floor: the chunk's K / V read once (the kernel re-reads them per 128-row block, from L2)."""
    c = A3B
    nh, nkv, hd = c["n_head"], c["n_kv"], c["hd"]
    for pos0 in (0, 8192, 32768 - T):
        mc = pos0 + T
        K = cp.random.standard_normal((nkv, mc, hd), dtype=cp.float32).astype(cp.float16)
        V = cp.random.standard_normal(rope_kv.v_cache_shape(nkv, hd, mc), dtype=cp.float32).astype(cp.float16)
        q = cp.asarray(rng.standard_normal((T, nh, hd), dtype=F32))
        o = cp.empty((T, nh * hd), cp.float32)
        flops = 4.0 * nh * hd * sum(pos0 + t + 1 for t in range(T))
        att = attention.PrefillAttention(nh, nkv, hd, mc)
        us, _ = eager_us(cp, lambda st: att(q, K, V, pos0, o, stream=st))
        out.append(rec(f"prefill attention T={T} after {pos0}", us, mc * nkv * hd * 4, bw,
                       TFLOPs=flops / (us * 1e-6) / 1e12))
        del K, V
    cp.get_default_memory_pool().free_all_blocks()


def bench_decode_chain(cp, rng, bw, out, ctx=1024):
    """One token's dense path over 48 layers (no experts): embed, per layer norm + fused qkv + q/k norm/rope/KV +
    attention + o-proj (+res) + norm + router + route, then final norm + LM head + argmax."""
    c = A3B
    d, nh, nkv, hd, L = c["d"], c["n_head"], c["n_kv"], c["hd"], c["n_layer"]
    mc = 4096
    qkv_rows = (nh + 2 * nkv) * hd
    Wqkv0 = weights.DenseWeight.upload(rand_raw(rng, T.Q8_0, qkv_rows, d), T.Q8_0, d)
    Wo0 = weights.DenseWeight.upload(rand_raw(rng, T.Q8_0, d, nh * hd), T.Q8_0, nh * hd)
    Wr0 = weights.DenseWeight.upload(rand_raw(rng, T.F32, c["n_exp"], d), T.F32, d)
    layers = []
    for _ in range(L):
        K, V = rope_kv.alloc_kv_cache(nkv, mc, hd)
        K[...] = cp.random.standard_normal(K.shape, dtype=cp.float32).astype(cp.float16)
        V[...] = cp.random.standard_normal(V.shape, dtype=cp.float32).astype(cp.float16)
        layers.append((weights.DenseWeight(Wqkv0.data.copy(), T.Q8_0, d), weights.DenseWeight(Wo0.data.copy(), T.Q8_0, nh * hd),
                       weights.DenseWeight(Wr0.data.copy(), T.F32, d), K, V))
    head = weights.DenseWeight.upload(rand_raw(rng, T.Q8_0, c["vocab"], d), T.Q8_0, d)
    nw = cp.asarray(rng.uniform(0.5, 1.5, d).astype(F32))
    hw = cp.asarray(rng.uniform(0.5, 1.5, hd).astype(F32))
    rope = rope_kv.RopeTable(mc, hd, 1e6)
    att = attention.DecodeAttention(nh, nkv, hd, mc)
    am = sampling.Argmax(c["vocab"])
    b = {n: cp.empty(s, cp.float32) for n, s in [("x", (1, d)), ("h", (1, d)), ("qkv", (1, qkv_rows)),
                                                 ("q", (1, nh, hd)), ("a", (1, nh * hd)), ("lg", (1, c["n_exp"])),
                                                 ("logits", (c["vocab"],))]}
    b["x"][...] = cp.asarray(rng.standard_normal((1, d), dtype=F32))
    ids, wts = cp.empty((1, c["k"]), cp.int32), cp.empty((1, c["k"]), cp.float32)
    tok, pos = cp.asarray(np.array([5], np.int32)), cp.asarray(np.array([ctx - 1], np.int32))

    def norm_proj(W, y, s, fused):  # y = W rms_norm(x): as the GPU card runs it (fused) or in two launches
        if fused:
            matvec.norm_matvec(W, b["x"][0], nw, 1e-6, y, stream=s)
        else:
            norm.rms_norm(b["x"], nw, 1e-6, b["h"], stream=s)
            matvec.matvec(W, b["h"][0], y, stream=s)

    def step(s, fused):
        embedding.embed(head, tok, b["x"], stream=s)
        for Wqkv, Wo, Wr, K, V in layers:
            norm_proj(Wqkv, b["qkv"][0], s, fused)
            if fused:
                att.step(b["qkv"], hw, hw, 1e-6, rope, pos, K, V, b["a"], stream=s)
            else:
                rope_kv.qk_norm_rope_kv(b["qkv"], hw, hw, 1e-6, rope, pos, b["q"], K, V, n_head=nh, n_kv=nkv, stream=s)
                att(b["q"], K, V, pos, b["a"], stream=s)
            matvec.matvec(Wo, b["a"][0], b["x"][0], residual=b["x"][0], stream=s)
            norm_proj(Wr, b["lg"][0], s, fused)
            router.route(b["lg"], c["k"], ids, wts, stream=s)
        norm.rms_norm(b["x"], nw, 1e-6, b["h"], stream=s)
        matvec.matvec(head, b["h"][0], b["logits"], stream=s)
        am(b["logits"], tok, stream=s)

    nbytes = L * (Wqkv0.nbytes + Wo0.nbytes + Wr0.nbytes + ctx * nkv * hd * 4) + head.nbytes
    for fused in (True, False):
        us, runs = graph_us(cp, [lambda s, fused=fused: step(s, fused)], iters=5)
        out.append(rec(f"decode dense path, 48 layers, ctx={ctx} (no experts){'' if fused else ', unfused'}", us,
                       nbytes, bw, launches=1 + L * (6 if fused else 9) + 3))
    del layers
    cp.get_default_memory_pool().free_all_blocks()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sections", default="matvec,small,attention,chain,batched,prefill")
    ap.add_argument("--warm", action="store_true", help="no weight copies: launches read the weights from L2")
    ap.add_argument("--match", default="", help="matvec: only the cases whose name holds this text")
    args = ap.parse_args()

    import cupy as cp

    from stratad.bench.hardware import gpu_copy_bandwidth, gpu_info

    info = gpu_info(cp)
    t0 = time.time()
    kernels = {"matvec.cu": ["matvec_q8_0_r4_k1", "matvec_q8_0_r1_k1", "matvec_f16_r1_k1"],
               "attention_decode.cu": ["attn_split_hd128_g8", "attn_split_hd128_g8_pipe", "attn_combine"],
               "attention_prefill.cu": ["attn_flash_prefill_128"], "norm.cu": ["rms_norm_rows"],
               "rope_kv.cu": ["qk_norm_rope_kv"], "sampling.cu": ["topk_sample"]}
    mods = {source: device.module(source) for source in kernels}
    info["compile_s"] = time.time() - t0
    info["build"] = {source: m.build for source, m in mods.items()}
    regs = {}
    for source, name in ((s_, n) for s_, ns in kernels.items() for n in ns):
        try:
            f = mods[source].fn(name)
            regs[name] = {"regs": int(f.num_regs), "smem": int(f.shared_size_bytes),
                          "local": int(f.local_size_bytes)}
        except Exception as e:  # noqa: BLE001
            regs[name] = repr(e)
    info["kernels"] = regs
    bw, bw_all = gpu_copy_bandwidth(cp)
    info["copy_GBps"], info["copy_runs"] = bw, bw_all
    rng = np.random.default_rng(0)
    results, errors = [], {}
    sections = {"matvec": functools.partial(bench_matvec, warm=args.warm, match=args.match), "small": bench_small,
                "attention": bench_attention, "chain": bench_decode_chain, "batched": bench_batched,
                "prefill": bench_prefill}
    for sec in args.sections.split(","):
        t = time.time()
        try:
            sections[sec](cp, rng, bw, results)
        except Exception:  # noqa: BLE001 - keep the other sections' numbers
            errors[sec] = traceback.format_exc()
            print(f"section {sec} failed:\n{errors[sec]}", file=sys.stderr)
        info[f"{sec}_s"] = time.time() - t
    doc = {"info": info, "results": results, "errors": errors}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(f"\ncopy bandwidth {bw:.0f} GB/s; compile {info['compile_s']:.1f} s; {json.dumps(regs)}")
    print(f"{'kernel':58s} {'us':>9s} {'floor':>8s} {'GB/s':>7s} {'%copy':>6s}  extra")
    for r in results:
        extra = {k: v for k, v in r.items() if k in ("plan", "best", "TFLOPs", "nsplit")}
        if "plans" in r:
            extra["plans"] = {k: round(v, 2) for k, v in r["plans"].items()}
        if "TFLOPs" in extra:
            extra["TFLOPs"] = round(extra["TFLOPs"], 1)
        print(f"{r['name']:58s} {r['us']:9.2f} {r['floor_us']:8.2f} {r['GBps']:7.0f} {100 * r['frac_copy']:5.1f}%  "
              f"{extra if extra else ''}")
    if errors:
        print("errors in:", list(errors))


if __name__ == "__main__":
    main()
