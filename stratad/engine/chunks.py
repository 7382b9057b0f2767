"""How a card reads a prompt: in chunks of its prompt_chunk tokens (an expert's weights are read once a chunk; a
read's rounding depends on its length, so the chunking is part of a card's bits). Generation hands a card one chunk
a forward, so the lane sees heartbeats and cancels between them."""
from __future__ import annotations

from typing import Iterator

PROMPT_CHUNK = 1024  # the numpy card's (the GPU card's: stratad.config GPU_PROMPT_CHUNK)


def chunks(tokens, logits: str, size: int = PROMPT_CHUNK) -> Iterator[tuple[object, int, bool]]:
    """(chunk, logit rows it returns, last) for a forward of `tokens` returning logits "all", "last" or "none", in
    chunks of `size` tokens."""
    for s in range(0, len(tokens), size):
        chunk = tokens[s:s + size]
        last = s + size >= len(tokens)
        yield chunk, len(chunk) if logits == "all" else int(logits == "last" and last), last
