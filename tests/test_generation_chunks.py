"""Generation reads a prompt a card's prompt_chunk at a time and hands control back between chunks (CHUNK_READ):
the lane beats and sees a cancel there; stopping there keeps the chunks read for the next prompt."""
from __future__ import annotations

import hashlib

from stratad.engine.generation import CHUNK_READ, Generation
from stratad.engine.prefix_cache import PrefixCache
from stratad.engine.reference import ReferenceEngine
from stratad.engine.sampling import SamplingParams


def engine(model, chunk: int) -> ReferenceEngine:
    e = ReferenceEngine(model, "canonical")
    e.prompt_chunk = chunk
    return e


def test_chunk_read_between_chunks_and_the_tokens_of_a_direct_read(tiny_model):
    m = tiny_model
    prompt = (m.tokenizer.encode("Where is the expert computed, and by whom? ") * 4)[:40]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    events = list(Generation(engine(m, 16), m.tokenizer, prompt, params, m.config.context_length, digest=True))
    assert events[:2] == [CHUNK_READ, CHUNK_READ] and CHUNK_READ not in events[2:]  # 16 + 16 read, 8 with the step
    # the same chunks read by the card itself in one forward (as a direct caller reads them): the same bits
    e = engine(m, 16)
    kv = e.new_kv()
    direct = e.forward(prompt, kv)
    g = Generation(engine(m, 16), m.tokenizer, prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                   m.config.context_length, digest=True)
    [t for t, _ in g if t is not None]
    assert g.digest.hexdigest() == hashlib.sha256(direct[-1].astype("float32").tobytes()).hexdigest()


def test_stopping_between_chunks_keeps_what_was_read(tiny_model):
    m = tiny_model
    prompt = (m.tokenizer.encode("A long prompt that a cancel stops halfway. ") * 6)[:50]
    cache = PrefixCache()
    steps = iter(Generation(engine(m, 16), m.tokenizer, prompt, SamplingParams(max_tokens=4),
                            m.config.context_length, cache=cache))
    assert next(steps) == CHUNK_READ
    steps.close()  # the lane's cancel
    assert cache.tokens == prompt[:16] and cache.kv.length == 16
    # the next request with the same prompt reads only the rest
    g = Generation(engine(m, 16), m.tokenizer, prompt, SamplingParams(max_tokens=2), m.config.context_length,
                   cache=cache)
    out = [e for e in g]
    assert g.cached == 16 and out.count(CHUNK_READ) == 2  # 34 left: 16, 16, then 2 with the step
