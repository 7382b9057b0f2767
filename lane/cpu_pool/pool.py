"""The pool's Python side: a layer's jobs (LayerJobs), their checks, and CpuPool, which runs them."""

import threading
import weakref
from dataclasses import dataclass

import numpy as np

from stratad.model.quants import SUB, fmt
from lane.cpu_pool.tables import F16E, F32, GRID, POW2, TAB, _SUPPORTED
from lane.cpu_pool.layer_call import _act_sums, _group, _layer_parallel


@dataclass
class LayerJobs:
    """One layer's CPU share: the layer's expert tensors and the (token, expert) pairs to compute.

    gate, up: uint8 (n_expert, d_ff, row_bytes); down: uint8 (n_expert, d_model, row_bytes) — the GGUF bytes as
    they are (ModelFile.raw(f"blk.{layer}.ffn_gate_exps.weight"), or the arena's view of the same bytes).
    gate_type / up_type / down_type: GGML type codes (any of quants.EXPERT_TYPES; each may differ).
    pairs: int32 (n_pairs, 2) of (token, expert); qa int8 (n_tok, d_model / 32, 32), da float32 (n_tok,
    d_model / 32): the tokens' activations quantised by canonical.quantize_act.
    """

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    gate_type: int
    up_type: int
    down_type: int
    pairs: np.ndarray
    qa: np.ndarray
    da: np.ndarray

    @classmethod
    def from_model(cls, model, layer: int, pairs, qa, da) -> "LayerJobs":
        return cls(*_layer_tensors(model, layer), np.asarray(pairs, np.int32).reshape(-1, 2), qa, da)


_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> layer -> its expert tensors


def _layer_tensors(model, layer: int) -> tuple:
    """(gate, up, down, their type codes) of a layer, made once per model: plain ndarray views of the mapping (a
    np.memmap slice costs tens of microseconds, and the same objects let CpuPool reuse its checks)."""
    per_model = _LAYERS.setdefault(model, {})
    t = per_model.get(layer)
    if t is None:
        kinds = ("gate", "up", "down")
        t = per_model[layer] = (*(model.raw(f"blk.{layer}.ffn_{k}_exps.weight").view(np.ndarray) for k in kinds),
                                *(int(model.expert_type(layer, k)) for k in kinds))
    return t


def _check_tensors(jobs: LayerJobs) -> None:
    """Shapes and types of the weights: the kernels do no bounds checks, so everything they touch is verified."""
    for name in ("gate", "up", "down"):
        if getattr(jobs, name).ndim != 3:
            raise ValueError(f"{name}: expected (n_expert, rows, row_bytes), got shape {getattr(jobs, name).shape}")
    ne, d_ff, _ = jobs.gate.shape
    _, d_model, _ = jobs.down.shape
    for name, arr, rows, n, t in (("gate", jobs.gate, d_ff, d_model, jobs.gate_type),
                                  ("up", jobs.up, d_ff, d_model, jobs.up_type),
                                  ("down", jobs.down, d_model, d_ff, jobs.down_type)):
        if t not in _SUPPORTED:
            raise ValueError(f"{name}: unsupported expert type {t}")
        if not fmt(t).quantised and arr.dtype != np.uint8 and arr.flags.c_contiguous:
            arr = arr.view(np.uint8)  # float experts as the reader gives them (float / bf16 as uint16): their bytes
        if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[0] != ne or arr.shape[1] != rows:
            raise ValueError(f"{name}: expected uint8 ({ne}, {rows}, row_bytes), got {arr.dtype} {arr.shape}")
        if arr.shape[2] != fmt(t).row_bytes(n):
            raise ValueError(f"{name}: row of {arr.shape[2]} bytes is not {n} values of type {t}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous")


def _check_inputs(jobs: LayerJobs, d_model: int) -> None:
    """The activations and the pair list (token and expert indices are checked while grouping, in _group)."""
    if jobs.qa.dtype != np.int8 or jobs.qa.shape[1:] != (d_model // SUB, SUB):
        raise ValueError(f"qa: expected int8 (n_tok, {d_model // SUB}, {SUB}), got {jobs.qa.dtype} {jobs.qa.shape}")
    if jobs.da.dtype != np.float32 or jobs.da.shape != jobs.qa.shape[:2]:
        raise ValueError(f"da: expected float32 {jobs.qa.shape[:2]}, got {jobs.da.dtype} {jobs.da.shape}")
    p = np.asarray(jobs.pairs)
    if p.ndim != 2 or p.shape[1] != 2 or p.dtype.kind not in "iu":
        raise ValueError(f"pairs: expected integer (n_pairs, 2), got {p.dtype} {p.shape}")


_PRANGE_LOCK = threading.Lock()


def _flat_readonly(x: np.ndarray) -> np.ndarray:
    """A flat read-only ndarray view of weight bytes (np.asarray turns a np.memmap into a plain ndarray; float
    experts come as their floats), so that the kernels see one array type (one compiled specialisation) for file
    mappings, arenas and test arrays."""
    v = np.asarray(x).reshape(-1).view(np.uint8)
    v.setflags(write=False)
    return v


class CpuPool:
    """Computes experts on `threads` OS threads: one numba parallel call per layer on numba's own thread pool;
    inside it `threads` workers take units of CHUNK rows from a shared atomic ticket counter, for gate/up + SwiGLU,
    then quantise h, then down (so a core that is busy elsewhere just takes fewer units). numba's default threading
    layer must not be entered from two Python threads at once, so calls are serialised on a module-wide lock.
    Every output element is computed by the same sequential code whichever worker computes it."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError("threads must be >= 1")
        import numba

        self.threads = min(threads, numba.config.NUMBA_NUM_THREADS)
        self._checked: dict[tuple, tuple] = {}

    def close(self) -> None:
        self._checked.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _weights(self, jobs: LayerJobs) -> tuple:
        """The layer's weights checked and flattened, once per set of tensor objects (LayerJobs.from_model hands
        out the same ones every call): (gate, up, down flat read-only, d_ff, d_model)."""
        key = (id(jobs.gate), id(jobs.up), id(jobs.down), jobs.gate_type, jobs.up_type, jobs.down_type)
        hit = self._checked.get(key)
        if hit is None:
            _check_tensors(jobs)
            if len(self._checked) >= 1024:  # callers that pass new arrays each time
                self._checked.clear()
            hit = self._checked[key] = ((jobs.gate, jobs.up, jobs.down),  # kept alive: the ids stay theirs
                                        tuple(_flat_readonly(x) for x in (jobs.gate, jobs.up, jobs.down)),
                                        jobs.gate.shape[1], jobs.down.shape[1])
        return (*hit[1], hit[2], hit[3])

    def run(self, jobs: LayerJobs, out: np.ndarray | None = None) -> np.ndarray:
        """float32 (n_pairs, d_model): canonical.expert of each (token, expert) pair, in the pairs' order (into
        out, a C-contiguous float32 (n_pairs, d_model) array, when given: e.g. pinned memory a GPU reads)."""
        gate, up, down, d_ff, d_model = self._weights(jobs)
        _check_inputs(jobs, d_model)
        pairs = np.ascontiguousarray(jobs.pairs, np.int32)
        n_pairs = pairs.shape[0]
        if out is None:
            out = np.empty((n_pairs, d_model), F32)
        elif out.dtype != F32 or out.shape != (n_pairs, d_model) or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32 ({n_pairs}, {d_model})")
        if n_pairs == 0:
            return out
        # group the pairs by expert (each weight row is then read once for all its tokens)
        qa = np.ascontiguousarray(jobs.qa).reshape(-1)
        da = np.ascontiguousarray(jobs.da).reshape(-1)
        asum = np.empty(da.shape, F32)
        _act_sums(qa, asum)
        import numba

        gpairs, gstart, gexp = np.empty(n_pairs, np.int64), np.empty(n_pairs + 1, np.int64), np.empty(n_pairs, np.int64)
        ngrp, maxg = _group(pairs, jobs.gate.shape[0], jobs.qa.shape[0], gpairs, gstart, gexp)
        if ngrp < 0:
            raise ValueError("pairs: token or expert index out of range")
        gstart, gexp = gstart[:ngrp + 1], gexp[:ngrp]
        pair_tok = pairs[:, 0].astype(np.int64)
        h = np.empty(n_pairs * d_ff, F32)
        qh = np.empty(n_pairs * d_ff, np.int8)
        dh = np.empty(n_pairs * d_ff // SUB, F32)
        hsum = np.empty(n_pairs * d_ff // SUB, F32)
        tg, tu, td = int(jobs.gate_type), int(jobs.up_type), int(jobs.down_type)
        rb_g, rb_u, rb_d = fmt(tg).row_bytes(d_model), fmt(tu).row_bytes(d_model), fmt(td).row_bytes(d_ff)
        flat = out.reshape(-1)
        with _PRANGE_LOCK:
            numba.set_num_threads(self.threads)
            _layer_parallel(self.threads, np.zeros(16, np.int64), tg, tu, td, gate, up, down, d_ff, d_model,
                            rb_g, rb_u, rb_d, qa, da, asum, pair_tok, gstart, gpairs, gexp, maxg, h, qh, dh, hsum,
                            flat, F16E, POW2, GRID, TAB)
        return out
