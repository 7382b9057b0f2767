"""The daemon's cost: the same model and card, decoded in-process and through coordinator + lane + ZeroMQ.

Three figures: the end-to-end rate a client sees against the in-process engine (on a small machine this one also
carries the noise of three processes sharing the cores); the transport (the client's rate against the lane's own
loop); and the share of the lane's decode time spent on the daemon's messaging, measured inside the lane.

Both sides run the numpy card with every expert cached (no placement effects, one card, so no peers) and the
same number of compute threads (the in-process side runs in a child process with the lane's thread settings).
The client measures what a user sees: time to first chunk and chunks per second after it.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from lane.numpy_card import NumpyCard
from lane.slot_pool import SlotPool
from stratad.client import Client
from stratad.engine.generation import Generation
from stratad.engine.sampling import SamplingParams
from stratad.local_daemon import LocalDaemon
from stratad.threads import env_with
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import slot_bytes

PROMPT = "Tell me how two chats share the experts on the cards, in detail."


def _config(threads: int) -> str:
    path = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    path.write(f"cpu_threads = {threads}\n")
    path.close()
    return path.name


def _card(model: ModelFile) -> NumpyCard:
    """The lane's card as the daemon builds it with expert_cache 1.0: every expert in a slot."""
    c = model.config
    total = c.n_layer * c.n_expert
    pool = SlotPool(model, np.zeros(total * slot_bytes(model), np.uint8), total)
    pool.fill([(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)])
    return NumpyCard(model, pool)


def _in_process(card: NumpyCard, prompt: list[int], n: int) -> tuple[float, float]:
    g = Generation(card, card.model.tokenizer, prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                   card.model.config.context_length)
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


def _through_daemon(client: Client, n: int) -> tuple[float, float, float, float]:
    """(time to first chunk, chunks/s at the client, tokens/s the lane measured inside its own loop, share of the
    lane's decode time spent on the daemon's messaging)."""
    t0 = time.monotonic()
    s = client.generate(prompt=PROMPT, max_tokens=n, ignore_eos=True)
    first = last = None
    k = 0
    for ch in s:
        if ch.tokens:
            k += 1
            last = time.monotonic()
            first = first or last
    st = s.stats
    decode_s = (st.generated_tokens - 1) / st.decode_tok_s
    return first - t0, (k - 1) / (last - first), st.decode_tok_s, st.lane_io_s / decode_s


def _in_process_child(model_path: str, tokens: int, threads: int) -> tuple[float, float]:
    code = ("import json, sys; from stratad.bench.overhead import in_process_main; "
            "print(json.dumps(in_process_main(sys.argv[1], int(sys.argv[2]))))")
    out = subprocess.run([sys.executable, "-c", code, model_path, str(tokens)], check=True, capture_output=True,
                         text=True, env=env_with(threads)).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def in_process_main(model_path: str, tokens: int) -> tuple[float, float]:
    """The in-process side, run in a child: warm up like the lane does, then one measured generation."""
    model = ModelFile(model_path)
    prompt = model.tokenizer.encode(PROMPT)
    card = _card(model)
    _in_process(card, prompt, 8)
    return _in_process(card, prompt, tokens)


def run(model_path: str, tokens: int = 128, repeats: int = 5, threads: int = 1) -> dict:
    daemon = LocalDaemon(model_path, "cpu", args=["--expert-cache", "1.0", "--log-level", "warning"],
                         config=_config(threads)).start()
    try:
        with daemon.client() as c:
            _through_daemon(c, 8)  # warm-up: decoded-expert caches, first-call costs
            ip, dm = [], []
            for _ in range(repeats):  # alternate, so drift hits both sides alike
                ip.append(_in_process_child(model_path, tokens, threads))
                dm.append(_through_daemon(c, tokens))
    finally:
        daemon.stop()
    ip_ttft, ip_tps = statistics.median(x[0] for x in ip), statistics.median(x[1] for x in ip)
    dm_ttft, dm_tps = statistics.median(x[0] for x in dm), statistics.median(x[1] for x in dm)
    lane_tps = statistics.median(x[2] for x in dm)
    transport = statistics.median(1 - x[1] / x[2] for x in dm)  # per run: the lane's loop vs what the client sees
    lane_io = statistics.median(x[3] for x in dm)
    return {
        "scenario": "overhead",
        "model": str(model_path), "card": "cpu (numpy virtual card), all experts cached", "tokens": tokens,
        "repeats": repeats, "compute_threads": threads,
        "results": [
            {"metric": "decode_tok_s", "in_process": round(ip_tps, 2), "daemon": round(dm_tps, 2),
             "daemon_lane_loop": round(lane_tps, 2),
             "floor": "in-process engine on the same card", "fraction_reached": round(dm_tps / ip_tps, 4),
             "overhead_frac": round(1 - dm_tps / ip_tps, 4),
             "transport_overhead_frac": round(transport, 5),
             "lane_messaging_frac": round(lane_io, 5),
             "spread_in_process": [round(min(x[1] for x in ip), 1), round(max(x[1] for x in ip), 1)],
             "spread_daemon": [round(min(x[1] for x in dm), 1), round(max(x[1] for x in dm), 1)],
             "target_overhead_frac": 0.03},
            {"metric": "ttft_s", "in_process": round(ip_ttft, 4), "daemon": round(dm_ttft, 4),
             "floor": "in-process engine on the same card", "fraction_reached": round(ip_ttft / dm_ttft, 4),
             "overhead_s": round(dm_ttft - ip_ttft, 4)},
        ],
    }
