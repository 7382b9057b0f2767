"""The numpy KV (reference.KVCache) as the host cache's blocks and back, bit for bit: a block is BLOCK tokens of
every layer's K then V, float32, (n_layer, 2, tokens, n_kv, head_dim) in C order."""
from __future__ import annotations

import numpy as np

LAYOUT = "numpy-f32/v1"  # the tag of this layout: a block's hash chain starts from it


def block_shape(kv, block_tokens: int) -> tuple[int, ...]:
    n_kv, hd = kv.k[0].shape[1:]
    return (len(kv.k), 2, block_tokens, n_kv, hd)


def block_bytes(n_layer: int, n_kv: int, head_dim: int, block_tokens: int) -> int:
    return n_layer * 2 * block_tokens * n_kv * head_dim * 4


def export(kv, start: int, n_blocks: int, block_tokens: int) -> np.ndarray:
    """Blocks start .. start + n_blocks of kv (whole ones, below kv.length): (n_blocks, bytes) uint8, a copy."""
    a, b = start * block_tokens, (start + n_blocks) * block_tokens
    if b > kv.length:
        raise ValueError(f"blocks up to position {b} asked of a KV of {kv.length} positions")
    out = np.empty((n_blocks,) + block_shape(kv, block_tokens), np.float32)
    for layer, (k, v) in enumerate(zip(kv.k, kv.v)):
        out[:, layer, 0] = k[a:b].reshape(n_blocks, block_tokens, *k.shape[1:])
        out[:, layer, 1] = v[a:b].reshape(n_blocks, block_tokens, *v.shape[1:])
    return out.reshape(n_blocks, -1).view(np.uint8)


def restore(kv, start: int, blocks: np.ndarray, block_tokens: int) -> None:
    """Write blocks (n, bytes) at block index start: kv then holds (start + n) * block_tokens positions, the first
    start * block_tokens of them as they were."""
    n = len(blocks)
    a = start * block_tokens
    kv.truncate(a)
    x = np.ascontiguousarray(blocks).view(np.float32).reshape((n,) + block_shape(kv, block_tokens))
    for layer in range(len(kv.k)):
        kv.append(layer, x[:, layer, 0].reshape(n * block_tokens, *x.shape[-2:]),
                  x[:, layer, 1].reshape(n * block_tokens, *x.shape[-2:]))
    kv.length = a + n * block_tokens
