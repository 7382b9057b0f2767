"""The GPU expert kernels' launch plan (lane/kernels/experts.py: staged stages, blocks an SM, shared memory a block)
on cards with less shared memory than the H200 it was tuned on: an A100 (163 KB a block) and the RTX 3090 / 4090
the project's users run (99 KB). Planned without a device, as a lane plans from its card's attributes."""
from __future__ import annotations

import pytest

from lane.kernels.experts import EXPERT_TYPES, H200_SMEM_BLOCK, H200_SMEM_SM, ExpertKernels, Tuning

CARDS = {"h200": ((H200_SMEM_BLOCK, H200_SMEM_SM), 132), "a100": ((166912, 167936), 108),
         "rtx": ((101376, 102400), 82)}


TOO_BIG_FOR_RTX = {"F32"}  # F32's down stages a block's rows whole
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
    assert k.simt_tile <= h200.simt_tile and k.tile_p in (4, 8, 16, 32, 64)
    if k.mma:  # tensor-core tiles of as many 16-pair m-tiles as fit the block (fewer than the H200's where less does)
        assert max(k.mma_gu_smem, k.mma_dn_smem) <= smem[0] and k.tile_p == 16 * k.mma_mt <= h200.tile_p
        assert k.mma_mt % k.mma_mpw == 0


def test_f32_down_on_a_99_kb_card_is_refused_naming_the_type_and_the_limit():
    """F32's down stages a block's rows of 768 floats: more than an RTX card (or an A100) allows a block. The lane
    fails to start saying so (its card is built before it takes requests)."""
    for card in ("rtx", "a100"):
        with pytest.raises(ValueError, match=rf"F32 expert rows need 198864 bytes of shared memory .* allows "
                                             rf"{CARDS[card][0][0]}"):
            ExpertKernels.planned(2048, 768, "F32", "F32", n_sm=82, smem=CARDS[card][0])


def test_q8_0_gate_up_on_a_99_kb_card_is_read_in_place_by_the_generic_decoder():
    """Q8_0's tuned gate/up would stage a block's 32 gate and 32 up rows of 2048 values (139 KB): on an RTX card
    they are decoded where they are (GU_DIRECT) by the generic decoder (UNTUNED: the tuned one reads staged rows
    only), the same bits (canonical's); on an H200 the tuned path stays."""
    k = ExpertKernels.planned(2048, 768, "Q8_0", "Q8_0", n_sm=82, smem=CARDS["rtx"][0])
    assert k.gu_direct and k.untuned.name == "Q8_0" and not k.tuned(k.qt_gu) and not k.tuned(k.qt_dn)
    assert dict(k.defines)["UNTUNED"] == 8 and dict(k.defines)["GU_DIRECT"] == 1
    h200 = ExpertKernels.planned(2048, 768, "Q8_0", "Q8_0")
    assert not h200.gu_direct and h200.untuned is None and h200.tuned(h200.qt_gu)
    assert dict(h200.defines)["UNTUNED"] == -1
    with pytest.raises(ValueError, match=r"IQ3_S expert rows need"):  # IQ3_S is never read in place
        ExpertKernels.planned(4096, 1536, "IQ3_S", "IQ3_S", n_sm=82, smem=CARDS["rtx"][0])


def test_a_shorter_simt_tile_where_the_staging_leaves_too_little_room():
    """Q5_1's staged gate/up rows on a 99 KB card leave room for h of 4 tokens, not the tuning's 8."""
    k = ExpertKernels.planned(2048, 768, "Q5_1", "Q5_1", n_sm=82, smem=CARDS["rtx"][0])
    assert (k.simt_tile, ExpertKernels.planned(2048, 768, "Q5_1", "Q5_1").simt_tile) == (4, 8)
    assert dict(k.defines)["TILE_P"] == 4


@pytest.mark.parametrize("dn_rows", [3, 6, 64])
def test_down_rows_must_divide_the_warp(dn_rows):
    """A down item's rows share the warp's 32 lanes evenly (32 / dn_rows lanes a row): other counts are refused."""
    from lane.kernels.experts import Tuning

    with pytest.raises(ValueError, match="dn_rows must divide 32 and d_model"):
        ExpertKernels.planned(2048, 768, "IQ3_S", "IQ3_S", tuning=Tuning(dn_rows=dn_rows))


def test_f32_gate_up_runs_one_block_an_sm_for_its_registers():
    """F32's decode gate/up reads its rows in place and needs the 128 registers of one block an SM (GU_REGS: at two
    blocks, 64, it spills); a tuning of one block an SM already, and every other type, keep the tuning's blocks."""
    f32 = ExpertKernels.planned(2048, 768, "F32", "F16")
    assert f32.gu_blocks == 1 and dict(f32.defines)["GU_MINB"] == 1 and f32.gu_grid == f32.n_sm
    for qt in ("F16", "Q4_K", "IQ2_S", "IQ1_S"):
        assert ExpertKernels.planned(2048, 768, qt, qt).gu_blocks == 2
    assert ExpertKernels.planned(2048, 768, "F32", "F16", tuning=Tuning(gu_warps=8, gu_min_blocks=3)).gu_blocks == 2


@pytest.mark.parametrize("shape,qt,mt", [
    ((2048, 768), "IQ3_S", 4), ((2048, 768), "Q4_K+Q6_K", 4), ((2048, 768), "Q5_K+Q6_K", 2), ((2048, 768), "Q6_K", 2),
    ((2048, 768), "Q8_0", 2), ((2048, 768), "Q5_0", 2), ((2048, 768), "F16", 0), ((4096, 1536), "Q4_K+Q6_K", 1),
    ((4096, 1536), "IQ3_S", 1), ((4096, 1536), "IQ2_XS", 2), ((4096, 1536), "Q8_0", 0), ((2048, 768), "IQ2_XS", 4)])
def test_tensor_core_tiles_take_as_many_pairs_as_fit(shape, qt, mt):
    """An H200's prompt tiles: 64 pairs where their activation rows fit a block beside two 32-row ranges of gate and
    up, else 32 or 16 (a3b's Q5_K / Q6_K / Q8_0 gate/up, the 235B shape's IQ2_XS, IQ3_S, Q4_K), else none (SIMT
    tiles: the 235B shape's Q8_0 gate/up, the float types); the warps' m-tiles divide the tile's."""
    gu, _, dn = qt.partition("+")
    k = ExpertKernels.planned(*shape, gu, dn or gu)
    assert k.mma_mt == mt and k.mma == (mt > 0)
    assert k.tile_p == (16 * mt if mt else k.simt_tile)
    if mt:
        assert max(k.mma_gu_smem, k.mma_dn_smem) <= H200_SMEM_BLOCK and mt % k.mma_mpw == 0
        assert ("MMA_MT", mt) in k.defines and ("MMA_MPW", k.mma_mpw) in k.defines
    with pytest.raises(ValueError, match="mma_mt"):
        ExpertKernels.planned(*shape, gu, dn or gu, tuning=Tuning(mma_mt=3))


def test_h_in_down_by_the_gate_up_type():
    """Decode items: warp items with h quantised by the down kernel, except for the gate/up types whose rows decode
    cheaply (H_GROUP_TYPES: group items measured faster there); tunings 0 and 2 choose one for every type; h in
    down needs the down kernel's block items to tile d_model."""
    from lane.kernels.experts import H_GROUP_TYPES, Tuning

    assert {t.name for t in H_GROUP_TYPES} == {"Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q4_K"}
    for gu, dn, want in (("IQ3_S", "IQ3_S", 1), ("Q4_K", "Q6_K", 0), ("Q6_K", "Q4_K", 1), ("Q8_0", "Q8_0", 0)):
        k = ExpertKernels.planned(2048, 768, gu, dn)
        assert (k.h_in_down, dict(k.defines)["H_IN_DOWN"]) == (bool(want), want), (gu, dn)
    for h in (0, 2):
        assert {ExpertKernels.planned(2048, 768, qt, qt, tuning=Tuning(h_in_down=h)).h_in_down
                for qt in ("Q4_K", "IQ3_S")} == {h == 2}
    assert not ExpertKernels.planned(2048, 768, "IQ3_S", "IQ3_S", tuning=Tuning(h_in_down=2, dn_warps=12)).h_in_down
    with pytest.raises(ValueError, match="h_in_down must be 0, 1 or 2"):
        ExpertKernels.planned(2048, 768, "IQ3_S", "IQ3_S", tuning=Tuning(h_in_down=3))


def test_the_combine_folds_where_k_experts_tile_a_block_item():
    """A decode step's combine folds into the down kernel where k divides its warps into block items of whole
    chunks of every pair (their rows within a warp's lanes) and the extra shared memory (the item's rows twice, the
    router's rows and weights, with h quantised there the k pairs' h) keeps the blocks an SM; else combine_rows."""
    k = ExpertKernels.planned(2048, 768, "IQ3_S", "IQ3_S")  # 16 warps of 4 rows, h quantised by the down kernel
    assert (k.dn_warps, k.tuning.dn_rows, k.h_in_down) == (16, 4, True)
    assert k.fold_smem(8) == k.dn_smem + 2 * 16 * 4 * 4 + 256 + 8 * 864  # 768 codes + 24 scales, 16-byte rows
    assert [n for n in range(1, 33) if k.fold_smem(n)] == [2, 4, 8, 16]  # 1: 16 chunks, 64 rows
    q4k = ExpertKernels.planned(2048, 768, "Q4_K", "Q4_K")  # group items: the k pairs' h read as gate/up wrote it
    assert not q4k.h_in_down and q4k.fold_smem(8) == q4k.dn_smem + 2 * 16 * 4 * 4 + 256
    wide = ExpertKernels.planned(2048, 768, "Q8_0", "Q8_0", tuning=Tuning(dn_rows=8))
    assert wide.fold_smem(4) and not wide.fold_smem(2)  # 8 chunks of 8 rows: past a warp's lanes
    tight = ExpertKernels.planned(2048, 768, "IQ3_S", "IQ3_S", smem=(H200_SMEM_BLOCK, 2 * (k.dn_smem + 1024) + 1000))
    assert tight.dn_blocks == 2 and tight.fold_smem(8) is None  # it would cost a block an SM
