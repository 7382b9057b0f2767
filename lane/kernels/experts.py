"""CuPy wrapper of the bit-exact GPU expert kernels (experts.cu): quantise, gate/up + SwiGLU, down, combine.

Every output is bit-identical to stratad.engine.canonical (quantize_act, expert, combine): see experts.cu.

    k = ExpertKernels(d_model, d_ff, "IQ3_S", "IQ3_S", max_pairs)
    k.quantize(x, qa, da)                                # x (T, d_model) f32 -> qa int8 (T, d_model), da (T, d_model/32)
    k.run(pool.data.ptr, pairs, n_pairs, qa, da, out)    # pairs int32 (max_pairs, 2) = (token, slot); n_pairs int32 (1,)
    k.run(k.layout(gate, stride, up, down, down_stride), ...)  # experts elsewhere (a layer of the arena)
    k.combine(out[:T*K].reshape(T, K, d_model), w, y)    # router-order weighted sum
    k.build_pairs(ids, src, slot, pairs, n_pairs, rowmap, miss_ptr, n_miss_ptr)  # routed ids -> per-source pairs
    k.combine_rows(rows, host_rows_ptr, rowmap, w, x)    # x += combine, rows through the row map
    k.ring(counter, bell_ptr)                            # doorbell for the host
    k.run_tiled(pool.data.ptr, pairs, tiles, n_tiles, qa, da, out)  # run() for expert-grouped pairs in tiles

All launches have fixed grids and read n_pairs on the device, so quantize/run/combine can be captured in a CUDA
graph and replayed with new pair lists. A slot is one expert's raw GGUF bytes: gate rows (d_ff x row_bytes(d_model)),
up rows, down rows (d_model x row_bytes(d_ff)); slots are `slot_stride` bytes apart (default `slot_bytes`).
Intermediates (h, qh, dh; max_pairs rows each) belong to the instance: one instance per concurrent stream.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from stratad.engine import canonical
from stratad.model.quants import EXPERT_TYPES, fmt, iq3s_grid, parse_type

from . import decode_tables
from .compile import load_module
from .launch import launch

try:
    from gguf import GGMLQuantizationType as _T
except ImportError:  # pragma: no cover
    _T = None

SOURCE = "experts.cu"
GRID_PLAIN_BYTES = 512 * 4          # the IQ3_S grid (expert_decode.cuh's GRID_TABLE_BYTES without IQ3_FAST)
GRID_SIGNED_BYTES = 16 * 512 * 4    # signed_grid(): the grid under all 16 sign patterns (with IQ3_FAST)


def _qtype(q):
    t = parse_type(q) if isinstance(q, str) else _T(int(q))
    if t not in EXPERT_TYPES:
        raise ValueError(f"{t.name} is not an expert type the GPU kernels support ({[e.name for e in EXPERT_TYPES]})")
    return t


# types with decoders of their own in expert_decode.cuh (and tensor-core prompt tiles); every other type runs the
# generic path (expert_term.cuh); those of MMA_TYPES on tensor-core prompt tiles too, the rest on SIMT ones
TUNED = (_T.IQ3_S, _T.Q4_K, _T.Q8_0)
# experts_mma.cuh's MMA_TYPE: every quantised type (int8 codes); FLOATS' views are int16
FLOATS = (_T.F32, _T.F16, _T.BF16)
MMA_TYPES = tuple(t for t in EXPERT_TYPES if t not in FLOATS)
# generic types whose decode reads decode.cuh's table blob, and the table each reads (a copy of that part at shared
# offset 0: expert_decode.cuh's TabSmem)
TABLE_PARTS = {_T.IQ2_XXS: "IQ2XXS", _T.IQ2_XS: "IQ2XS", _T.IQ2_S: "IQ2S", _T.IQ3_XXS: "IQ3XXS", _T.IQ1_S: "IQ1",
               _T.IQ1_M: "IQ1", _T.IQ4_NL: "IQ4NL", _T.IQ4_XS: "IQ4NL", _T.MXFP4: "MXFP4"}
TABLE_TYPES = tuple(TABLE_PARTS)


def table_bytes(qt, iq3_fast: int) -> int:
    """Shared bytes at offset 0 of a kernel reading weights of type qt (experts.cu's GU_TBL / DN_TBL)."""
    if qt == _T.IQ3_S:
        return GRID_SIGNED_BYTES if iq3_fast else GRID_PLAIN_BYTES
    if qt not in TABLE_PARTS:
        return 0
    start, end = table_part(qt)
    return -(-(end - start) // 16) * 16


def table_part(qt) -> tuple[int, int]:
    """The bytes [start, end) of decode.cuh's table blob a generic table type reads (TABLE_PARTS)."""
    off = decode_tables.offsets()
    start = off[TABLE_PARTS[qt]]
    return start, min(v for v in off.values() if v > start)


def simt_tile(qt_gate_up, tuning: "Tuning") -> int:
    """Pairs a SIMT prompt tile: the tuning's, at most 4 for float gate/up weights (a decoded float sub-block is 16
    registers, and 8 tokens' sums beside two of them spill)."""
    return min(tuning.tile_p, 4) if qt_gate_up in FLOATS else tuning.tile_p


# registers a decode gate/up thread needs where the 64 that 16 warps x 2 blocks leave spill (NVRTC, sm_90, the a3b
# shape): F32's rows read in place spill 192 bytes there; at one block an SM (128) it runs faster (docs/perf-notes.md)
GU_REGS = {_T.F32: 128}


def gu_min_blocks(qt_gate_up, tuning: "Tuning") -> int:
    """Gate/up blocks an SM for the decode kernel's register cap: the tuning's, fewer where GU_REGS says."""
    need = GU_REGS.get(qt_gate_up)
    cap = 65536 // (32 * tuning.gu_warps * need) if need else tuning.gu_min_blocks
    return max(1, min(tuning.gu_min_blocks, cap))


# gate/up types whose decode pair of kernels runs faster on group items (h_in_down 0) than on warp items: their
# rows decode cheaply, so the down kernel's quantisation of h costs more than the SMs' balance saves (H100, a3b,
# decode8c; docs/perf-notes.md, session 36)
H_GROUP_TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q5_1, _T.Q8_0, _T.Q4_K})


def h_in_down(qt_gate_up, tuning: "Tuning") -> bool:
    """Whether the decode kernels take warp items with h quantised by the down kernel (Tuning.h_in_down)."""
    return tuning.h_in_down == 2 or (tuning.h_in_down == 1 and qt_gate_up not in H_GROUP_TYPES)


H200_SMEM_BLOCK, H200_SMEM_SM = 232448, 233472  # shared bytes a block may opt in to / an SM has (sm_90)


def card_smem(device) -> tuple[int, int]:
    """A CuPy device's shared memory: the bytes a block may opt in to, and an SM's (H200's where not reported)."""
    attrs = device.attributes
    return (int(attrs.get("MaxSharedMemoryPerBlockOptin", H200_SMEM_BLOCK)),
            int(attrs.get("MaxSharedMemoryPerMultiprocessor", H200_SMEM_SM)))


def gate_up_direct(qt_gate_up, d_model: int, tuning: "Tuning", smem_block: int) -> bool:
    """Whether a gate/up type's rows are decoded where they are instead of staged (experts.cu's GU_DIRECT): a gate/up
    block stages its 32 rows of gate and up, which for F16 / BF16 / F32 at d_model 2048 (and Q8_0 on a card of 99 KB
    a block) is more shared memory than a block has. The tuned decoders read staged rows only, so a tuned type read
    in place goes through the generic path (experts.cu's UNTUNED); IQ3_S, whose generic path has no table, is never
    read in place (its rows then do not fit: refused)."""
    staged = table_bytes(qt_gate_up, tuning.iq3_fast) + 256 + 16 + \
        tuning.gu_warps * 2 * _staged(qt_gate_up, d_model, 32 // tuning.gu_warps)
    return qt_gate_up != _T.IQ3_S and staged > smem_block


def _f32hex(v) -> str:
    return float(np.float32(v)).hex() + "f"


def exp_defines() -> list[tuple[str, str]]:
    """canonical.exp's constants as -D values (hex floats: exact)."""
    c = canonical
    d = [("EXP_LOG2E", _f32hex(c.LOG2E)), ("EXP_LN2_HI", _f32hex(c.LN2_HI)), ("EXP_LN2_LO", _f32hex(c.LN2_LO))]
    d += [(f"EXP_C{i}", _f32hex(v)) for i, v in enumerate(c.EXP_POLY)]
    if len(c.EXP_POLY) != 8:
        raise RuntimeError("experts.cu's exp evaluates an 8-coefficient polynomial; canonical.EXP_POLY changed")
    return d


@dataclass(frozen=True)
class Tuning:
    """Launch shape of the two expert kernels (defaults measured on the H200; see docs/perf-notes.md)."""

    gu_warps: int = 16          # warps per gate/up block; a block owns a 32-row group, so each warp has 32/gu_warps rows
    gu_min_blocks: int = 2      # gate/up blocks per SM (register cap 65536 / (32 * warps * blocks)); lowered to fit
    gu_stages: int = 1          # block items in flight per warp (cp.async depth)
    dn_warps: int = 16          # warps per down block
    dn_min_blocks: int = 2
    dn_stages: int = 2
    dn_rows: int = 4            # down rows per warp item (32 / dn_rows lanes a row)
    iq3_fast: int = 1           # IQ3_S decode: 1 = read a group's signed weights from the 32 KB signed grid table
                                # (signed_grid, one load a 4-weight group), 0 = decode magnitudes from the 2 KB grid
                                # and negate bytes (decode_sub)
    tile_p: int = 8             # prompt chunks, simt: pairs of one expert per tile (a weight sub-block decoded once)
    prompt: str = "mma"         # prompt tiles: "mma" (int8 tensor cores, 16 mma_mt pairs a tile, where the shape
                                # allows) or "simt" (the tiled dp4a kernels, tile_p pairs a tile)
    mma_mpw: int = 2            # tensor-core tiles: m-tiles (16 pairs) per warp, 1 / 2 / 4 (32 / 16 / 8 warps a block
                                # at 4 m-tiles a tile; at most the tile's)
    mma_mt: int = 4             # tensor-core tiles: m-tiles a tile at most, 4 / 2 / 1 (64 / 32 / 16 pairs); fewer
                                # where the activation rows of 64 pairs beside the weights do not fit a block
    mma_unroll: int = 2         # tensor-core tiles: leaves per loop iteration (1 or 2); 2 measured fastest
    h_in_down: int = 1          # decode: 2 = gate/up items a warp's rows, dealt evenly over the SMs, and h quantised
                                # by the down kernel (experts.cu: H_IN_DOWN); 0 = a block's 32-row group an item, h
                                # quantised by the gate/up block (as the prompt tiles always do); 1 = 2 but for the
                                # gate/up types of H_GROUP_TYPES


def signed_grid() -> np.ndarray:
    """expert_decode.cuh's IQ3_S table: uint32 (16 * 512,), word (signs4 << 9) | idx holds iq3s_grid()[idx]'s four int8
    values (byte b = value b) with byte b negated where bit b of signs4 is set, i.e. the four weights of a group
    whose grid index is idx and whose sign bits are signs4. signs4 = 0 is the plain grid (the first 512 words)."""
    g = iq3s_grid()
    # decode_sub negates bytes as (m ^ 0xff) + 1, exact for magnitudes >= 1; int8 negation needs them <= 127
    if int(g.min()) < 1 or int(g.max()) > 127:
        raise RuntimeError("IQ3_S grid magnitudes must be 1..127")
    neg = (np.arange(16)[:, None] >> np.arange(4)) & 1  # (16, 4): sign bit b of each pattern
    t = np.where(neg[:, None, :] == 1, -g, g)  # int8 (16, 512, 4)
    return np.ascontiguousarray(t).view(np.uint32).reshape(16 * 512)


def _staged(qt, kin: int, rows: int) -> int:
    """Shared bytes experts.cu stages for `rows` consecutive rows of kin values (mirror of GU_CHB / DN_CHB)."""
    rng = rows * fmt(qt).row_bytes(kin)
    return (rng + 14 + 15) // 16 * 16 + 16


@dataclass(frozen=True)
class Layout:
    """Where a source's experts are in memory the card can read: expert s's gate rows at base + s * stride, its up
    rows up_off bytes after them, its down rows at down + s * down_stride. A slot pool is one layout (the three
    matrices one after another in each slot); a layer of the page-locked arena is another (GGUF's three tensors)."""
    base: int
    stride: int
    up_off: int
    down: int
    down_stride: int


class ExpertKernels:
    """The GPU expert path of one layer shape (d_model, d_ff, gate/up type, down type) for up to max_pairs pairs."""

    def __init__(self, d_model: int, d_ff: int, qtype_gate_up, qtype_down, max_pairs: int, *,
                 slot_stride: int | None = None, tuning: Tuning | None = None, device=None,
                 smem: tuple[int, int] | None = None):
        """smem: plan as for a card with that much shared memory (a block's opt-in, an SM's) instead of this one's:
        a smaller card's staging run here (tests)."""
        import cupy

        self.cp = cupy
        self._configure(d_model, d_ff, qtype_gate_up, qtype_down, max_pairs, slot_stride, tuning)
        self.device = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
        with self.device:
            attrs = self.device.attributes
            self.n_sm = int(attrs.get("MultiProcessorCount") or
                            cupy.cuda.runtime.getDeviceProperties(self.device.id)["multiProcessorCount"])
            self._plan(*(smem or card_smem(self.device)))
            self.defines = self._defines()
            self.module, self.build = load_module(SOURCE, self.defines, device=self.device.id, return_info=True)
            self._k_gu = self.module.get_function("expert_gateup")
            self._k_dn = self.module.get_function("expert_down")
            self._k_gut = self.module.get_function("expert_gateup_tiled")
            self._k_dnt = self.module.get_function("expert_down_tiled")
            self._k_q = self.module.get_function("quantize_rows")
            self._k_c = self.module.get_function("combine_k")
            self._extra = {}
            self._check_layout()
            self._k_gu.max_dynamic_shared_size_bytes = self.gu_smem
            self._k_dn.max_dynamic_shared_size_bytes = max([self.dn_smem] + [
                self.fold_smem(k) or 0 for k in range(1, self.dn_warps + 1)])
            self._k_gut.max_dynamic_shared_size_bytes = self.gut_smem
            self._k_dnt.max_dynamic_shared_size_bytes = self.dn_smem
            if self.mma:
                self._k_gum = self.module.get_function("expert_gateup_mma")
                self._k_dnm = self.module.get_function("expert_down_mma")
                self._k_gum.max_dynamic_shared_size_bytes = self.mma_gu_smem
                self._k_dnm.max_dynamic_shared_size_bytes = self.mma_dn_smem

            # the plain grid (signs4 = 0); the kernels' fill_grid builds the rest of signed_grid() in shared memory.
            # A kernel's grid_g is that grid for IQ3_S, decode.cuh's table blob for the generic IQ types (each block
            # copies its type's part: table_part; unread by the rest)
            self.grid = cupy.asarray(signed_grid()[:512])
            self.gu_tab, self.dn_tab = (decode_tables.device_tables() if q in TABLE_TYPES else self.grid
                                        for q in (self.qt_gu, self.qt_dn))
            P, F = self.max_pairs, self.d_ff
            self.h = cupy.empty((P, F), cupy.float32)
            self.qh = cupy.empty((P, F), cupy.int8)
            self.dh = cupy.empty((P, F // 32), cupy.float32)

    @classmethod
    def planned(cls, d_model: int, d_ff: int, qtype_gate_up, qtype_down, tuning: Tuning | None = None,
                n_sm: int = 132, smem: tuple[int, int] = (H200_SMEM_BLOCK, H200_SMEM_SM)) -> "ExpertKernels":
        """The plan and the defines a lane builds experts.cu with on a card of n_sm SMs and smem (shared bytes a
        block may opt in to, an SM has; default: an H200's), without CuPy or a device: what scripts/nvrtc_check.py
        builds. Launch nothing with it."""
        k = cls.__new__(cls)
        k._configure(d_model, d_ff, qtype_gate_up, qtype_down, 1, None, tuning)
        k.n_sm = n_sm
        k._plan(*smem)
        k.defines = k._defines()
        return k

    def _configure(self, d_model, d_ff, qtype_gate_up, qtype_down, max_pairs, slot_stride, tuning) -> None:
        """The shape, types and tuning, checked; the matrices' and a slot's bytes."""
        self.d_model, self.d_ff, self.max_pairs = int(d_model), int(d_ff), int(max_pairs)
        self.qt_gu, self.qt_dn = _qtype(qtype_gate_up), _qtype(qtype_down)
        if self.d_model % 32 or self.d_ff % 32:
            raise ValueError("d_model and d_ff must be multiples of 32")
        if self.max_pairs < 1:
            raise ValueError("max_pairs must be >= 1")
        self.tuning = tuning or Tuning()
        t = self.tuning
        if t.gu_warps not in (2, 4, 8, 16, 32):
            raise ValueError("gu_warps must be 2, 4, 8, 16 or 32")
        if t.dn_rows not in (1, 2, 4, 8, 16, 32) or self.d_model % t.dn_rows:
            raise ValueError("dn_rows must divide 32 and d_model")
        if t.tile_p not in (4, 8, 16):
            raise ValueError("tile_p must be 4, 8 or 16")
        if t.prompt not in ("mma", "simt"):
            raise ValueError("prompt must be 'mma' or 'simt'")
        if t.mma_mpw not in (1, 2, 4):
            raise ValueError("mma_mpw must be 1, 2 or 4")
        if t.mma_mt not in (1, 2, 4):
            raise ValueError("mma_mt must be 1, 2 or 4")
        if t.mma_unroll not in (1, 2):
            raise ValueError("mma_unroll must be 1 or 2")
        if t.h_in_down not in (0, 1, 2):
            raise ValueError("h_in_down must be 0, 1 or 2")
        self.gate_bytes = self.d_ff * fmt(self.qt_gu).row_bytes(self.d_model)
        self.down_bytes = self.d_model * fmt(self.qt_dn).row_bytes(self.d_ff)
        self.slot_bytes = self.slot_bytes_of(self.d_model, self.d_ff, self.qt_gu, self.qt_dn)
        self.slot_stride = self.slot_bytes if slot_stride is None else int(slot_stride)
        if self.slot_stride < self.slot_bytes or self.slot_stride % 16:
            raise ValueError(f"slot_stride must be >= {self.slot_bytes} and a multiple of 16")

    def _defines(self) -> list[tuple[str, object]]:
        t = self.tuning
        return [
            ("GU_QT", int(self.qt_gu)), ("GU_KIN", self.d_model), ("GU_ROWS", self.d_ff),
            ("DN_QT", int(self.qt_dn)), ("DN_KIN", self.d_ff), ("DN_ROWS", self.d_model),
            ("GU_WPB", self.gu_warps), ("GU_MINB", self.gu_blocks), ("GU_STAGES", self.gu_stages),
            ("GU_DIRECT", int(self.gu_direct)), ("TILE_P", self.simt_tile), ("MMA_MPW", self.mma_mpw),
            ("MMA_MT", max(1, self.mma_mt)),  # the size _plan builds where no tile is used
            ("MMA_UNROLL", t.mma_unroll),
            ("DN_WPB", self.dn_warps), ("DN_MINB", self.dn_blocks), ("DN_STAGES", self.dn_stages),
            ("DN_R", t.dn_rows), ("IQ3_FAST", t.iq3_fast), ("UNTUNED", int(self.untuned or -1)),
            ("H_IN_DOWN", int(self.h_in_down)),
        ] + exp_defines()

    # ---- sizes --------------------------------------------------------------------------------------------------
    @staticmethod
    def slot_bytes_of(d_model: int, d_ff: int, qtype_gate_up, qtype_down) -> int:
        """Raw bytes of one expert: gate and up (d_ff rows of d_model values), down (d_model rows of d_ff values)."""
        return 2 * d_ff * fmt(_qtype(qtype_gate_up)).row_bytes(d_model) + d_model * fmt(_qtype(qtype_down)).row_bytes(d_ff)

    def pack_slot(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        """One slot's bytes (uint8, slot_stride) from the three raw matrices (uint8 (rows, row_bytes))."""
        out = np.zeros(self.slot_stride, np.uint8)
        parts = [np.ascontiguousarray(m).view(np.uint8).reshape(-1) for m in (gate, up, down)]
        want = [self.gate_bytes, self.gate_bytes, self.down_bytes]
        off = 0
        for p, n in zip(parts, want):
            if p.size != n:
                raise ValueError(f"matrix has {p.size} bytes, expected {n}")
            out[off:off + n] = p
            off += n
        return out

    def tuned(self, qt) -> bool:
        """Whether qt runs on its tuned decoder here (not where the plan reads its rows in place: UNTUNED)."""
        return qt in TUNED and qt != self.untuned

    def _plan(self, smem_block: int, smem_sm: int) -> None:
        t = self.tuning
        self.smem_block, self.smem_sm = smem_block, smem_sm
        self.grid_bytes = table_bytes(_T.IQ3_S, t.iq3_fast)  # expert_decode.cuh's GRID_TABLE_BYTES

        def fit(qt, fixed, stg, warps, stages, blocks):
            smem = table_bytes(qt, t.iq3_fast) + fixed + warps * stages * stg + 16
            while stages > 1 and smem > smem_block:
                stages -= 1
                smem = table_bytes(qt, t.iq3_fast) + fixed + warps * stages * stg + 16
            if smem > smem_block:
                raise ValueError(f"{_qtype(qt).name} expert rows need {smem} bytes of shared memory a block staged; "
                                 f"this GPU allows {smem_block}")
            blocks = max(1, min(blocks, smem_sm // (smem + 1024)))
            return stages, blocks, smem

        self.gu_direct = gate_up_direct(self.qt_gu, self.d_model, t, smem_block)
        self.untuned = self.qt_gu if self.gu_direct and self.qt_gu in TUNED else None  # generic, in place
        gu_stg = 2 * _staged(self.qt_gu, self.d_model, 0 if self.gu_direct else 32 // t.gu_warps)
        dn_stg = _staged(self.qt_dn, self.d_ff, t.dn_rows)
        self.gu_warps, self.dn_warps = t.gu_warps, t.dn_warps
        self.gu_stages, self.gu_blocks, self.gu_smem = fit(self.qt_gu, 256, gu_stg, t.gu_warps, t.gu_stages,
                                                           gu_min_blocks(self.qt_gu, t))
        # h quantised by the down kernel where its block items (dn_warps chunks of dn_rows rows) tile d_model
        self.h_in_down = h_in_down(self.qt_gu, t) and (self.d_model // t.dn_rows) % t.dn_warps == 0
        self.dn_act = -(-(self.d_ff + self.d_ff // 8) // 16) * 16  # experts.cu: DN_ACT1, a pair's h quantised
        self.dn_stages, self.dn_blocks, self.dn_smem = fit(self.qt_dn, 2 * self.dn_act if self.h_in_down else 0,
                                                           dn_stg, t.dn_warps, t.dn_stages, t.dn_min_blocks)
        self.gu_grid = self.n_sm * self.gu_blocks
        self.dn_grid = self.n_sm * self.dn_blocks
        # tiled kernels: the same staging, h of tile_p tokens per group instead of one (experts.cu: GUT_SMEM); a
        # shorter tile where that is over the card's shared memory (a 99 KB card: Q5_1's staged rows leave room
        # for 4 tokens, not 8)
        def gut(tile: int) -> int:
            return self.gu_smem - 2 * 32 * 4 + 2 * tile * 32 * 4

        self.simt_tile = simt_tile(self.qt_gu, t)
        while gut(self.simt_tile) > smem_block and self.simt_tile > 4:
            self.simt_tile //= 2
        self.gut_smem = gut(self.simt_tile)
        if self.gut_smem > smem_block:
            raise ValueError(f"tiled gate/up needs {self.gut_smem} bytes of shared memory per block")
        # tensor-core tiles (experts_mma.cuh): compiled for these row lengths and MMA_TYPES (their codes are int8;
        # not a tuned type read in place, UNTUNED), used where they fit: tiles of as many m-tiles (16 pairs) as the
        # tuning allows and a block's shared memory holds (the activation rows of the tile's pairs and two 32-row
        # ranges of weights), the warps' m-tiles a divisor of that
        shape_ok = self.d_model % 128 == 0 and self.d_ff % 128 == 0 and \
            all(q in MMA_TYPES and q != self.untuned for q in (self.qt_gu, self.qt_dn))

        def mma_sizes(mt: int) -> tuple[int, int]:  # shared bytes of the gate/up and down tile kernels
            return mma_smem(self.qt_gu, self.d_model, True, mt), mma_smem(self.qt_dn, self.d_ff, False, mt)

        self.mma_mt = next((mt for mt in (4, 2, 1) if mt <= t.mma_mt and max(mma_sizes(mt)) <= smem_block), 0) \
            if shape_ok else 0
        self.mma = t.prompt == "mma" and self.mma_mt > 0
        built = max(1, self.mma_mt)  # the tile kernels are built where the shape allows them, used or not
        self.mma_mpw = min(t.mma_mpw, built)
        self.mma_gu_smem, self.mma_dn_smem = mma_sizes(built) if shape_ok else (0, 0)  # as layout_info reports
        self.tile_p = 16 * self.mma_mt if self.mma else self.simt_tile  # pairs a prompt tile (build_pairs cuts them)

    def fold_smem(self, k: int) -> int | None:
        """The down launch's shared bytes with a decode step's combine folded in for k experts a token (experts.cu:
        DnCombine: block items of dn_warps / k chunks of each pair, their rows combined from shared memory), or None
        where it cannot fold: k not dividing dn_warps, an item's rows past a warp's 32 lanes, or more shared memory
        than keeps dn_blocks blocks an SM."""
        t = self.tuning
        if k < 1 or self.dn_warps % k or (self.dn_warps // k) * t.dn_rows > 32 or \
                (self.d_model // t.dn_rows) % (self.dn_warps // k):
            return None
        smem = self.dn_smem + 2 * self.dn_warps * t.dn_rows * 4 + 2 * 32 * 4  # experts.cu: DN_FOLD
        smem += k * self.dn_act if self.h_in_down else 0
        fits = smem <= self.smem_block and self.dn_blocks * (smem + 1024) <= self.smem_sm
        return smem if fits else None

    def _check_layout(self) -> None:
        cp = self.cp
        info = cp.zeros(16, cp.int32)
        self.module.get_function("layout_info")((1,), (32,), (info,))
        v = info.get()
        want = (self.gu_smem, self.dn_smem, self.gut_smem, self.simt_tile, self.mma_gu_smem, self.mma_dn_smem,
                self.grid_bytes)
        if tuple(int(v[i]) for i in (0, 1, 11, 12, 13, 14, 8)) != want:
            raise RuntimeError(f"shared memory plan mismatch: kernel {v[[0, 1, 11, 12, 13, 14, 8]]}, host {want}")

    def describe(self) -> dict:
        return {"gate_up": {"qtype": self.qt_gu.name, "grid": self.gu_grid, "warps": self.gu_warps,
                            "stages": self.gu_stages, "smem": self.gu_smem, "direct": self.gu_direct,
                            "h_in_down": self.h_in_down},
                "down": {"qtype": self.qt_dn.name, "grid": self.dn_grid, "warps": self.dn_warps,
                         "stages": self.dn_stages, "smem": self.dn_smem},
                "prompt": {"kernel": "mma" if self.mma else "simt", "tile": self.tile_p,
                           "smem": [self.mma_gu_smem, self.mma_dn_smem] if self.mma else self.gut_smem},
                "tuning": self.tuning.__dict__, "slot_bytes": self.slot_bytes, "slot_stride": self.slot_stride,
                "build": self.build}

    # ---- launches -----------------------------------------------------------------------------------------------
    def _stream(self, stream):
        return stream if stream is not None else contextlib.nullcontext()

    def _need(self, a, dtype, shape, name):
        cp = self.cp
        if not isinstance(a, cp.ndarray) or a.dtype != dtype or not a.flags.c_contiguous:
            raise TypeError(f"{name} must be a C-contiguous cupy {np.dtype(dtype).name} array")
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {a.shape}, expected {shape}")

    def quantize(self, x, qa, da, stream=None) -> None:
        """x float32 (T, d_model) -> qa int8 (T, d_model), da float32 (T, d_model/32) (canonical.quantize_act)."""
        cp = self.cp
        self._need(x, cp.float32, None, "x")
        if x.ndim != 2 or x.shape[1] % 32:
            raise ValueError("x must be (T, n) with n a multiple of 32")
        T, n = x.shape
        self._need(qa, cp.int8, (T, n), "qa")
        self._need(da, cp.float32, (T, n // 32), "da")
        groups = T * n // 32
        if groups == 0:
            return
        with self._stream(stream):
            launch(self._k_q, ((groups + 7) // 8,), (256,), (x, qa, da, np.int32(groups)))

    # ---- where the experts are --------------------------------------------------------------------------------
    def slots(self, pool_ptr: int) -> Layout:
        """A slot pool at pool_ptr (slot_stride bytes a slot): gate, up, down rows one after another."""
        return self.layout(pool_ptr, self.slot_stride, pool_ptr + self.gate_bytes,
                           pool_ptr + 2 * self.gate_bytes, self.slot_stride)

    def layout(self, gate_ptr: int, stride: int, up_ptr: int, down_ptr: int, down_stride: int) -> Layout:
        """Expert s's gate rows at gate_ptr + s * stride, up rows at up_ptr + s * stride, down rows at down_ptr +
        s * down_stride (e.g. a layer's three GGUF expert tensors, device-readable)."""
        if int(gate_ptr) % 16 or int(down_ptr) % 16 or (int(up_ptr) - int(gate_ptr)) % 16 or int(stride) % 16 \
                or int(down_stride) % 16:
            raise ValueError("expert matrices must start 16-byte aligned, at strides that are multiples of 16")
        if int(stride) < self.gate_bytes or int(down_stride) < self.down_bytes:
            raise ValueError(f"strides {stride} / {down_stride} are shorter than an expert's matrices "
                             f"({self.gate_bytes} / {self.down_bytes} bytes)")
        return Layout(int(gate_ptr), int(stride), int(up_ptr) - int(gate_ptr), int(down_ptr), int(down_stride))

    def _where(self, where) -> Layout:
        return where if isinstance(where, Layout) else self.slots(int(where))

    # ---- launches (where: a Layout, or a slot pool's pointer) ----------------------------------------------------
    def run_gate_up(self, where, pairs, n_pairs, qa, da, stream=None) -> None:
        cp = self.cp
        lay = self._where(where)
        self._check_run_args(pairs, n_pairs)
        self._need(qa, cp.int8, None, "qa")
        self._need(da, cp.float32, None, "da")
        if qa.ndim != 2 or qa.shape[1] != self.d_model or tuple(da.shape) != (qa.shape[0], self.d_model // 32):
            raise ValueError("qa must be (T, d_model) and da (T, d_model/32)")
        with self._stream(stream):
            launch(self._k_gu, (self.gu_grid,), (self.gu_warps * 32,),
                       (np.uint64(lay.base), np.int64(lay.stride), np.int64(lay.up_off), pairs, n_pairs,
                        np.int32(self.max_pairs),
                        qa, da, self.gu_tab, self.h, self.qh, self.dh),
                       shared_mem=self.gu_smem)

    def run_down(self, where, pairs, n_pairs, out, combine=None, stream=None, pdl: bool = True) -> None:
        """The down half of run(). The kernel reads pairs / n_pairs and its first weight rows before its PDL wait:
        they must not be the output of the launch just before it on the stream (run_gate_up is; route_pairs /
        build_pairs come before that). pdl=False: weights written by a launch it joins from another stream (a
        captured PDL launch's wait would not order those early reads after it)."""
        cp = self.cp
        lay = self._where(where)
        self._check_run_args(pairs, n_pairs)
        self._need(out, cp.float32, (self.max_pairs, self.d_model), "out")
        cmb, smem = (np.uint64(0), np.uint64(0), np.uint64(0), np.int32(0), np.int32(1)), self.dn_smem
        if combine is not None:  # (rowmap, w (1, k), x (1, d_model)): a decode step's combine, done here
            rowmap, w, x = combine
            self._need(rowmap, cp.int32, None, "rowmap")
            self._need(w, cp.float32, None, "w")
            self._need(x, cp.float32, (1, self.d_model), "x")
            if w.shape[0] != 1 or rowmap.size < w.size:
                raise ValueError("the combine in the down kernel is for one token's k rows")
            smem = self.fold_smem(w.size)
            if smem is None:
                raise ValueError(f"the combine of {w.size} experts a token does not fold into this down kernel "
                                 f"({self.dn_warps} warps of {self.tuning.dn_rows} rows): combine_rows does it")
            cmb = (rowmap, w, x, np.int32(w.size), np.int32(self.dn_warps // w.size))
        with self._stream(stream):
            launch(self._k_dn, (self.dn_grid,), (self.dn_warps * 32,),
                       (np.uint64(lay.down), np.int64(lay.down_stride), pairs, n_pairs, np.int32(self.max_pairs),
                        self.qh, self.dh, self.h, self.dn_tab, out) + cmb,
                       shared_mem=smem, pdl=pdl)

    def run(self, where, pairs, n_pairs, qa, da, out, combine=None, stream=None) -> None:
        """out[p] = canonical.expert(expert pairs[p,1] of `where`, qa/da row pairs[p,0]) for p < n_pairs[0] (a
        device count). combine = (rowmap, w, x): also x += the token's k rows of out in router order, as
        combine_rows does, when every one of its k pairs is here (one token, one source)."""
        lay = self._where(where)
        self.run_gate_up(lay, pairs, n_pairs, qa, da, stream)
        self.run_down(lay, pairs, n_pairs, out, combine, stream)

    def run_tiled(self, where, pairs, tiles, n_tiles, qa, da, out, stream=None) -> None:
        """run() for pairs grouped by expert and cut into tiles (int32 (max_tiles, 2) of (first pair, count <=
        self.tile_p), n_tiles int32 (1,) on the device, as build_pairs makes them): each weight sub-block is decoded
        once per tile (on tensor cores where self.mma). Same bits as run(); for prompt chunks, where an expert has
        several tokens."""
        cp = self.cp
        lay = self._where(where)
        self._check_run_args(pairs, n_tiles)
        if tiles.ndim != 2 or tiles.shape[1] != 2:
            raise ValueError("tiles must be (max_tiles, 2)")
        self._need(tiles, cp.int32, None, "tiles")
        self._need(qa, cp.int8, None, "qa")
        self._need(da, cp.float32, None, "da")
        self._need(out, cp.float32, (self.max_pairs, self.d_model), "out")
        common = (pairs, tiles, n_tiles, np.int32(tiles.shape[0]))
        if self.mma:  # one block an SM, (mma_mt / mma_mpw) x 8 warps
            threads = 32 * 8 * (self.mma_mt // self.mma_mpw)
            gu = (self._k_gum, self.n_sm, threads, self.mma_gu_smem)
            dn = (self._k_dnm, self.n_sm, threads, self.mma_dn_smem)
        else:
            gu = (self._k_gut, 2 * self.n_sm, self.gu_warps * 32, self.gut_smem)
            dn = (self._k_dnt, 2 * self.n_sm, self.dn_warps * 32, self.dn_smem)
        with self._stream(stream):
            launch(gu[0], (gu[1],), (gu[2],), (np.uint64(lay.base), np.int64(lay.stride), np.int64(lay.up_off)) +
                   common + (qa, da, self.gu_tab, self.h, self.qh, self.dh), shared_mem=gu[3])
            launch(dn[0], (dn[1],), (dn[2],), (np.uint64(lay.down), np.int64(lay.down_stride)) + common +
                   (self.qh, self.dh, self.dn_tab, out), shared_mem=dn[3])

    def _check_run_args(self, pairs, n_pairs) -> None:
        cp = self.cp
        self._need(pairs, cp.int32, (self.max_pairs, 2), "pairs")
        self._need(n_pairs, cp.int32, (1,), "n_pairs")

    def combine(self, outputs, weights, out, stream=None) -> None:
        """outputs (T, k, d_model) in router order, weights (T, k) -> out (T, d_model) (canonical.combine)."""
        cp = self.cp
        self._need(outputs, cp.float32, None, "outputs")
        if outputs.ndim != 3:
            raise ValueError("outputs must be (T, k, d)")
        T, K, D = outputs.shape
        self._need(weights, cp.float32, (T, K), "weights")
        self._need(out, cp.float32, (T, D), "out")
        n = T * D
        if n == 0:
            return
        with self._stream(stream):
            launch(self._k_c, ((n + 255) // 256,), (256,), (outputs, weights, out, np.int32(T), np.int32(K), np.int32(D)))


    # ---- routing to sources (the MoE step around run) ------------------------------------------------------
    def build_pairs(self, ids, src, slot, pairs, n_pairs, rowmap, miss_ptr: int, n_miss_ptr: int, max_miss: int,
                    tiles=None, n_tiles=None, stream=None) -> None:
        """ids int32 (T, K) of one layer; src / slot int32 (n_expert,): which source holds each expert (0 = this
        card, s = the s-th peer pool, -1 = none) and its slot there. pairs int32 (S, max_pairs, 2) and n_pairs
        (S,) per source; rowmap int32 (T*K,); miss / n_miss: int32 (max_miss, 2) and (1,) at host-mapped
        addresses (n_miss counts every miss, the list holds the first max_miss);
        tiles int32 (S, max_tiles, 2) and n_tiles (S,): each source's tiles for run_tiled (optional).
        See build_pairs_ref for the contract."""
        cp = self.cp
        self._need(ids, cp.int32, None, "ids")
        n = int(ids.size)
        n_expert, S = self._check_lists(n, src, slot, pairs, n_pairs, rowmap)
        tile_p, max_tiles = 0, 0
        if tiles is not None:
            max_tiles = int(tiles.shape[1])
            self._need(tiles, cp.int32, (S, max_tiles, 2), "tiles")
            self._need(n_tiles, cp.int32, (S,), "n_tiles")
            tile_p = self.tile_p
        with self._stream(stream):
            launch(self._fn("build_pairs"), (1,), (1024,), (ids, np.int32(n), np.int32(ids.shape[-1]), src, slot,
                                                    np.int32(n_expert), np.int32(S), np.int32(self.max_pairs), pairs,
                                                    n_pairs, rowmap, np.uint64(miss_ptr), np.uint64(n_miss_ptr),
                                                    np.int32(max_miss), np.int32(tile_p), tiles if tiles is not None else np.uint64(0),
                                                    n_tiles if n_tiles is not None else np.uint64(0),
                                                    np.int32(max_tiles)),
                                    shared_mem=12 * n_expert)

    def _check_lists(self, n: int, src, slot, pairs, n_pairs, rowmap) -> tuple[int, int]:
        """The buffers of n routed entries' pair lists (build_pairs' contract): (n_expert, sources)."""
        cp = self.cp
        n_expert = int(src.shape[0])
        self._need(src, cp.int32, (n_expert,), "src")
        self._need(slot, cp.int32, (n_expert,), "slot")
        S = int(pairs.shape[0])
        if not 1 <= S <= MAX_SOURCES:
            raise ValueError(f"1 to {MAX_SOURCES} sources")
        self._need(pairs, cp.int32, (S, self.max_pairs, 2), "pairs")
        self._need(n_pairs, cp.int32, (S,), "n_pairs")
        if n > self.max_pairs:
            raise ValueError(f"{n} routed entries > max_pairs {self.max_pairs}")
        self._need(rowmap, cp.int32, None, "rowmap")
        if rowmap.size < n:
            raise ValueError("rowmap too small")
        return n_expert, S

    def route_pairs(self, logits, k: int, ids, wts, src, slot, pairs, n_pairs, rowmap, miss_ptr: int,
                    n_miss_ptr: int, max_miss: int, by_weight: bool = False, stream=None) -> None:
        """A decode step's router and pair lists in one launch: logits float32 (1, n_expert) -> ids int32 (1, k)
        and weights float32 (1, k) with router.route's bits, then build_pairs' lists for those k entries (no tiles;
        by_weight: each source's list in router order, the likeliest first, instead of by expert)."""
        cp = self.cp
        n_expert = int(src.shape[0])
        if not 1 <= k <= min(32, n_expert) or n_expert > 1024:
            raise ValueError("route_pairs supports n_expert <= 1024 and k <= min(32, n_expert)")
        self._need(logits, cp.float32, (1, n_expert), "logits")
        self._need(ids, cp.int32, (1, k), "ids")
        self._need(wts, cp.float32, (1, k), "wts")
        _, S = self._check_lists(k, src, slot, pairs, n_pairs, rowmap)
        with self._stream(stream):
            launch(self._fn("route_pairs"), (1,), (32,), (logits, np.int32(n_expert), np.int32(k), ids, wts, src, slot,
                                                        np.int32(S), np.int32(self.max_pairs), pairs, n_pairs, rowmap,
                                                        np.uint64(miss_ptr), np.uint64(n_miss_ptr), np.int32(max_miss),
                                                        np.int32(by_weight)))

    def combine_rows(self, rows, host_rows_ptr: int, rowmap, w, x, stream=None) -> None:
        """x (T, d_model) += router-order sum of w[t, j] * row(rowmap[t*K + j]) (see combine_rows_ref)."""
        cp = self.cp
        self._need(rows, cp.float32, None, "rows")
        T, K = w.shape
        self._need(w, cp.float32, (T, K), "w")
        self._need(x, cp.float32, (T, self.d_model), "x")
        self._need(rowmap, cp.int32, None, "rowmap")
        n = T * self.d_model
        with self._stream(stream):
            launch(self._fn("combine_rows"), ((n + 255) // 256,), (256,),
                                     (rows, np.uint64(host_rows_ptr), rowmap, w, x, np.int32(T), np.int32(K),
                                      np.int32(self.d_model)))

    def ring(self, counter, bell_ptr: int, stream=None) -> None:
        """*bell = ++*counter once everything before it in the stream is done (counter: device uint32 (1,))."""
        with self._stream(stream):
            launch(self._fn("ring"), (1,), (1,), (counter, np.uint64(bell_ptr)))

    def _fn(self, name: str):
        f = self._extra.get(name)
        if f is None:
            f = self._extra[name] = self.module.get_function(name)
        return f


MAX_SOURCES = 8  # expert_pairs.cuh's MAX_SOURCES
TILE_P = Tuning.tile_p  # the default simt tile (experts.cu's TILE_P is the tuning's)


def mma_smem(qt, kin: int, gate_up: bool, mt: int = 4) -> int:
    """Shared bytes of a tensor-core tile kernel of mt m-tiles (16 pairs each) a tile (mirror of experts_mma.cuh's
    MmaGeom)."""
    nsub, rb, m = kin // 32, fmt(qt).row_bytes(kin), 16 * mt
    chb = (32 * rb + 14 + 15) // 16 * 16 + 16
    fin = m * 65 * 4
    wreg = fin if gate_up and fin > 2 * chb else 2 * chb
    return table_bytes(qt, 0) + m * (kin + 16) + m * (nsub + 4) * 4 + wreg


def leaf_fold_ref(terms: np.ndarray) -> np.ndarray:
    """canonical.lane_sum in experts_mma.cuh's order: the lanes' leaves (0.0f + terms l, l + 32, ...) taken in
    bit-reversed lane order and merged as a binary counter, which rebuilds the lane fold's tree (same bits)."""
    t = np.asarray(terms, np.float32)
    nsub = t.shape[-1]
    leaves = np.zeros(t.shape[:-1] + (32,), np.float32)
    for s in range(-(-nsub // 32) * 32):
        leaves[..., s % 32] = leaves[..., s % 32] + (t[..., s] if s < nsub else np.float32(0))
    stack = [None] * 5
    x = None
    for j in range(32):
        x = leaves[..., int(f"{j:05b}"[::-1], 2)]
        for b in range(5):
            if (j >> b) & 1:
                x = stack[b] + x
            else:
                stack[b] = x
                break
    return x


def max_tiles(max_pairs: int, n_expert: int, tile_p: int = TILE_P) -> int:
    """Tiles build_pairs can make from max_pairs pairs over n_expert experts (each expert's last tile may be short)."""
    return -(-max_pairs // tile_p) + n_expert


def tiles_ref(experts: np.ndarray, max_tiles: int, tile_p: int = TILE_P) -> tuple[np.ndarray, int]:
    """build_pairs' tiles of a pair list grouped by expert (experts: each pair's expert or slot, in list order):
    (first pair, count <= tile_p) for each run of equal values, cut every tile_p pairs, -1 rows after; and their
    number."""
    tiles, i, n = [], 0, len(experts)
    while i < n:
        j = i
        while j < n and experts[j] == experts[i] and j - i < tile_p:
            j += 1
        tiles.append((i, j - i))
        i = j
    out = np.full((max_tiles, 2), -1, np.int32)
    out[:len(tiles)] = tiles
    return out, len(tiles)


def build_pairs_ref(ids: np.ndarray, src: np.ndarray, slot: np.ndarray) -> list[tuple[int, int, int]]:
    """Where each routed entry of ids (T, K) is computed, in entry order: (source, token, slot) for a card or
    peer (source >= 0), (-1, token, expert) for the CPU pool. The kernel's pair lists and miss list hold exactly
    these, each source's pairs grouped by expert in ascending expert order (order within an expert is free), and
    its row map sends entry i to the row of its own pair."""
    K = ids.shape[-1]
    out = []
    for i, e in enumerate(np.asarray(ids).reshape(-1)):
        s = int(src[e]) if 0 <= e < len(src) else -1
        out.append((s, i // K, int(slot[e])) if s >= 0 else (-1, i // K, int(e)))
    return out


def combine_rows_ref(x: np.ndarray, w: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
    """x + canonical.combine(w, outputs) with outputs[t, j] = rows[t * K + j] (each a d_model row)."""
    T, K = w.shape
    return x + canonical.combine(w, np.stack(rows).reshape(T, K, -1))


def check_model(model, tuning: Tuning | None = None,
                smem: tuple[int, int] = (H200_SMEM_BLOCK, H200_SMEM_SM)) -> None:
    """Whether the expert kernels take every layer of the model (its types and shape; any type with any down
    type), planned on the host: a GPU card checks this before it allocates anything, so a model it cannot run
    fails with one error naming the layers instead of starting half-loaded. smem: the card's shared memory (a
    block's opt-in, an SM's; default: an H200's), as ExpertKernels plans from it."""
    c = model.config
    plans: dict[tuple, list[int]] = {}
    for layer in range(c.n_layer):
        gate, up, down = (model.expert_type(layer, k) for k in ("gate", "up", "down"))
        if up != gate:  # every file llama.cpp writes has them equal; the kernels read both rows as one type
            raise ValueError(f"layer {layer}: gate experts are {gate.name} and up experts {up.name}; the GPU "
                             f"expert kernels need gate and up of one type (any type, any down type)")
        plans.setdefault((gate, down), []).append(layer)
    for (gate, down), layers in plans.items():
        try:
            ExpertKernels.planned(c.d_model, c.d_ff_expert, gate, down, tuning, smem=smem)
        except ValueError as e:
            raise ValueError(f"the GPU expert kernels cannot take layers {layers[0]}..{layers[-1]} ({len(layers)} "
                             f"layers: {gate.name} gate / up, {down.name} down, d_model {c.d_model}, expert width "
                             f"{c.d_ff_expert}): {e}; CPU cards run every model") from None
