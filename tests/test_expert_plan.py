"""The GPU expert kernels' launch plan (lane/kernels/experts.py: staged stages, blocks an SM, shared memory a block)
on cards with less shared memory than the H200 it was tuned on: an A100 (163 KB a block) and the RTX 3090 / 4090
the project's users run (99 KB). Planned without a device, as a lane plans from its card's attributes."""
from __future__ import annotations

import pytest

from lane.kernels.experts import EXPERT_TYPES, H200_SMEM_BLOCK, H200_SMEM_SM, ExpertKernels

CARDS = {"h200": ((H200_SMEM_BLOCK, H200_SMEM_SM), 132), "a100": ((166912, 167936), 108),
         "rtx": ((101376, 102400), 82)}


TOO_BIG_FOR_RTX = {"Q8_0", "F32"}  # Q8_0's tuned gate/up and F32's down stage a block's rows whole
TYPES = [t.name for t in EXPERT_TYPES] + ["Q4_K+Q6_K", "IQ3_S+Q4_K"]


@pytest.mark.parametrize("qt", [t for t in TYPES if t not in TOO_BIG_FOR_RTX])
@pytest.mark.parametrize("card", list(CARDS))
def test_the_plan_fits_the_cards_shared_memory(qt, card):
    """Every other type plans on each card: within its shared memory, fewer stages and shorter tiles where less
    fits."""
    gu, _, dn = qt.partition("+")
    smem, n_sm = CARDS[card]
    k = ExpertKernels.planned(2048, 768, gu, dn or gu, n_sm=n_sm, smem=smem)
    assert max(k.gu_smem, k.dn_smem, k.gut_smem) <= smem[0]
    assert k.gu_blocks * (k.gu_smem + 1024) <= smem[1] and k.dn_blocks * (k.dn_smem + 1024) <= smem[1]
    assert k.gu_grid == n_sm * k.gu_blocks
    h200 = ExpertKernels.planned(2048, 768, gu, dn or gu)
    assert k.gu_stages <= h200.gu_stages and k.dn_stages <= h200.dn_stages  # fewer stages where less fits
    assert k.simt_tile <= h200.simt_tile and k.tile_p in (4, 8, 16, 64)
    if card == "rtx":
        assert not k.mma  # the tensor-core prompt tiles need more: prompts take the SIMT tiles (same bits)


@pytest.mark.parametrize("qt, need, on_a100", [("Q8_0", 140560, True), ("F32", 197136, False)])
def test_what_a_99_kb_card_cannot_stage_is_refused_naming_the_type_and_the_limit(qt, need, on_a100):
    """Q8_0's tuned gate/up stages a block's 32 gate and 32 up rows of 2048 values, F32's down its rows of 768 floats:
    more than an RTX card allows a block. The lane fails to start saying so (its card is built before it takes
    requests); an A100 (163 KB) takes Q8_0."""
    with pytest.raises(ValueError, match=rf"{qt} expert rows need {need} bytes of shared memory .* allows 101376"):
        ExpertKernels.planned(2048, 768, qt, qt, n_sm=82, smem=CARDS["rtx"][0])
    if on_a100:
        ExpertKernels.planned(2048, 768, qt, qt, n_sm=108, smem=CARDS["a100"][0])


def test_a_shorter_simt_tile_where_the_staging_leaves_too_little_room():
    """Q5_1's staged gate/up rows on a 99 KB card leave room for h of 4 tokens, not the tuning's 8."""
    k = ExpertKernels.planned(2048, 768, "Q5_1", "Q5_1", n_sm=82, smem=CARDS["rtx"][0])
    assert (k.simt_tile, ExpertKernels.planned(2048, 768, "Q5_1", "Q5_1").simt_tile) == (4, 8)
    assert dict(k.defines)["TILE_P"] == 4
