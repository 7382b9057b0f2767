"""The seed's table: one chat on lead + peer, two chats on independent lanes, two chats with mutual help.

Two chats of different topics (a model made with topics=2: even / odd token ids route to different hot experts),
each card's cache a fraction of all experts (default 0.475: two cards together 95 %). For each mode and chat:
decode tok/s, time to first token, and the share of decode-step expert work on the own card, on peer cards and on
the CPU. Every mode first runs a short round of the same traffic, so that placement has followed it (it adapts
from live counts), then measures.
"""
from __future__ import annotations

import tempfile
import threading
import time

import numpy as np

from stratad.config import GPU_PROMPT_CHUNK
from stratad.local_daemon import LocalDaemon

SETTLE_PROMPT = 2048
NEXT_TURN = 256  # new tokens in each conversation's next turn (the rest comes from the lane's kept sequence)


def _prompt(topic: int, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in 2 * rng.integers(1, 500, size=n) + topic]  # even ids: topic A, odd: topic B


def _chats(d: LocalDaemon, prompts: list[list[int]], topics: list[int], tokens: int) -> tuple[list[dict], list]:
    """The chats at once; (each chat's figures, each chat's reply tokens)."""
    out: list[dict] = [{} for _ in topics]
    replies: list[list[int]] = [[] for _ in topics]

    def go(i, topic):
        with d.client(stream_timeout_s=1800) as c:
            t0 = time.monotonic()
            s = c.generate(tokens=prompts[i], max_tokens=tokens, temperature=0.7, seed=i, ignore_eos=True)
            s.result()
            st = s.stats
            replies[i] = list(s.tokens)
            dec = st.decode_experts_card + st.decode_experts_peer + st.decode_experts_cpu or 1
            out[i] = {"topic": "AB"[topic], "lane": st.lane, "generated": st.generated_tokens,
                      "prompt_tokens": st.prompt_tokens, "cached_tokens": st.prompt_cached_tokens,
                      "decode_tok_s": round(st.decode_tok_s, 2), "ttft_s": round(st.ttft_s, 3),
                      "wall_s": round(time.monotonic() - t0, 2),
                      "share_own_card": round(st.decode_experts_card / dec, 4),
                      "share_peer": round(st.decode_experts_peer / dec, 4),
                      "share_cpu": round(st.decode_experts_cpu / dec, 4),
                      "share_some_card": round(1 - st.decode_experts_cpu / dec, 4),
                      # of share_cpu: read by the card from host memory (host_experts = card; prompts stage instead)
                      "share_host_read": round(st.experts_host_read / dec, 4)}

    ts = [threading.Thread(target=go, args=(i, t)) for i, t in enumerate(topics)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out, replies


def _mode(model: str, cards: str, cache: float, mutual: bool, topics: list[int], prompt_tokens: int, tokens: int,
          settle_s: float, host_experts: str, prompt_chunk: int, peer_copy: str) -> list[dict]:
    conf = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    conf.write(f"mutual_help = {str(mutual).lower()}\nrejoin_idle_s = 3600.0\nreplan_interval_s = 0.5\n"
               f"context_length = {prompt_tokens + 2 * tokens + NEXT_TURN + 64}\nhost_experts = \"{host_experts}\"\n"
               f"prefix_cache = true\nprompt_chunk = {prompt_chunk}\n[gpu]\npeer_copy = \"{peer_copy}\"\n")
    conf.close()
    d = LocalDaemon(model, cards, args=["--expert-cache", str(cache), "--log-level", "warning"],
                    config=conf.name).start()
    try:
        # the traffic once, with shorter prompts of the same topics (other text: nothing to reuse): placement follows
        _chats(d, [_prompt(t, min(prompt_tokens, SETTLE_PROMPT), 200 + i) for i, t in enumerate(topics)], topics,
               tokens)
        time.sleep(settle_s)
        prompts = [_prompt(t, prompt_tokens, 100 + i) for i, t in enumerate(topics)]
        first, replies = _chats(d, prompts, topics, tokens)
        # each conversation's next turn, as an agent sends it: everything so far and NEXT_TURN new tokens
        nxt, _ = _chats(d, [p + r + _prompt(t, NEXT_TURN, 300 + i)
                            for i, (p, r, t) in enumerate(zip(prompts, replies, topics))], topics, tokens)
        for f, n in zip(first, nxt):
            f["next_turn"] = {k: n[k] for k in ("lane", "prompt_tokens", "cached_tokens", "ttft_s", "decode_tok_s")}
        return first
    finally:
        d.stop()


MODES = {  # name: (mutual_help, the chats' topics)
    "1_one_chat_lead_peer": (False, [0]),
    "2_two_chats_independent": (False, [0, 1]),
    "3_two_chats_mutual_help": (True, [0, 1]),
}


def run(model_path: str, cards: str = "cpu,cpu", cache: float = 0.475, prompt_tokens: int = 1024,
        tokens: int = 128, settle_s: float = 3.0, modes: str = "1,2,3", host_experts: str = "card",
        prompt_chunk: int = GPU_PROMPT_CHUNK, peer_copy: str = "auto") -> dict:
    """modes: which of the three to run ("1,3" and "2" in two runs fit long prompts into shorter jobs);
    prompt_chunk: the GPU lanes' (config prompt_chunk); peer_copy: a peer on another GPU, P2P or through host
    memory (config [gpu] peer_copy)."""
    card_list = cards.split(",")
    n_cards = len(card_list)
    gpus = [c for c in card_list if c != "cpu"]
    shared = len(gpus) != len(set(gpus))
    wanted = {int(m) for m in modes.split(",")}
    results = {name: _mode(model_path, cards, cache, mutual, topics, prompt_tokens, tokens, settle_s, host_experts,
                         prompt_chunk, peer_copy)
               for i, (name, (mutual, topics)) in enumerate(MODES.items(), start=1) if i in wanted}
    share = {name: [c["share_some_card"] for c in chats] for name, chats in results.items()}
    targets = {"mode3_share_some_card_min": 0.95} | {f"{name}_share_some_card": v for name, v in share.items()}
    if {1, 3} <= wanted:
        mode1 = results["1_one_chat_lead_peer"][0]["decode_tok_s"]
        targets["mode3_speed_vs_mode1"] = [round(c["decode_tok_s"] / mode1, 3)
                                           for c in results["3_two_chats_mutual_help"]]
    return {
        "scenario": "seed", "model": str(model_path), "cards": cards,
        "host_experts": host_experts if gpus else "cpu",  # CPU cards compute every miss on their own pool
        "prompt_chunk": prompt_chunk if gpus else None,
        "peer_copy": peer_copy,
        "cache_fraction_per_card": cache, "cache_fraction_all_cards": round(min(1.0, cache * n_cards), 3),
        "prompt_tokens": prompt_tokens, "generated_tokens": tokens, "modes": results,
        "decode_tok_s_together": {m: round(sum(c["decode_tok_s"] for c in chats), 2) for m, chats in results.items()},
        "targets": targets,
        "floor": "shares: the pooled coverage of the cards; speeds on CPU cards are not a GPU result",
        "note": ("logical cards sharing one GPU: the shares are meaningful, the speeds are not a two-card result"
                 if shared else "one card per device"),
    }
