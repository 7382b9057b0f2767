"""Agents keep their context: three conversations on two lanes, each a long history and follow-up turns that
send the whole conversation again, interleaved (A, B, C, A, B, C, ...) so that no lane can keep all three. The
follow-ups' time to first token with the host conversation cache (kv_cache_host) and without it (prefix_cache
only: a lane keeps its last sequence, so a conversation that lost its lane reads its whole history again).

The floor is a follow-up served from the KV kept on its own lane (one conversation, its turns back to back): the
time to read only the new tokens, which a restored follow-up adds an upload of the history's blocks to.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import numpy as np

from stratad.config import GPU_PROMPT_CHUNK
from stratad.local_daemon import LocalDaemon
from stratad.model.gguf_file import ModelFile

REPLY = 16  # tokens generated a turn


def _history(vocab: int, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(20, max(40, vocab - 512), size=n)]


def _turn(d: LocalDaemon, tokens: list[int]) -> tuple[dict, list[int]]:
    with d.client(stream_timeout_s=3600) as c:
        t0 = time.monotonic()
        s = c.generate(tokens=tokens, max_tokens=REPLY, ignore_eos=True)
        first = None
        for _ in s:
            if first is None:
                first = time.monotonic() - t0
        st = s.stats
        return {"lane": st.lane, "prompt_tokens": st.prompt_tokens, "cached_tokens": st.prompt_cached_tokens,
                "ttft_s": round(first, 4), "lane_ttft_s": round(st.ttft_s, 4)}, list(s.tokens)


def _run(model: str, cards: str, kv_cache_host: str, convs: list[list[int]], turns: int, new_tokens: int,
         vocab: int, prompt_chunk: int, interleave: bool) -> tuple[list[dict], dict | None]:
    ctx = max(len(c) for c in convs) + turns * (new_tokens + REPLY) + REPLY + 64
    conf = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    conf.write(f"prefix_cache = true\nkv_cache_host = \"{kv_cache_host}\"\nrejoin_idle_s = 3600.0\n"
               f"context_length = {ctx}\nprompt_chunk = {prompt_chunk}\n")
    conf.close()
    d = LocalDaemon(model, cards, args=["--log-level", "warning"], config=conf.name).start(timeout_s=1800)
    try:
        convs = [list(c) for c in convs]
        for c in convs:  # each history read once, as the agents' sessions begin
            _, reply = _turn(d, c)
            c += reply
        follow = []
        order = [(t, i) for t in range(turns) for i in range(len(convs))]
        if not interleave:
            order.sort(key=lambda ti: ti[1])  # each conversation's turns back to back: its lane keeps it
        for t, i in order:
            convs[i] += _history(vocab, new_tokens, 1000 * t + i)
            r, reply = _turn(d, convs[i])
            convs[i] += reply
            follow.append(r | {"conversation": "ABC"[i] if i < 3 else str(i), "turn": t + 1})
            print(f"agents: kv_cache_host {kv_cache_host} interleaved {interleave}: {follow[-1]}", file=sys.stderr,
                  flush=True)  # a run cut short still says what it measured
        st = d.status().kv_cache
        return follow, (st.model_dump() if st else None)
    finally:
        d.stop()


def run(model_path: str, cards: str = "cpu,cpu", history: int = 32768, turns: int = 4, new_tokens: int = 512,
        kv_cache_host: str = "0.25", prompt_chunk: int = GPU_PROMPT_CHUNK) -> dict:
    vocab = ModelFile(model_path).tokenizer.vocab_size
    convs = [_history(vocab, history, 7 + i) for i in range(3)]
    with_cache, kv = _run(model_path, cards, kv_cache_host, convs, turns, new_tokens, vocab, prompt_chunk, True)
    without, _ = _run(model_path, cards, "0", convs, turns, new_tokens, vocab, prompt_chunk, True)
    kept, _ = _run(model_path, cards, "0", convs[:1], turns, new_tokens, vocab, prompt_chunk, False)
    med = {name: statistics.median(r["ttft_s"] for r in rows)
           for name, rows in (("with_cache", with_cache), ("without_cache", without), ("kept_on_lane", kept))}
    return {
        "scenario": "agents", "model": str(model_path), "cards": cards, "history_tokens": history,
        "follow_up_turns": turns, "new_tokens_per_turn": new_tokens, "reply_tokens": REPLY,
        "kv_cache_host": kv_cache_host, "prompt_chunk": prompt_chunk,
        "median_follow_up_ttft_s": {k: round(v, 4) for k, v in med.items()},
        "speedup": round(med["without_cache"] / med["with_cache"], 2),
        "targets": {"speedup_min": 10.0, "with_cache_max_s": 1.0},
        "floor": "a follow-up from the KV kept on its own lane (median_follow_up_ttft_s.kept_on_lane): only the "
                 "new tokens read",
        "fraction": round(med["kept_on_lane"] / med["with_cache"], 3),
        "kv_cache": kv,
        "turns": {"with_cache": with_cache, "without_cache": without, "kept_on_lane": kept},
    }
