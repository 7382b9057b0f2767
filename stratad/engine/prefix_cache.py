"""A lane's last sequence kept for the next request: the KV of the tokens it has read, reused for the longest
common prefix of the next prompt (agents send the whole conversation again on every turn).

Reuse is not bit-identical to reading the prompt afresh: the reused tokens' KV was computed in other chunks (or
one token at a time, for generated tokens), and a prompt chunk and a decode step round differently. Where the
experts are computed still changes nothing.
"""
from __future__ import annotations

import numpy as np


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (vectorised: conversations run to 100K tokens)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """Holds one KV (the engine's object) and the tokens whose entries it has, in order."""

    def __init__(self):
        self.kv = None
        self.tokens: list[int] = []

    def take(self, engine, prompt: list[int]):
        """(kv, n): a KV holding the prompt's first n tokens (n < len(prompt): the last prompt token is always
        read, its logits are the first step's); a fresh KV and 0 without a useful match."""
        n = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        kv, self.kv, self.tokens = self.kv, None, []  # in use until keep()
        if kv is None or n == 0:
            return engine.new_kv(), 0
        kv.truncate(n)
        return kv, n

    def keep(self, kv, tokens: list[int]) -> None:
        """After a request: kv holds the entries of these tokens (kv.length == len(tokens))."""
        self.kv, self.tokens = kv, tokens

    def clear(self) -> None:
        self.kv, self.tokens = None, []
