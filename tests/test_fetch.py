"""fetch_ref (lane/kernels/fetch.py), the numpy reference of fetch.cu: a decode step's arena experts copied into
staging slots. On the CPU; tests/test_gpu_experts.py checks the kernel against it."""
from __future__ import annotations

import numpy as np
import pytest

from lane.kernels.experts import Layout
from lane.kernels.fetch import fetch_ref


def test_fetch_ref_copies_pair_ps_expert_into_slot_p():
    rng = np.random.default_rng(5)
    gate, down, n_expert = 48, 32, 6
    # an arena layer: three expert-major tensors; staging: slots of gate, up, down one after another
    src_mem = rng.integers(0, 256, 4096, dtype=np.uint8)
    src = Layout(base=0, stride=gate, up_off=1024, down=2048, down_stride=down)
    dst = Layout(base=0, stride=160, up_off=gate, down=2 * gate, down_stride=160)
    dst_mem = np.zeros(5 * 160, np.uint8)
    pairs = np.array([[0, 4], [0, 1], [0, 5], [0, 2]], np.int32)
    got, got_pairs = fetch_ref(src_mem, dst_mem, pairs, 4, src, dst, gate, down, n_slots=3)
    assert got_pairs.tolist() == [[0, 0], [0, 1], [0, 2]]  # the slots cap the pairs
    for p, e in enumerate(pairs[:3, 1]):
        slot = got[p * 160:(p + 1) * 160]
        assert (slot[:gate] == src_mem[e * gate:(e + 1) * gate]).all()
        assert (slot[gate:2 * gate] == src_mem[1024 + e * gate:1024 + (e + 1) * gate]).all()
        assert (slot[2 * gate:2 * gate + down] == src_mem[2048 + e * down:2048 + (e + 1) * down]).all()
        assert (slot[2 * gate + down:] == 0).all()
    assert (got[3 * 160:] == 0).all() and e < n_expert
    assert fetch_ref(src_mem, dst_mem, pairs, 0, src, dst, gate, down, 3)[1].shape == (0, 2)


def test_fetch_ref_refuses_what_the_kernel_cannot_copy():
    lay = Layout(0, 64, 32, 1024, 64)
    with pytest.raises(ValueError, match="16-byte words"):
        fetch_ref(np.zeros(8, np.uint8), np.zeros(8, np.uint8), np.zeros((1, 2), np.int32), 1, lay, lay, 40, 24, 1)
    with pytest.raises(ValueError, match="16-byte aligned"):
        fetch_ref(np.zeros(8, np.uint8), np.zeros(8, np.uint8), np.zeros((1, 2), np.int32), 1, lay,
                  Layout(8, 64, 32, 1024, 64), 32, 16, 1)


def test_fetch_ref_parts_split_an_expert_into_gate_up_and_down():
    """A decode step fetches gate and up, then down: together the bytes of one fetch of all; only the first writes
    the pair list."""
    rng = np.random.default_rng(6)
    gate, down = 48, 32
    src_mem = rng.integers(0, 256, 4096, dtype=np.uint8)
    src = Layout(base=0, stride=gate, up_off=1024, down=2048, down_stride=down)
    dst = Layout(base=0, stride=160, up_off=gate, down=2 * gate, down_stride=160)
    pairs = np.array([[0, 3], [0, 0]], np.int32)
    whole, p_all = fetch_ref(src_mem, np.zeros(480, np.uint8), pairs, 2, src, dst, gate, down, 3)
    first, p_gu = fetch_ref(src_mem, np.zeros(480, np.uint8), pairs, 2, src, dst, gate, down, 3, parts="gate_up")
    both, p_dn = fetch_ref(src_mem, first, pairs, 2, src, dst, gate, down, 3, parts="down")
    assert (both == whole).all() and not (first == whole).all() and p_dn is None
    assert (p_gu == p_all).all()
    with pytest.raises(ValueError, match="parts must be one of"):
        fetch_ref(src_mem, first, pairs, 2, src, dst, gate, down, 3, parts="up")


def test_fetch_ref_skips_the_experts_staged_ahead():
    """Experts fetched a layer ahead are in slots 0 .. min(count, cap) - 1: a pair whose expert is there takes that
    slot and is not copied; the others go to slot_base + p, where a fetch of all would put them."""
    rng = np.random.default_rng(7)
    gate, down = 48, 32
    src_mem = rng.integers(0, 256, 4096, dtype=np.uint8)
    src = Layout(base=0, stride=gate, up_off=1024, down=2048, down_stride=down)
    dst = Layout(base=0, stride=160, up_off=gate, down=2 * gate, down_stride=160)
    ahead = np.array([[0, 5], [0, 2], [0, 4]], np.int32)  # predicted: experts 5, 2, 4; the cap keeps the first two
    dst_mem, ahead_pairs = fetch_ref(src_mem, np.zeros(8 * 160, np.uint8), ahead, 3, src, dst, gate, down, 2)
    assert ahead_pairs.tolist() == [[0, 0], [0, 1]]
    pairs = np.array([[0, 2], [0, 1], [0, 4], [0, 5]], np.int32)
    for parts in ("all", "gate_up"):
        got, got_pairs = fetch_ref(src_mem, dst_mem, pairs, 4, src, dst, gate, down, 4, parts,
                                   staged=(ahead, 3, 2), slot_base=2)
        assert got_pairs.tolist() == [[0, 1], [0, 3], [0, 4], [0, 0]]  # 4 was predicted past the cap: copied
    assert (got[:2 * 160] == dst_mem[:2 * 160]).all()  # the staged slots untouched
    assert (got[2 * 160:3 * 160] == 0).all() and (got[5 * 160:] == 0).all()  # no copy for staged pairs
    whole, _ = fetch_ref(src_mem, np.zeros(8 * 160, np.uint8), pairs, 4, src, dst, gate, down, 4, slot_base=2)
    for p in (1, 2):
        assert (got[(2 + p) * 160:(2 + p) * 160 + 2 * gate] == whole[(2 + p) * 160:(2 + p) * 160 + 2 * gate]).all()
    with pytest.raises(ValueError, match="past the staged ones"):
        fetch_ref(src_mem, dst_mem, pairs, 4, src, dst, gate, down, 4, staged=(ahead, 3, 3), slot_base=2)
    with pytest.raises(ValueError, match="1 to 32 pairs"):
        fetch_ref(src_mem, dst_mem, pairs, 4, src, dst, gate, down, 33)
