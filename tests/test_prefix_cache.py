"""A lane's last sequence reused for the next prompt's common prefix (stratad/engine/prefix_cache.py)."""
from __future__ import annotations

import numpy as np
import pytest

from stratad.engine.generation import Generation
from stratad.engine.prefix_cache import PrefixCache, common_prefix
from stratad.engine.reference import ReferenceEngine
from stratad.engine.sampling import SamplingParams

PROMPT = list(range(5, 69, 2))


def run(engine, prompt, n, cache=None):
    g = Generation(engine, engine.model.tokenizer, prompt, SamplingParams(max_tokens=n), 4096, digest=True,
                   cache=cache)
    logits = []
    forward = engine.forward

    def spy(tokens, kv, logits_mode="last"):
        out = forward(tokens, kv, logits_mode)
        logits.append(out[-1].copy())
        return out

    engine.forward = spy
    try:
        toks = [t for t, _ in g if t is not None]
    finally:
        engine.forward = forward
    return g, toks, np.stack(logits)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return ReferenceEngine(tiny_model)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_next_turn_reads_only_what_is_new(engine):
    cache = PrefixCache()
    g1, t1, _ = run(engine, PROMPT, 12, cache)
    assert g1.cached == 0 and cache.tokens == PROMPT + t1[:-1]  # the last sampled token was never read
    turn2 = PROMPT + t1 + [7, 9, 11]
    g2, t2, l2 = run(engine, turn2, 10, cache)
    assert g2.cached == len(PROMPT) + len(t1) - 1
    fresh, tf, lf = run(engine, turn2, 10)
    assert t2 == tf
    # not bit-identical: the reused entries were computed in other steps (float32 rounding, ~1e-6 normwise per step
    # here), and a step where an activation lands on the other side of an int8 rounding step of the experts' input
    # differs more (one of these ten: 2.1e-3 normwise, 0.02 on a logit of 12)
    err = np.linalg.norm(l2 - lf, axis=1) / np.linalg.norm(lf, axis=1)
    assert np.median(err) <= 1e-5 and err.max() <= 1e-2, err


def test_diverging_prompt_reuses_the_common_part(engine):
    cache = PrefixCache()
    run(engine, PROMPT, 4, cache)
    other = PROMPT[:10] + [3, 3, 3]
    g, _, _ = run(engine, other, 4, cache)
    assert g.cached == 10
    g, _, _ = run(engine, other, 4, cache)  # the same prompt again: all but its last token
    assert g.cached == len(other) - 1


def test_a_failed_step_drops_the_cache(engine):
    cache = PrefixCache()
    run(engine, PROMPT, 4, cache)
    forward, calls = engine.forward, [0]

    def failing(tokens, kv, logits="last"):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("card lost")
        return forward(tokens, kv, logits)

    engine.forward = failing
    try:
        with pytest.raises(RuntimeError, match="card lost"):
            list(Generation(engine, engine.model.tokenizer, PROMPT + [1], SamplingParams(max_tokens=8), 4096,
                            cache=cache))
    finally:
        engine.forward = forward
    assert cache.kv is None and cache.tokens == []


def test_a_cancel_keeps_what_was_read(engine):
    cache = PrefixCache()
    g = Generation(engine, engine.model.tokenizer, PROMPT, SamplingParams(max_tokens=50), 4096, cache=cache)
    it = iter(g)
    got = [next(it)[0] for _ in range(5)]
    it.close()  # the lane stops reading
    assert cache.tokens == PROMPT + got[:4] and cache.kv.length == len(cache.tokens)


def test_daemon_sends_a_conversation_back_to_its_lane(tiny_model_path, tmp_path):
    """prefix_cache on two CPU lanes: chat A's second turn goes to the lane that read its first and reads only what
    is new; chat B, between them, takes the other lane (which holds no conversation)."""
    from daemon_harness import Daemon

    conf = tmp_path / "c.toml"
    conf.write_text("prefix_cache = true\nrejoin_idle_s = 3600.0\n")
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu,cpu", config=conf).start()
    try:
        a_prompt = list(range(5, 5 + 3 * 90, 3))  # 90 tokens: more than the 64 that make a lane the chat's
        with d.client() as c:
            a1 = c.generate(tokens=a_prompt, max_tokens=6)
            a1.result()
            b = c.generate(tokens=list(range(4, 200, 2)), max_tokens=4)
            b.result()
            a2 = c.generate(tokens=a_prompt + list(a1.tokens) + [11, 12, 13], max_tokens=4)
            a2.result()
        assert a1.stats.prompt_cached_tokens == 0 and b.stats.prompt_cached_tokens == 0
        assert b.stats.lane != a1.stats.lane
        assert a2.stats.lane == a1.stats.lane
        assert a2.stats.prompt_cached_tokens == len(a_prompt) + len(a1.tokens) - 1
        kept = {ln.lane: ln.kept_tokens for ln in d.status().lanes}
        assert kept[a2.stats.lane] == a2.stats.prompt_tokens + len(a2.tokens) - 1
        from stratad.ctl import status_table

        assert f"keeps a sequence of {kept[a2.stats.lane]} tokens" in status_table(d.status())
    finally:
        d.stop()
