"""expert_cache = auto on a GPU card (device only): the card sizes its slot pool from the memory left once its own
needs are in place (CupyCard.fit_pool), and what it leaves is enough to serve a prompt longer than a chunk and its
decode steps, with the same tokens and logits bits as a card holding every expert."""
from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest

from stratad.model.config import PRESETS
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import slot_bytes

pytestmark = pytest.mark.gpu
CHUNK = 1024


def serve(card, n_prompt: int, steps: int):
    """A prompt of n_prompt tokens (several chunks) and greedy decode steps: the tokens and the last logits."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, card.c.vocab_size, n_prompt).astype(np.int32)
    kv = card.new_kv()
    logits = card.forward(tokens, kv)
    out = []
    for _ in range(steps):
        t = int(np.argmax(logits[-1]))
        out.append(t)
        logits = card.forward(np.array([t], np.int32), kv)
    return out, logits[-1].copy()


def test_a_card_fits_its_pool_to_the_memory_left(cp, tmp_path):
    from lane.cupy_card import CupyCard

    c = dataclasses.replace(PRESETS["a3b"], n_layer=2, vocab_size=1024, context_length=8192)
    path = tmp_path / "two-layers.gguf"
    make_model(path, c, expert_quant="Q8_0", router_skew=1.0, seed=4)  # ~5 MB an expert: a window of 1.3 GB
    model = ModelFile(path)
    total, sb = c.n_layer * c.n_expert, slot_bytes(model)
    everything = [(layer, e) for layer in range(c.n_layer) for e in range(c.n_expert)]

    cp.get_default_memory_pool().free_all_blocks()
    before = cp.cuda.runtime.memGetInfo()[0]
    card = CupyCard(model, 0, total, 8192, prompt_chunk=CHUNK, fit=True, cards=2)
    assert card.pool.n_slots == total  # an H100 / H200 holds every expert of two layers
    free, kept = card.fit_room
    needs = before - free  # what the card took before its pool
    card.pool.fill(everything)
    want = serve(card, 3 * CHUNK + 100, 8)
    card.close()
    del card
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()

    # a ballast leaving a card's own needs and room for about half of the experts (whatever of the first card's
    # memory is not given back yet counts as taken: free_now is what is free)
    free_now = cp.cuda.runtime.memGetInfo()[0]
    ballast = cp.cuda.Memory(free_now - needs - kept - (total // 2) * sb)
    try:
        card = CupyCard(model, 0, total, 8192, prompt_chunk=CHUNK, fit=True, cards=2)
        n = card.pool.n_slots
        assert total // 4 < n < 3 * total // 4, (n, total)
        card.pool.fill(everything)  # the first n, as a lane fills its placement
        assert int((card.pool.table >= 0).sum()) == n
        got = serve(card, 3 * CHUNK + 100, 8)
        assert got[0] == want[0]
        assert np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
        card.close()
        del card
    finally:
        del ballast
    # a card still held by a reference cycle would give its memory back during the next cards' fit and hand them
    # more room than the ballast leaves (seen once on an H100: both lanes of one GPU took every slot)
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()

    # two lanes of one GPU (cards 0,0): the first leaves the second its needs, reserve and margin and an equal
    # share of the rest; the second leaves the first its reserve and margin. In one process here, the second needs
    # less than the first did (no CUDA context or library handles of its own), so it gets that much more
    free_now = cp.cuda.runtime.memGetInfo()[0]
    ballast = cp.cuda.Memory(free_now - 2 * (needs + kept) - (total // 2) * sb)
    try:
        first = CupyCard(model, 0, total, 8192, prompt_chunk=CHUNK, fit=True, cards=2, after=1)
        second = CupyCard(model, 0, total, 8192, prompt_chunk=CHUNK, fit=True, cards=2, before=1)
        n1, n2 = first.pool.n_slots, second.pool.n_slots
        assert total // 8 < n1 < 3 * total // 8 and n1 - total // 16 <= n2, (n1, n2, total)
        # both lanes' reserves and margins are still free after the second's pool (less a slot's rounding)
        assert cp.cuda.runtime.memGetInfo()[0] >= 2 * kept - sb
        for c in (first, second):
            c.pool.fill(everything)
        assert serve(second, 3 * CHUNK + 100, 8)[0] == want[0]
        first.close()
        second.close()
    finally:
        del ballast
