"""A dense GGUF matrix on the device (the rows as the file holds them) and its mat-vec launch plan.

The mat-vec reads F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K and IQ3_S rows as the file holds them (matvec.cuh's
fast bodies; the last four decoded a lane's 8 values at a time by decode.cuh's rq_part); every other quantised type is
packed once at upload into int8 codes with float32 scales (`PackedRows`, decode.cuh rq_pack: the same values,
1.125-1.5 bytes a weight) that the same block ring reads, and only rows neither can take go through decode.cuh's
per-type mat-vec. decode.cuh also makes the float16 copy a prompt chunk's cuBLAS GEMM reads
(`DenseWeight.dequantized`) and the embedding's rows, from the file's rows. A file's q, k and v of different types
(llama.cpp's mixes give attn_v its own) stack as a `StackedWeight`: two file types of FILE_PAIRS in one launch
(norm_matvec), else packed alike (one launch) where all are quantised, else a launch a part.

File rows of Q4_K / Q5_K / Q6_K / IQ3_S can be packed later too (`to_packed`): a card does so for a layer's matrices
where it has the memory (lane/cupy_card.py), since their decode steps run faster packed (a layer's mat-vecs are
bound by the decode's instructions and fixed costs, not by bytes; docs/perf-notes.md, session 25).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from stratad.model import quants

from .decode_tables import device_tables
from .device import FAST, FILE_BLK, QNAME, dense_qtype, module, need, on_stream
from .launch import launch

# (rows per warp, warps per row group). With KS > 1 and R > 1 a warp reads its K slice of x once for R rows: the
# activation's shared-memory / L1 traffic (4 bytes a weight at R = 1, against 1 byte of weights) falls by R.
PLANS = ((4, 1), (2, 1), (1, 1), (1, 2), (1, 4), (1, 8), (4, 2), (4, 4), (2, 2), (2, 4))
# the plans of the decode.cuh mat-vecs (matvec.cu MV_DQ_PLANS)
DQ_PLANS = ((2, 1), (1, 1), (1, 2), (1, 4), (1, 8))
# Packed rows (decode.cuh rq_pack, matvec.cuh RqBlk): (scales, minimums) a 32-value block, by type: one scale, or one
# a 16-value half for the types whose integer scales cover 16 values; a minimum a scale for the types with one
RQ_FORMATS = {T.Q2_K: (2, 2), T.Q3_K: (2, 0), T.Q6_K: (2, 0), T.IQ2_XS: (2, 0), T.IQ2_S: (2, 0), T.IQ1_M: (2, 0),
              T.Q4_1: (1, 1), T.Q5_1: (1, 1), T.Q4_K: (1, 1), T.Q5_K: (1, 1)}
# the file rows to_packed packs: the types decoded a lane's 8 values at a time (decode.cuh RQ_PART_TYPES)
FILE_PARTS = tuple(t for t in FILE_BLK if t != T.Q8_0)

# the pairs of file types one norm_matvec launch takes (matvec.cu NORM_MV_PAIR): llama.cpp's IQ3_S q and k with
# a Q4_K attn_v (iq3_s, iq3_m), Q4_K or Q5_K with a Q6_K attn_v (q4_k_m's and q5_k_m's more-bits layers)
FILE_PAIRS = ((T.IQ3_S, T.Q4_K), (T.Q4_K, T.Q6_K), (T.Q5_K, T.Q6_K))
PAIR_PLANS = ((2, 1), (1, 1), (1, 2), (2, 2))
# the file types matvec takes on 8-bit x (qx; matvec.cu's matvec_<type>x): block formats without a minimum; IQ3_S
# packed too (matvec_rq10x, the same numbers)
QX_TYPES = (T.Q8_0, T.IQ3_S)
NORM_MV_MAX_N = 4096  # the row a norm_matvec stages in shared memory, floats (matvec.cuh)


def ring_smem(tile: int, ring: int, norm_ring: int, norm: bool) -> int:
    """Dynamic shared memory of a block-ring mat-vec (matvec.cuh BlkGeom): 8 warps of ring stages of a tile's bytes
    (from the 16-byte boundary below it) a row; norm: beside the staged row of NORM_MV_MAX_N floats. A plain launch
    may stage x (rows of at most NORM_MV_MAX_N columns), so it gets the larger of the two."""
    slot = (tile + tile % 16 + 15) // 16 * 16
    staged = 8 * norm_ring * slot + 4 * NORM_MV_MAX_N
    return staged if norm else max(8 * ring * slot, staged)


# the table a file type's mat-vec stages after its ring (decode.cuh RqTab: IQ3_S's grid)
FILE_TAB_BYTES = {T.IQ3_S: 512 * 4}


def blk_smem(qtype, norm: bool) -> int:
    """ring_smem of a file block type's rows (Q8_0: 8 / 6 stages of 1088 bytes; FileBlk: 8 / 6 of 32 sub-blocks),
    and its table."""
    qt = dense_qtype(qtype)
    f = quants.fmt(qt)
    return ring_smem(32 * 32 // f.block_values * f.block_bytes, 8, 6, norm) + FILE_TAB_BYTES.get(qt, 0)


def rq_format(qtype) -> tuple[int, int]:
    """(scales, minimums) of a quantised type's packed blocks (RQ_FORMATS, else (1, 0))."""
    return RQ_FORMATS.get(dense_qtype(qtype), (1, 0))


def rq_widest(fmts) -> tuple[int, int]:
    """The packed format that holds every one of fmts (matvec.cu builds (1, 0), (1, 1), (2, 0) and (2, 2): two scales
    with a minimum take one a scale)."""
    ns, nm = max(f[0] for f in fmts), max(f[1] for f in fmts)
    return (ns, ns if nm else 0)


def rq_block_bytes(fmt: tuple[int, int]) -> int:
    return 32 + 4 * (fmt[0] + fmt[1])


def rq_smem(fmt: tuple[int, int], norm: bool) -> int:
    """ring_smem of packed rows (matvec.cuh RqBlk: Q8_0's ring bytes or less)."""
    bb = rq_block_bytes(fmt)
    return ring_smem(32 * bb, 8 * 34 // bb, 6 * 34 // bb, norm)


class PackedRows:
    """A quantised matrix's rows packed for the mat-vec (decode.cuh rq_pack) in format fmt = (scales, minimums):
    cols / 32 blocks of rq_block_bytes(fmt) a row, made on the device from the file's rows (pack) or stacked."""

    def __init__(self, data, fmt: tuple[int, int], cols: int):
        self.data, self.fmt, self.cols = data, tuple(fmt), int(cols)
        self.rows = int(data.shape[0])
        self.row_bytes = int(data.shape[1])
        self.name = f"rq{fmt[0]}{fmt[1]}"

    @classmethod
    def pack(cls, W: "DenseWeight", fmt: tuple[int, int] | None = None) -> "PackedRows":
        """W's rows packed in fmt (default: its type's; a wider one holds the same values)."""
        import cupy

        own = rq_format(W.qtype)
        fmt = own if fmt is None else tuple(fmt)
        if fmt[0] < own[0] or fmt[1] < own[1]:
            raise ValueError(f"{W.qtype.name} packs into (scales, minimums) >= {own}, not {fmt}")
        nsub = W.cols // 32
        out = cupy.empty((W.rows, nsub * rq_block_bytes(fmt)), cupy.uint8)
        n = W.rows * nsub
        launch(module("matvec.cu").fn(f"pack_rows_{W.name}"), ((n + 255) // 256,), (256,),
               (W.data, np.int32(W.rows), np.int32(nsub), np.int64(W.row_bytes), W.tab, np.int32(fmt[0]),
                np.int32(fmt[1]), out))
        return cls(out, fmt, W.cols)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def plan(self) -> tuple[int, int]:
        return rq_plan(self.rows, self.cols)


def packable(W) -> bool:
    """Whether the mat-vec reads W packed: a quantised type off the fast paths (or rows they decline) in whole
    256-value groups (the ring's 16-byte chunks and Q8_0's alignment rule)."""
    return quants.fmt(W.qtype).quantised and W.cols % 256 == 0


class DenseWeight:
    """A dense GGUF matrix on the device: rows x row_bytes raw bytes (cupy uint8), its type and column count."""

    def __init__(self, data, qtype, cols: int, *, pack: bool = True):
        import cupy

        self.qtype = dense_qtype(qtype)
        self.cols = int(cols)
        self.row_bytes = quants.fmt(self.qtype).row_bytes(self.cols)
        if not isinstance(data, cupy.ndarray):
            raise TypeError("data must be a cupy array (use DenseWeight.upload for host data)")
        data = data.view(cupy.uint8).reshape(-1, self.row_bytes)
        need(data, np.uint8, None, "data", align=1)
        self.data = data
        self.rows = int(data.shape[0])
        granule = 256 if self.qtype in FILE_BLK else 1
        self.fast = (self.qtype in FAST and self.row_bytes % 16 == 0 and data.data.ptr % 16 == 0
                     and self.cols % granule == 0)
        self.tab = device_tables()  # decode.cuh's tables on this device (uploaded now, never during a capture)
        self._cache = None  # the float16 copy, once dequantized(cache=True) made it
        # what the mat-vec reads for rows off the fast paths: packed now (never during a capture) unless pack=False
        self.packed = PackedRows.pack(self) if pack and not self.fast and packable(self) else None
        self.repacked = False  # fast rows packed later (to_packed)

    @classmethod
    def upload(cls, raw: np.ndarray, qtype, cols: int | None = None, *, pack: bool = True) -> "DenseWeight":
        """From host rows: uint8 (rows, row_bytes) as ModelFile.raw gives them (or a float array of the type).
        pack=False: rows no mat-vec reads (the embedding table), kept only as the file holds them."""
        import cupy

        qt = dense_qtype(qtype)
        u8 = np.ascontiguousarray(raw).view(np.uint8)
        u8 = u8.reshape(u8.shape[0] if u8.ndim > 1 else 1, -1)
        if cols is None:
            f = quants.fmt(qt)
            cols = u8.shape[1] // f.block_bytes * f.block_values
        return cls(cupy.asarray(u8), qt, cols, pack=pack)

    @classmethod
    def concat(cls, ws: list["DenseWeight"]) -> "DenseWeight | StackedWeight":
        """Rows of several matrices of one width, stacked (e.g. q, k, v): one launch where they share a type, else a
        StackedWeight (a launch a part)."""
        import cupy

        if len({w.cols for w in ws}) != 1:
            raise ValueError(f"concat needs matrices of one column count (got {sorted({w.cols for w in ws})})")
        if len({w.qtype for w in ws}) != 1:
            return StackedWeight(ws)
        return cls(cupy.concatenate([w.data for w in ws], axis=0), ws[0].qtype, ws[0].cols,
                   pack=all(w.packed is not None for w in ws))

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def takes_qx(self) -> bool:
        """Whether matvec takes this weight on 8-bit x (qx): fast rows of QX_TYPES, and such rows packed later
        (to_packed: they keep their 8-bit x path, the same bits)."""
        return self.qtype in QX_TYPES and (self.fast or self.repacked)

    @property
    def name(self) -> str:
        """The type's kernel suffix (decode.cuh's type lists)."""
        return QNAME[self.qtype]

    def plan(self) -> tuple[int, int]:
        """(R, KS): rows per warp, warps splitting a row group's K. Enough warps for the GPU, R=4 for tall ones."""
        if self.fast:
            return default_plan(self.qtype, self.rows, self.cols)
        if self.packed is not None:
            return self.packed.plan()
        return dq_plan(self.rows, self.cols // dq_span(self.qtype))

    def dequantized(self, *, cache: bool = True, stream=None):
        """Dense (rows, cols) float16 copy (gemm.py's cuBLAS operand); cache=True keeps it on this weight."""
        if self._cache is not None:
            return self._cache
        out = module("gemm.cu").cp.empty((self.rows, self.cols), np.float16)
        self.dequantize_into(out, stream)
        if cache:
            self._cache = out
        return out

    def dequantize_into(self, out, stream=None) -> None:
        """out (rows, cols) float16 (a C-contiguous cupy array) = the rows' values rounded to float16."""
        m = module("gemm.cu")
        need(out, np.float16, (self.rows, self.cols), "out", align=16)
        g = max(8, dq_span(self.qtype))  # values a thread (gemm.cu dequant_rows_body)
        if self.cols % g:
            raise ValueError(f"dequantized() needs cols % {g} == 0 for {self.qtype.name} (got {self.cols})")
        n = self.rows * (self.cols // g)
        with on_stream(stream):
            launch(m.fn(f"dequant_rows_{self.name}"), ((n + 255) // 256,), (256,),
                   (self.data, np.int32(self.rows), np.int32(self.cols), np.int64(self.row_bytes), self.tab, out,
                    np.int32(1)))  # 1: GGML's F16 type code

    def drop_cache(self) -> None:
        self._cache = None

    def to_packed(self, dry: bool = False) -> int:
        """Pack these rows if they are file rows of FILE_PARTS (the mat-vec reads the packed rows from then on, on
        the same numbers); dry: only say. Returns the bytes packing adds (the file's rows stay: the float16 copy is
        made from them), 0 where there is nothing to pack."""
        if not (self.fast and self.qtype in FILE_PARTS and packable(self)):
            return 0
        fmt = rq_format(self.qtype)
        if not dry:
            self.packed, self.fast, self.repacked = PackedRows.pack(self, fmt), False, True
        return self.rows * (self.cols // 32) * rq_block_bytes(fmt)


class StackedWeight:
    """Rows of matrices of one width and different types (q, k, v of a llama.cpp mix), stacked: the ops launch a
    part at a time into consecutive output rows (matvec) or fill one float16 copy part by part (dequantized).
    Consecutive parts of one type are one part. Two parts of a FILE_PAIRS pair read as the file holds them are a
    `pair`: norm_matvec takes both in one launch."""

    fast = False
    takes_qx = False

    def __init__(self, parts: list[DenseWeight]):
        if len({p.cols for p in parts}) != 1:
            raise ValueError("stacked matrices need one column count")
        runs: list[list[DenseWeight]] = []
        for p in parts:
            if runs and runs[-1][0].qtype == p.qtype:
                runs[-1].append(p)
            else:
                runs.append([p])
        self.parts = [r[0] if len(r) == 1 else DenseWeight.concat(r) for r in runs]
        self.cols = parts[0].cols
        self.rows = sum(p.rows for p in parts)
        self._cache = None
        self.pair = (len(self.parts) == 2 and all(p.fast for p in self.parts)
                     and tuple(p.qtype for p in self.parts) in FILE_PAIRS)
        # else all quantised: packed alike (the widest format of the parts), one mat-vec launch; the parts' own dropped
        self.packed = None
        if not self.pair and all(p.packed is not None or (p.fast and packable(p)) for p in self.parts):
            self._pack_alike()

    def _pack_alike(self) -> None:
        import cupy

        fmt = self._alike_format()
        self.packed = PackedRows(cupy.concatenate([PackedRows.pack(p, fmt).data for p in self.parts], axis=0),
                                 fmt, self.cols)
        for p in self.parts:
            p.packed = None

    def _alike_format(self) -> tuple[int, int]:
        return rq_widest([rq_format(p.qtype) for p in self.parts])

    def to_packed(self, dry: bool = False) -> int:
        """A pair packed alike (DenseWeight.to_packed): one norm_matvec launch on the packed rows."""
        if not self.pair or not all(packable(p) for p in self.parts):
            return 0
        if not dry:
            self._pack_alike()
            self.pair = False
        return self.rows * (self.cols // 32) * rq_block_bytes(self._alike_format())

    def plan(self) -> tuple[int, int]:
        """A pair's (from PAIR_PLANS) or the packed rows' plan."""
        if self.pair:
            return pair_plan(self.rows, self.cols)
        if self.packed is None:
            raise ValueError("a stack of float and quantised parts runs each part with its own plan")
        return self.packed.plan()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def row_slices(self):
        """(part, first row) of each part."""
        r0 = 0
        for p in self.parts:
            yield p, r0
            r0 += p.rows

    def dequantized(self, *, cache: bool = True, stream=None):
        if self._cache is not None:
            return self._cache
        out = module("gemm.cu").cp.empty((self.rows, self.cols), np.float16)
        for p, r0 in self.row_slices():
            p.dequantize_into(out[r0:r0 + p.rows], stream)
        if cache:
            self._cache = out
        return out

    def drop_cache(self) -> None:
        self._cache = None


def dq_span(qtype) -> int:
    """Values a decode.cuh span covers: a sub-block of 32 for the quantised types, one value of a float type."""
    return 32 if quants.fmt(qtype).quantised else 1


def dq_plan(rows: int, nspan: int) -> tuple[int, int]:
    """A decode.cuh mat-vec's plan (from DQ_PLANS) for rows of nspan spans: two rows a warp for tall matrices, else
    one, with K split over up to 8 warps while the GPU has fewer than ~4096 warps and each lane keeps a span."""
    target = 4096
    if rows // 2 >= target:
        return (2, 1)
    ks = 1
    while ks < 8 and rows * ks < target and 2 * ks * 32 <= nspan:
        ks *= 2
    return (1, ks)


def rq_plan(rows: int, cols: int) -> tuple[int, int]:
    """A packed mat-vec's plan (from PLANS, at most two rows a warp: the larger blocks leave a smaller ring): Q8_0's
    measured choices otherwise (default_plan)."""
    ntiles = -(-(cols // 32) // 32)
    if rows >= 4096:
        return (2, 1)
    if rows >= 1024:
        return (2, 2) if ntiles >= 2 else (1, 1)
    return (1, 2)


def pair_plan(rows: int, cols: int) -> tuple[int, int]:
    """A pair's norm_matvec plan (PAIR_PLANS): the packed stack's choice (rq_plan), which it replaces."""
    return rq_plan(rows, cols)


def default_plan(qtype, rows: int, cols: int) -> tuple[int, int]:
    """The mat-vec plan of a (rows, cols) matrix of this type: a fast path's (PLANS) for the FAST types, decode.cuh's
    (DQ_PLANS) for the other types."""
    qt = dense_qtype(qtype)
    f = quants.fmt(qt)
    if qt not in FAST:
        return dq_plan(rows, cols // dq_span(qt))
    if qt in FILE_PARTS and rows < 16384:  # a layer's: the packed rows' plan, so to_packed keeps the bits
        return rq_plan(rows, cols)
    if qt in FILE_BLK:
        ntiles = -(-(cols // 32) // 32)
    else:
        ntiles = -(-(f.row_bytes(cols) // 16) // 32)
    target = 4096  # warps: ~31 per SM on 132 SMs
    if qt in FILE_BLK:  # measured on the H200 with Q8_0 rows, each a3b shape's best (docs/perf-notes.md, the plan sweep)
        if rows >= 16384:
            return (4, 1)
        if rows >= 4096:
            return (2, 1)
        if rows >= 1024:  # o (2048 x 4096): four rows a warp, each row's tiles over four warps
            return (4, 4) if ntiles >= 4 else (1, 1)
        return (1, 2)
    for R in (4, 2):
        if rows // R >= target:
            return (R, 1)
    ks = 1
    while ks < 8 and rows * ks < target and 2 * ks <= ntiles:
        ks *= 2
    return (1, ks)
