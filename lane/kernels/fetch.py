"""A decode step's experts that no card holds, fetched from the page-locked arena into staging slots on the card
(fetch.cu), and the numpy reference of the same copy.

  fetch_experts(pairs, n_pairs, src, dst, gate_bytes, down_bytes, pairs_out, n_slots, parts="all", staged=None,
                slot_base=0)
  fetch_ref(src_memory, dst_memory, pairs, n, src, dst, gate_bytes, down_bytes, n_slots, parts="all", staged=None,
            slot_base=0)

parts: "all" (gate, up and down), "gate_up" or "down": a decode step fetches gate and up first, then down while the
gate/up kernel computes (lane/gpu_experts.py ArenaSource). staged = (pairs, count, cap): the pairs of an earlier fetch
into slots 0 .. min(count, cap) - 1 (a layer's experts fetched ahead on a prediction); a pair whose expert is there
takes that slot and is not copied, the others go to slot_base + p (slot_base >= cap).
"""
from __future__ import annotations

import numpy as np

from .device import module, need, on_stream
from .experts import Layout
from .launch import launch

SOURCE = "fetch.cu"
THREADS = 512
MAX_FETCH = 32  # fetch.cu's: the pairs one launch takes at most
PARTS = ("all", "gate_up", "down")


def _words(parts: str, gate_bytes: int, down_bytes: int) -> tuple[int, int]:
    """The range of an expert's 16-byte words (gate, up, down in that order) that `parts` names."""
    g, d = gate_bytes // 16, down_bytes // 16
    if parts not in PARTS:
        raise ValueError(f"parts must be one of {', '.join(PARTS)}, not {parts!r}")
    return {"all": (0, 2 * g + d), "gate_up": (0, 2 * g), "down": (2 * g, 2 * g + d)}[parts]


def whole_words(gate_bytes: int, down_bytes: int) -> bool:
    """Whether an expert's matrices are whole 16-byte words: fetch.cu's unit (else they are read in place)."""
    return gate_bytes % 16 == 0 and down_bytes % 16 == 0


def _check(src: Layout, dst: Layout, gate_bytes: int, down_bytes: int) -> None:
    if not whole_words(gate_bytes, down_bytes):
        raise ValueError(f"expert matrices of {gate_bytes} / {down_bytes} bytes are not whole 16-byte words")
    for lay in (src, dst):
        if any(int(v) % 16 for v in (lay.base, lay.stride, lay.up_off, lay.down, lay.down_stride)):
            raise ValueError("expert matrices must start 16-byte aligned, at strides that are multiples of 16")


def _check_staged(n_slots: int, staged, slot_base: int) -> int:
    """The staged slots' cap (0 without staged); refuses slot numbers the kernel cannot take."""
    cap = 0 if staged is None else int(staged[2])
    if not 1 <= n_slots <= MAX_FETCH or not 0 <= cap <= slot_base:
        raise ValueError(f"a fetch takes 1 to {MAX_FETCH} pairs, its own slots from slot_base ({slot_base}) past the "
                         f"staged ones ({cap})")
    return cap


def fetch_experts(pairs, n_pairs, src: Layout, dst: Layout, gate_bytes: int, down_bytes: int, pairs_out,
                  n_slots: int, parts: str = "all", staged=None, slot_base: int = 0, *, stream=None) -> None:
    """For p < min(n_pairs[0], n_slots) (a device count): expert pairs[p, 1]'s matrices named by `parts` from the
    layout src into slot slot_base + p of the layout dst, unless staged (device pairs and count, and the cap) has
    that expert in slot j; pairs_out[p] = (pairs[p, 0], its slot) where parts has gate."""
    m = module(SOURCE)
    _check(src, dst, gate_bytes, down_bytes)
    lo, hi = _words(parts, gate_bytes, down_bytes)
    cap = _check_staged(n_slots, staged, slot_base)
    if staged is not None:
        need(staged[0], np.int32, None, "staged pairs")
        need(staged[1], np.int32, None, "staged count")
    need(pairs, np.int32, None, "pairs")
    need(n_pairs, np.int32, None, "n_pairs")
    need(pairs_out, np.int32, None, "pairs_out")
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs_out.ndim != 2 or pairs_out.shape[0] < n_slots:
        raise ValueError(f"pairs must be (P, 2) and pairs_out hold {n_slots} pairs")
    if n_slots * (2 * gate_bytes + down_bytes) // 16 >= 2**30:  # and the words past the last, in int
        raise ValueError(f"{n_slots} experts of {2 * gate_bytes + down_bytes} bytes: too many words for one fetch")
    with on_stream(stream):
        launch(m.fn("fetch_experts"), (max(1, m.n_sm // 2),), (THREADS,),
               (pairs, n_pairs, np.int32(n_slots),
                np.uint64(src.base), np.int64(src.stride), np.int64(src.up_off), np.uint64(src.down),
                np.int64(src.down_stride),
                np.uint64(dst.base), np.int64(dst.stride), np.int64(dst.up_off), np.uint64(dst.down),
                np.int64(dst.down_stride),
                np.int32(gate_bytes // 16), np.int32(down_bytes // 16), np.int32(lo), np.int32(hi),
                np.uint64(0) if staged is None else staged[0], np.uint64(0) if staged is None else staged[1],
                np.int32(cap), np.int32(slot_base), pairs_out))


def fetch_ref(src_memory: np.ndarray, dst_memory: np.ndarray, pairs: np.ndarray, n: int, src: Layout, dst: Layout,
              gate_bytes: int, down_bytes: int, n_slots: int, parts: str = "all", staged: tuple | None = None,
              slot_base: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """fetch_experts on byte arrays standing for the source and destination memory (each layout's addresses are
    offsets into its array; staged: numpy pairs, count and cap): the destination after the copy, and pairs_out's
    first min(n, n_slots) pairs (None where parts has no gate: that launch leaves pairs_out alone)."""
    _check(src, dst, gate_bytes, down_bytes)
    lo, hi = _words(parts, gate_bytes, down_bytes)
    cap = _check_staged(n_slots, staged, slot_base)
    ahead = {}  # expert -> its staged slot (the first, as the kernel's search finds it)
    for j in range(min(max(0, int(staged[1])), cap) if staged is not None else 0):
        ahead.setdefault(int(staged[0][j, 1]), j)
    out = dst_memory.copy()
    n = max(0, min(int(n), n_slots))
    g = gate_bytes // 16
    got = np.zeros((n, 2), np.int32)
    for p in range(n):
        e = int(pairs[p, 1])
        at = ahead.get(e, slot_base + p)
        got[p] = pairs[p, 0], at
        if e in ahead:
            continue
        for w0, a, b, size in ((0, src.base + e * src.stride, dst.base + at * dst.stride, gate_bytes),
                               (g, src.base + src.up_off + e * src.stride, dst.base + dst.up_off + at * dst.stride,
                                gate_bytes),
                               (2 * g, src.down + e * src.down_stride, dst.down + at * dst.down_stride, down_bytes)):
            if lo <= w0 < hi:  # the parts are whole matrices
                out[b:b + size] = src_memory[a:a + size]
    return out, (got if lo == 0 else None)
