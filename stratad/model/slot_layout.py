"""The slot layout every card shares: one expert's gate rows, then up rows, then down rows, raw GGUF bytes."""
from __future__ import annotations

import numpy as np

from stratad.model.gguf_file import ModelFile

KINDS = ("gate", "up", "down")


def slot_bytes(model: ModelFile) -> int:
    """Bytes of the largest expert over all layers (types may differ per layer or per matrix)."""
    return max(sum(model.expert_raw(layer, k, 0).nbytes for k in KINDS) for layer in range(model.config.n_layer))


def expert_bytes(model: ModelFile, layer: int, e: int) -> list[np.ndarray]:
    """The expert's three matrices in the arena (uint8 (rows, row_bytes) views)."""
    return [model.expert_raw(layer, k, e) for k in KINDS]


def split_slot(model: ModelFile, layer: int, raw: np.ndarray) -> list[np.ndarray]:
    """A slot's bytes as the three matrices of an expert of `layer`."""
    out, off = [], 0
    for k in KINDS:
        ti = model.tensors[f"blk.{layer}.ffn_{k}_exps.weight"]
        n = ti.shape[1] * ti.row_bytes
        out.append(raw[off:off + n].reshape(ti.shape[1], ti.row_bytes))
        off += n
    return out
