"""What a request's token loop (Generation) needs of whatever computes the model: the numpy card, the GPU card and
the in-process reference engine all implement `Card`.

A card reads at most `prompt_chunk` tokens a forward the way the loop calls it (the loop cuts a prompt into such
chunks and hands control back to the lane between them). `forward_token` is a forward whose last row is sampled
with the step's draw u; `samples_on_device` says whether that happens on the card (only the token crosses the bus)
or on the host from the logits. A card with `steps_ahead` can launch the next step before the host has read this
one's token (`ahead`: that step's draw).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from stratad.engine.sampling import Sampler, SamplingParams


class Card(Protocol):
    prompt_chunk: int
    steps_ahead: bool

    def new_kv(self): ...

    def forward(self, tokens, kv, logits: str = "last") -> np.ndarray | None: ...

    def samples_on_device(self, params: SamplingParams) -> bool: ...

    def forward_token(self, tokens, kv, params: SamplingParams, u: float, logits: bool,
                      ahead: float | None = None) -> tuple[int, np.ndarray | None]: ...


@runtime_checkable
class KvBlockCard(Protocol):
    """A card whose KV goes to and comes back from the host conversation cache (stratad/kv_store.py) as blocks of
    block_tokens positions, its own dtype and layout as bytes, bit for bit. `kv_layout` names that layout: a
    block's hash chain starts from it, so only cards of the same layout share blocks."""
    kv_layout: str

    def kv_block_bytes(self, block_tokens: int) -> int: ...

    def kv_host_buffer(self, n_blocks: int, block_tokens: int) -> np.ndarray:
        """Host memory for n_blocks blocks, (n_blocks, kv_block_bytes) uint8, that import_kv copies from fastest."""

    def export_kv(self, kv, start: int, n_blocks: int, block_tokens: int) -> "KvExport":
        """Blocks start .. start + n_blocks of kv as (n_blocks, kv_block_bytes) uint8 in host memory, as they are
        now: the card may go on with other sequences while the copy completes."""

    def import_kv(self, kv, start: int, blocks: np.ndarray, block_tokens: int) -> None:
        """Write blocks at block index start; kv then holds (start + len(blocks)) * block_tokens positions."""

    def import_kv_from(self, kv, start: int, store, slots: list[int], block_tokens: int,
                       hashes: list[bytes] | None = None) -> int:
        """Write the blocks of the store's slots (stratad/kv_store.KvStore) at block index start, up to the first
        taken for another block meanwhile (hashes: the blocks find() found there, so that one taken and published
        again since is seen too) or one the store failed to give; returns how many were whole, once every copy is
        done (kv then holds (start + that) * block_tokens positions; untouched when none). The caller reads the
        prompt from there."""


@dataclass
class KvExport:
    """Blocks exported from a card: `blocks` holds them once `wait()` has returned (a GPU card's copy to host
    memory may still be running when export_kv returns); `release()` gives their memory back once nothing reads
    them (a GPU card's page-locked buffer, for its next export: lane/export_buffers.py)."""
    blocks: np.ndarray
    wait: Callable[[], None] = lambda: None
    release: Callable[[], None] = lambda: None


class HostSampled:
    """Card members for a card that samples on the host: the whole logits come back and Sampler.pick runs here."""

    steps_ahead = False

    def samples_on_device(self, params: SamplingParams) -> bool:
        return False

    def forward_token(self, tokens, kv, params: SamplingParams, u: float, logits: bool,
                      ahead: float | None = None) -> tuple[int, np.ndarray]:
        lg = self.forward(tokens, kv)
        return Sampler(params).pick(lg[-1], u), lg
