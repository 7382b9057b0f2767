"""The daemon's cost: the same model and card, decoded in-process and through coordinator + lane + ZeroMQ.

Both sides run the numpy card with every expert cached (no placement effects, one card, so no peers). The client
measures what a user sees: time to first chunk and chunks per second after it.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from lane.numpy_card import NumpyCard
from lane.slot_pool import SlotPool
from stratad.client import Client
from stratad.engine.generation import Generation
from stratad.engine.sampling import SamplingParams
from stratad.local_daemon import LocalDaemon
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import slot_bytes

PROMPT = "Tell me how two chats share the experts on the cards, in detail."


def _card(model: ModelFile) -> NumpyCard:
    """The lane's card as the daemon builds it with expert_cache 1.0: every expert in a slot."""
    c = model.config
    total = c.n_layer * c.n_expert
    pool = SlotPool(model, np.zeros(total * slot_bytes(model), np.uint8), total)
    pool.fill([(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)])
    return NumpyCard(model, pool)


def _in_process(card: NumpyCard, prompt: list[int], n: int) -> tuple[float, float]:
    g = Generation(card, card.model.tokenizer, prompt, SamplingParams(max_tokens=n), card.model.config.context_length)
    t0 = time.monotonic()
    first = last = None
    k = 0
    for tok, _ in g:
        if tok is None:
            continue
        k += 1
        last = time.monotonic()
        first = first or last
    return first - t0, (k - 1) / (last - first)


def _through_daemon(client: Client, n: int) -> tuple[float, float]:
    t0 = time.monotonic()
    s = client.generate(prompt=PROMPT, max_tokens=n)
    first = last = None
    k = 0
    for ch in s:
        if ch.tokens:
            k += 1
            last = time.monotonic()
            first = first or last
    return first - t0, (k - 1) / (last - first)


def run(model_path: str, tokens: int = 128, repeats: int = 5) -> dict:
    model = ModelFile(model_path)
    prompt = model.tokenizer.encode(PROMPT)
    daemon = LocalDaemon(model_path, "cpu", args=["--expert-cache", "1.0", "--log-level", "warning"]).start()
    try:
        with daemon.client() as c:
            card = _card(model)
            _through_daemon(c, 8)  # warm-up: decoded-expert caches, first-call costs
            _in_process(card, prompt, 8)
            ip, dm = [], []
            for _ in range(repeats):  # alternate, so drift hits both sides alike
                ip.append(_in_process(card, prompt, tokens))
                dm.append(_through_daemon(c, tokens))
    finally:
        daemon.stop()
    ip_ttft, ip_tps = statistics.median(x[0] for x in ip), statistics.median(x[1] for x in ip)
    dm_ttft, dm_tps = statistics.median(x[0] for x in dm), statistics.median(x[1] for x in dm)
    return {
        "scenario": "overhead",
        "model": str(model_path), "card": "cpu (numpy virtual card), all experts cached", "tokens": tokens,
        "repeats": repeats,
        "results": [
            {"metric": "decode_tok_s", "in_process": round(ip_tps, 2), "daemon": round(dm_tps, 2),
             "floor": "in-process engine on the same card", "fraction_reached": round(dm_tps / ip_tps, 4),
             "overhead_frac": round(1 - dm_tps / ip_tps, 4), "target_overhead_frac": 0.03},
            {"metric": "ttft_s", "in_process": round(ip_ttft, 4), "daemon": round(dm_ttft, 4),
             "floor": "in-process engine on the same card", "fraction_reached": round(ip_ttft / dm_ttft, 4),
             "overhead_s": round(dm_ttft - ip_ttft, 4)},
        ],
    }
