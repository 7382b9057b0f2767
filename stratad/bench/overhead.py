"""The daemon's cost: the same model and card, decoded in-process, through coordinator + lane + ZeroMQ, and
through the HTTP gateway in front of them.

Four figures: the end-to-end rate a client sees against the in-process engine (on a small machine this one also
carries the noise of three processes sharing the cores); the transport (the client's rate against the lane's own
loop); the share of the lane's decode time spent on the daemon's messaging, measured inside the lane; and the rate
an HTTP client streaming from the gateway (OpenAI's /v1/completions, server-sent events) sees against the ZeroMQ
client's on the same daemon.

Both sides run the numpy card with every expert cached (no placement effects, one card, so no peers) and the
same number of compute threads (the in-process side runs in a child process with the lane's thread settings).
The clients measure what a user sees: time to first chunk and tokens per second after it (the tokens after the
first over the time from the first chunk to the end of the stream; an HTTP event carries text, and a token that
ends inside a UTF-8 character has none of its own, so both sides count the daemon's tokens). HTTP against ZeroMQ
is held on the whole request (tokens over the time from sending it to the stream's end): a gateway that held
chunks back and sent them in a burst would look fast after its first chunk, not over the request.
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
from stratad.gateway.local_client import LocalGateway, free_port
from stratad.local_daemon import LocalDaemon
from stratad.threads import env_with
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import slot_bytes

PROMPT = "Tell me how two chats share the experts on the cards, in detail."


def _config(threads: int) -> str:
    path = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    path.write(f'cpu_threads = {threads}\n')
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


def _through_daemon(client: Client, n: int) -> tuple[float, float, float, float, float]:
    """(time to first chunk, tokens/s at the client after it, tokens/s the lane measured inside its own loop, share
    of the lane's decode time spent on the daemon's messaging, tokens/s over the whole request)."""
    t0 = time.monotonic()
    s = client.generate(prompt=PROMPT, max_tokens=n, ignore_eos=True)
    first = None
    for ch in s:
        if ch.tokens and first is None:
            first = time.monotonic()
    end = time.monotonic()
    st = s.stats
    decode_s = (st.generated_tokens - 1) / st.decode_tok_s
    return (first - t0, (st.generated_tokens - 1) / (end - first), st.decode_tok_s, st.lane_io_s / decode_s,
            st.generated_tokens / (end - t0))


def _through_http(gateway: LocalGateway, n: int) -> tuple[float, float, float]:
    """(time to first chunk, tokens/s after it, tokens/s over the whole request) of a streamed /v1/completions
    request with the same prompt and sampling."""
    body = {"model": "bench", "prompt": PROMPT, "max_tokens": n, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = end = None
    tokens = 0
    for ev in gateway.stream("/v1/completions", body):
        if ev["choices"] and ev["choices"][0]["text"] and first is None:
            first = time.monotonic()
        if ev["choices"] and ev["choices"][0]["finish_reason"]:
            end = time.monotonic()
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
    if tokens != n:
        raise RuntimeError(f"the gateway's stream carried {tokens} tokens, {n} asked for")
    return first - t0, (tokens - 1) / (end - first), tokens / (end - t0)


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
    port = free_port()
    daemon = LocalDaemon(model_path, "cpu", args=["--expert-cache", "1.0", "--log-level", "warning"],
                         config=_config(threads), http=f"127.0.0.1:{port}").start()
    gateway = LocalGateway(port)
    try:
        gateway.wait_healthy()
        with daemon.client() as c:
            _through_daemon(c, 8)  # warm-up: decoded-expert caches, first-call costs
            _through_http(gateway, 8)
            ip, dm, ht = [], [], []
            for _ in range(repeats):  # alternate, so drift hits every side alike
                ip.append(_in_process_child(model_path, tokens, threads))
                dm.append(_through_daemon(c, tokens))
                ht.append(_through_http(gateway, tokens))
    finally:
        daemon.stop()
    ip_ttft, ip_tps = statistics.median(x[0] for x in ip), statistics.median(x[1] for x in ip)
    dm_ttft, dm_tps = statistics.median(x[0] for x in dm), statistics.median(x[1] for x in dm)
    lane_tps = statistics.median(x[2] for x in dm)
    transport = statistics.median(1 - x[1] / x[2] for x in dm)  # per run: the lane's loop vs what the client sees
    lane_io = statistics.median(x[3] for x in dm)
    ht_ttft, ht_tps = statistics.median(x[0] for x in ht), statistics.median(x[1] for x in ht)
    ht_req, dm_req = statistics.median(x[2] for x in ht), statistics.median(x[4] for x in dm)
    http_frac = statistics.median(h[2] / d[4] for h, d in zip(ht, dm))  # per pair of neighbouring runs
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
            {"metric": "http_request_tok_s", "zmq_client": round(dm_req, 2), "http_client": round(ht_req, 2),
             "floor": "the ZeroMQ client's tokens/s over the whole request, same daemon, runs alternating",
             "fraction_reached": round(http_frac, 4), "target_fraction": 0.97,
             "spread_zmq": [round(min(x[4] for x in dm), 1), round(max(x[4] for x in dm), 1)],
             "spread_http": [round(min(x[2] for x in ht), 1), round(max(x[2] for x in ht), 1)],
             "decode_tok_s": {"zmq_client": round(dm_tps, 2), "http_client": round(ht_tps, 2)},
             "ttft_s": {"zmq_client": round(dm_ttft, 4), "http_client": round(ht_ttft, 4)}},
        ],
    }
