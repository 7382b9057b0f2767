"""One request's token loop, shared by every card: the prompt in chunks, sampling, stop tokens, stop strings,
streamed text."""
from __future__ import annotations

import hashlib
import time
from typing import Iterator

import numpy as np

from stratad.engine.card import Card
from stratad.engine.prefix_cache import PrefixCache
from stratad.engine.sampling import Sampler, SamplingParams

CHUNK_READ = (None, "")  # what the iteration yields between a prompt's chunks: nothing to send, a point to stop at


class BadRequest(ValueError):
    """The request's own input cannot be served as given (the client's to fix). Any other exception out of a
    generation, ValueErrors included, is a fault of the engine."""


class Generation:
    """Iterate to get (token, text) pieces; afterwards `finish_reason` is "stop" or "length" and the timings are set.

    A prompt longer than the card's prompt_chunk is read a chunk a forward, and CHUNK_READ is yielded after each
    chunk but the last: the caller's point to beat, read its control messages, and stop (close the iteration) on a
    cancel; the KV of the chunks read stays with the prefix cache. Text that could still become the start of a
    stop string is held back, so a stop string never reaches the client; the text before it does.
    """

    def __init__(self, engine: Card, tokenizer, prompt: list[int], params: SamplingParams, context_length: int,
                 digest: bool = False, cache: PrefixCache | None = None):
        if not prompt:
            raise BadRequest("the prompt is empty")
        if problems := params.problems():
            raise BadRequest("; ".join(problems))
        if len(prompt) + params.max_tokens > context_length:
            raise BadRequest(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the "
                             f"context length {context_length}")
        ids = np.asarray(prompt, np.int64)
        if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= tokenizer.vocab_size)][0])
            raise BadRequest(f"token id {bad} outside the vocabulary (0..{tokenizer.vocab_size - 1})")
        self.engine, self.tok, self.prompt, self.p = engine, tokenizer, list(prompt), params
        self.finish_reason: str | None = None
        self.generated = 0
        self.t_start = self.t_first = self.t_end = 0.0
        self.digest = hashlib.sha256() if digest else None  # of every step's logits, for bit-exactness checks
        self.cache = cache  # the lane's last sequence: its KV serves this prompt's common prefix
        self.cached = 0  # prompt tokens whose KV was reused

    def __iter__(self) -> Iterator[tuple[int | None, str]]:
        self.t_start = time.monotonic()
        sample, stops = Sampler(self.p), () if self.p.ignore_eos else self.tok.stop_ids
        decoder = self.tok.stream_decoder(skip_special=True)
        hold = max((len(s) for s in self.p.stop), default=1) - 1
        pending = ""
        if self.cache is not None:
            kv, self.cached = self.cache.take(self.engine, self.prompt)
        else:
            kv = self.engine.new_kv()
        read = self.prompt[:self.cached]  # the tokens whose KV entries kv holds
        stepping = False  # inside a forward: if it fails, what kv holds is not known
        ahead_ok = (self.engine.steps_ahead and self.engine.samples_on_device(self.p) and self.digest is None)
        ahead = None  # the next step's draw, taken early where that step was launched ahead

        def step(tokens):  # -> (the next token, the logits: None if sampled on the device without a digest)
            nonlocal ahead
            u = sample.draw() if ahead is None else ahead  # one draw a step, in order, wherever it is picked
            ahead = sample.draw() if ahead_ok and self.generated + 1 < self.p.max_tokens else None
            return self.engine.forward_token(tokens, kv, self.p, u, self.digest is not None, ahead=ahead)

        try:
            todo, n = self.prompt[self.cached:], self.engine.prompt_chunk
            while len(todo) > n:
                stepping = True
                self.engine.forward(todo[:n], kv, logits="none")
                stepping = False
                read += todo[:n]
                todo = todo[n:]
                yield CHUNK_READ
            stepping = True
            t, logits = step(todo)
            stepping = False
            read += todo
            while True:
                if self.digest is not None:
                    self.digest.update(np.ascontiguousarray(logits[-1], np.float32).tobytes())
                if not self.t_first:
                    self.t_first = time.monotonic()
                if t in stops:
                    self.finish_reason = "stop"
                    break
                self.generated += 1
                pending += decoder.push(t)
                cut = min((i for i in (pending.find(s) for s in self.p.stop) if i >= 0), default=-1)
                if cut >= 0:
                    self.finish_reason = "stop"
                    yield t, pending[:cut]
                    return
                emit_to = max(0, len(pending) - hold)
                yield t, pending[:emit_to]
                pending = pending[emit_to:]
                if self.generated >= self.p.max_tokens:
                    self.finish_reason = "length"
                    break
                stepping = True
                nxt, logits = step([t])
                stepping = False
                read.append(t)
                t = nxt
            tail = pending + decoder.flush()
            if tail:
                yield None, tail
        finally:  # also when the caller stops reading (a cancel): that is always between steps
            self.t_end = time.monotonic()
            if self.cache is not None:
                if stepping:
                    self.cache.clear()
                else:
                    self.cache.keep(kv, read)

    @property
    def decode_tok_s(self) -> float:
        dt = self.t_end - self.t_first
        return (self.generated - 1) / dt if self.generated > 1 and dt > 0 else 0.0

    @property
    def ttft_s(self) -> float:
        return max(0.0, self.t_first - self.t_start)
