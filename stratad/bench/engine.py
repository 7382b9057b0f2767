"""One lane's engine on one GPU card: prompt reading and decode speed at several expert-cache fractions.

The floor of a decode token is the bytes it must move (the routed experts' weights + every dense matrix + the
context's KV) over the card's measured copy bandwidth; experts computed on the CPU pool move over host memory
instead, so the floor here counts card-resident expert bytes only and the CPU share is reported beside it. With
host_experts = "card" the experts no card holds cross the bus: their bytes over the measured page-locked upload
rate are added to the floor; host_cpu_share (a list: one card each) leaves part of them to the CPU pool, whose
experts the floor leaves out as above.
"""
from __future__ import annotations

import gc
import itertools
import os
import time

import numpy as np
import psutil

from stratad.bench.hardware import gpu_copy_bandwidth, gpu_gemm_tflops, gpu_upload_bandwidth, host_read_bandwidth
from stratad.config import GPU_PROMPT_CHUNK, GpuOptions
from stratad.engine.generation import CHUNK_READ, Generation
from stratad.engine.prefix_cache import PrefixCache
from stratad.engine.sampling import SamplingParams
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import slot_bytes


NEXT_TURN = 256  # new tokens in the measured next turn of the conversation


def prompt_flops_per_token(model: ModelFile, context: int) -> float:
    """FLOPs a prompt token costs on average over a prompt of `context` tokens: the dense projections (not the
    embedding or the LM head, which a prompt runs once), its k experts (gate, up, down) and causal attention
    (QK^T and PV over its position's prefix, (context + 1) / 2 keys on average)."""
    c = model.config
    dense = sum(int(np.prod(ti.shape)) for name, ti in model.tensors.items()
                if len(ti.shape) == 2 and "_exps" not in name and name not in ("token_embd.weight", "output.weight"))
    experts = c.n_layer * c.n_expert_used * 3 * c.d_model * c.d_ff_expert
    attention = c.n_layer * 2 * c.n_head * c.head_dim * (context + 1) / 2
    return 2.0 * (dense + experts + attention)


def _bytes_per_token(model: ModelFile, context: int, resident_share: float) -> int:
    c = model.config
    expert = slot_bytes(model)
    dense = sum(ti.nbytes for name, ti in model.tensors.items() if "_exps" not in name and name != "token_embd.weight")
    kv = c.n_layer * context * c.kv_dim * 2 * 2  # fp16 K and V
    return int(c.n_layer * c.n_expert_used * expert * resident_share + dense + kv)


def run(model_path: str, fractions=(1.0, 0.5, 0.25), contexts=(1024,), tokens: int = 128,
        host_experts: str = "card", prompt_chunk: int = GPU_PROMPT_CHUNK, cpu_shares=(0.0,),
        fetch_aheads=(GpuOptions().fetch_ahead,)) -> dict:
    import cupy as cp

    from lane.cupy_card import CupyCard

    model = ModelFile(model_path)
    c = model.config
    bw = gpu_copy_bandwidth(cp)[0] * 1e9
    bus = gpu_upload_bandwidth(cp)[0] * 1e9
    tflops = gpu_gemm_tflops(cp)[0]
    host_read = host_read_bandwidth(os.cpu_count() or 1)
    expert_bytes = slot_bytes(model)
    total = c.n_layer * c.n_expert
    results = []
    profile = None
    for frac, cpu_share, ahead in itertools.product(fractions, cpu_shares, fetch_aheads):
        n_slots = int(frac * total)
        # host_cpu_share splits the misses by the card's routing counts: the profile's, once there is one
        card = CupyCard(model, 0, n_slots, max(contexts) + tokens + NEXT_TURN + 64, host_experts=host_experts,
                        prompt_chunk=prompt_chunk, host_cpu_share=cpu_share, options=GpuOptions(fetch_ahead=ahead),
                        counts=None if profile is None else profile.copy())
        if profile is None:  # the model's routing profile: counts of a 512-token pass with every expert on the CPU
            card.forward(list(np.random.default_rng(0).integers(0, 2000, 512)), card.new_kv(), logits="none")
            profile = card.counts.copy()
        order = np.lexsort((np.arange(total), -profile.reshape(-1)))
        card.pool.fill([(int(i // c.n_expert), int(i % c.n_expert)) for i in order[:n_slots]])
        for ctx in contexts:
            rng = np.random.default_rng(ctx)
            prompt = list(rng.integers(0, 2000, size=ctx))
            card.forward(prompt[:300], card.new_kv(), logits="last")  # compile, capture, warm
            card.forward(prompt[300:301], card.new_kv(), logits="last")
            cp.cuda.runtime.deviceSynchronize()
            cache = PrefixCache()  # kept for the next turn below
            g = Generation(card, model.tokenizer, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True),
                           ctx + tokens + NEXT_TURN + 64, cache=cache)
            steps = iter(g)
            while next(steps) == CHUNK_READ:  # the prompt, its chunks up to the first token: decode from here on
                pass
            before = card.counters.copy()
            stamps = [time.monotonic() for t, _ in steps if t is not None]  # Generation's clock, a token each
            n = 1 + len(stamps)
            d = card.counters.minus(before)
            on_card, on_cpu, read = d.card, d.cpu - d.host_read, d.host_read  # read: by the card from the arena
            used = max(1, on_card + on_cpu + read)
            share = on_card / used
            floor_s = _bytes_per_token(model, ctx, share) / bw + read / max(1, n - 1) * expert_bytes / bus
            # decode speed over replayed steps: from the end of the first decode step, which captures the step's
            # graph for this context range and sampling kind (~20-70 ms on the H200, a few % of 128 tokens), to the
            # last; the rate with that step included is reported beside it
            tps = (n - 2) / (stamps[-1] - stamps[0]) if n > 2 else g.decode_tok_s
            # the conversation's next turn (prefix_cache): the prompt, the reply and NEXT_TURN new tokens, of which
            # only what is new is read; against reading all of it at this run's prompt rate
            turn = prompt + [int(t) for t in cache.tokens[ctx:]] + list(rng.integers(0, 2000, size=NEXT_TURN))
            g2 = Generation(card, model.tokenizer, turn, SamplingParams(max_tokens=1), ctx + tokens + NEXT_TURN + 64,
                            cache=cache)
            for _ in g2:
                pass
            free, total_mem = cp.cuda.runtime.memGetInfo()
            # the CPU pool's decode traffic: its experts' bytes per token x tokens per second, against what the
            # host's cores can read at all (the CPU share's own ceiling)
            cpu_gb_s = on_cpu / max(1, n - 1) * expert_bytes * tps / 1e9
            bus_gb_s = read / max(1, n - 1) * expert_bytes * tps / 1e9
            prefill_floor = tflops * 1e12 / prompt_flops_per_token(model, ctx)  # tok/s
            results.append({
                "cache_fraction": frac, "context": ctx, "generated": n,
                "prefill_tok_s": round(ctx / g.ttft_s, 1), "ttft_s": round(g.ttft_s, 4),
                "prefill_floor_tok_s": round(prefill_floor, 1),
                "prefill_fraction_of_floor": round(ctx / g.ttft_s / prefill_floor, 4),
                "decode_tok_s": round(tps, 1), "decode_tok_s_with_first_step": round(g.decode_tok_s, 1),
                "first_decode_step_ms": round((stamps[0] - g.t_first) * 1e3, 2) if stamps else None,
                "hit_rate": round(share, 4), "cpu_share": round(on_cpu / used, 4),
                "layers_packed_gib": round(card.net.packed_bytes / 2**30, 3),
                "host_read_share": round(read / used, 4),
                "floor_ms_per_token": round(floor_s * 1e3, 4),
                "floor_tok_s": round(1 / floor_s, 1), "fraction_of_floor": round(tps * floor_s, 4),
                "cpu_expert_gb_s": round(cpu_gb_s, 2), "cpu_fraction_of_host_read": round(cpu_gb_s / host_read, 3),
                "host_experts": host_experts, "host_cpu_share": cpu_share, "fetch_ahead": ahead,
                "prompt_chunk": card.prompt_chunk,
                "bus_expert_gb_s": round(bus_gb_s, 2),
                "bus_expert_mb_per_token": round(read / max(1, n - 1) * expert_bytes / 1e6, 1),
                "next_turn_tokens": len(turn), "next_turn_cached_tokens": g2.cached,
                "next_turn_ttft_s": round(g2.ttft_s, 4),
                "next_turn_ttft_fresh_s": round(len(turn) * g.ttft_s / ctx, 4),  # at this run's prompt rate
                "vram_used_gib": round((total_mem - free) / 2**30, 2),
                "host_rss_gib": round(psutil.Process().memory_info().rss / 2**30, 2),
            })
            print(results[-1], flush=True)
            del g, g2, steps, cache  # they hold the card's buffers: a later card's vram_used_gib would count them
        card.close()
        del card
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
    return {"scenario": "engine", "model": str(model_path), "copy_bandwidth_tb_s": round(bw / 1e12, 3),
            "fp16_gemm_tflops": round(tflops, 1),
            "upload_bandwidth_gb_s": round(bus / 1e9, 1),
            "host_read_gb_s": round(host_read, 1),
            "floor": "decode: bytes per token (card-resident routed experts + dense + KV) / copy bandwidth "
                     "+ experts read from host memory by the card / upload bandwidth; prefill: FLOPs per prompt "
                     "token (dense, k experts, causal attention) / the measured fp16 GEMM rate",
            "results": results}
