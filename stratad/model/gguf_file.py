"""Open a qwen3moe GGUF: memory-mapped, validated, with a typed config and raw tensor views.

Tensor bytes are never read whole into RAM: `ModelFile.raw(name)` is a view of the mapping (a split model's
shards mapped into one range: mapping.py, split.py). Layout and names are llama.cpp's, so a real Qwen3-30B-A3B /
235B-A22B GGUF opens unchanged, in one file or in shards. Shapes below are numpy order
(the reverse of GGUF's ne order): experts are one 3-D tensor per layer, (n_expert, rows, cols).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, LlamaFileType

from stratad.model import quants, split
from stratad.model.config import ARCH, ModelConfig
from stratad.model.errors import ModelFormatError
from stratad.model.mapping import map_files
from stratad.model.metadata import metadata
from stratad.model.rope import RopeScaling

GGUF_MAGIC = b"GGUF"
NORM_TYPES = (T.F32, T.F16, T.BF16)
HASH_SAMPLE = 4096


def expected_tensors(c: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[T, ...]]]:
    """name -> (numpy shape in values, allowed types). output.weight may be absent (tied to token_embd)."""
    d, E = c.d_model, c.n_expert
    out = {
        "token_embd.weight": ((c.vocab_size, d), quants.DENSE_TYPES),
        "output_norm.weight": ((d,), NORM_TYPES),
        "output.weight": ((c.vocab_size, d), quants.DENSE_TYPES),
    }
    for i in range(c.n_layer):
        b = f"blk.{i}."
        out |= {
            b + "attn_norm.weight": ((d,), NORM_TYPES),
            b + "attn_q.weight": ((c.q_dim, d), quants.DENSE_TYPES),
            b + "attn_k.weight": ((c.kv_dim, d), quants.DENSE_TYPES),
            b + "attn_v.weight": ((c.kv_dim, d), quants.DENSE_TYPES),
            b + "attn_output.weight": ((d, c.q_dim), quants.DENSE_TYPES),
            b + "attn_q_norm.weight": ((c.head_dim,), NORM_TYPES),
            b + "attn_k_norm.weight": ((c.head_dim,), NORM_TYPES),
            b + "ffn_norm.weight": ((d,), NORM_TYPES),
            b + "ffn_gate_inp.weight": ((E, d), quants.DENSE_TYPES),
            b + "ffn_gate_exps.weight": ((E, c.d_ff_expert, d), quants.EXPERT_TYPES),
            b + "ffn_up_exps.weight": ((E, c.d_ff_expert, d), quants.EXPERT_TYPES),
            b + "ffn_down_exps.weight": ((E, d, c.d_ff_expert), quants.EXPERT_TYPES),
        }
    return out


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: T
    shape: tuple[int, ...]  # numpy order, in values
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return quants.fmt(self.qtype).row_bytes(self.shape[-1])


@dataclass(frozen=True)
class Shard:
    path: Path
    size: int  # bytes of the file
    base: int  # where the file starts in the mapping
    header: int  # bytes of metadata and tensor table (where its tensor data starts)


class ModelFile:
    """A validated qwen3moe GGUF, one file or llama.cpp's split shards (give the first: `…-00001-of-0000N.gguf`).
    Raises ModelFormatError naming the file (the shard at fault) and the problem."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = _read_gguf(self.path)
        readers = split.shard_readers(self.path, self.reader, _read_gguf)  # first: a later shard has no metadata
        arch = metadata(self.reader, self.path, "general.architecture", "str", required=False)
        if arch != ARCH:
            raise ModelFormatError(self.path, f"unknown architecture {arch!r}; supported: {ARCH}")
        sizes = [p.stat().st_size for p, _ in readers]
        self.size = sum(sizes)
        self.config = self._read_config(readers)
        self._map, bases = map_files([p for p, _ in readers], sizes)
        self.shards = [Shard(p, size, base, int(r.data_offset)) for (p, r), size, base in zip(readers, sizes, bases)]
        self.tensors = self._read_tensors(readers)
        for _, r in readers[1:]:  # the first keeps its reader (the tokenizer reads it); the others are done
            _close_reader(r)

    # ---- metadata -------------------------------------------------------------------------------------------
    def meta(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _read_config(self, readers) -> ModelConfig:
        vals = {}
        for key, field in ModelConfig.KEYS.items():
            kind = "float" if field in ModelConfig.FLOAT_FIELDS else "int"
            v = metadata(self.reader, self.path, f"{ARCH}.{key}", kind, required=False)
            if v is None:
                if field in ModelConfig.FLOAT_FIELDS:
                    continue
                if field == "head_dim" and "n_head" in vals:
                    v = vals["d_model"] // vals["n_head"]
                else:
                    raise ModelFormatError(self.path, f"missing metadata key {ARCH}.{key}")
            vals[field] = v
        emb = next((t for _, r in readers for t in r.tensors if t.name == "token_embd.weight"), None)
        if emb is not None:
            vals["vocab_size"] = int(emb.shape[1])
        elif (tokens := self.meta("tokenizer.ggml.tokens")) is not None:
            vals["vocab_size"] = len(tokens)
        else:
            raise ModelFormatError(self.path, "missing tensor token_embd.weight")
        vals["rope_scaling"] = self._read_rope_scaling(vals["context_length"])
        cfg = ModelConfig(**vals)
        if probs := cfg.problems():
            raise ModelFormatError(self.path, "bad model shape: " + "; ".join(probs))
        return cfg

    def _read_rope_scaling(self, context_length: int) -> RopeScaling:
        """llama.cpp's rope.scaling keys: a factor without a type is linear; yarn's original length defaults to the
        trained one; a factor of 0 means none."""
        vals = {}
        for key, field in ModelConfig.ROPE_KEYS.items():
            kind = "str" if field == "kind" else "int" if field == "orig_ctx" else "float"
            v = metadata(self.reader, self.path, f"{ARCH}.{key}", kind, required=False)
            if v is not None:
                vals[field] = v
        log_mul = metadata(self.reader, self.path, f"{ARCH}.rope.scaling.yarn_log_multiplier", "float", required=False)
        if log_mul:
            raise ModelFormatError(self.path, f"{ARCH}.rope.scaling.yarn_log_multiplier is not supported")
        if vals.get("factor") == 0:
            vals.pop("factor")
        kind = vals.setdefault("kind", "linear" if "factor" in vals else "none")
        if kind == "yarn" and not vals.get("orig_ctx"):
            vals["orig_ctx"] = context_length
        return RopeScaling(**vals) if kind != "none" else RopeScaling()

    def _read_tensors(self, readers) -> dict[str, TensorInfo]:
        found = {}
        for (path, reader), shard in zip(readers, self.shards):
            for t in reader.tensors:
                if t.name in found:
                    raise ModelFormatError(path, f"tensor {t.name} is also in {self.shard_of(found[t.name]).path.name}")
                try:
                    qt = T(int(t.tensor_type))
                    f = quants.fmt(qt)
                except ValueError:
                    name = getattr(t.tensor_type, "name", str(t.tensor_type))
                    raise ModelFormatError(path, f"tensor {t.name} has unsupported type {name}; supported: "
                                                 f"{quants.supported_names()}") from None
                shape = tuple(int(x) for x in reversed(t.shape.tolist()))
                if shape[-1] % f.block_values:
                    raise ModelFormatError(path, f"tensor {t.name}: row of {shape[-1]} values is not a whole number "
                                                 f"of {qt.name} blocks")
                nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * f.row_bytes(shape[-1])
                if int(t.data_offset) + nbytes > shard.size:
                    raise ModelFormatError(path, f"truncated: tensor {t.name} ends at byte {int(t.data_offset) + nbytes}"
                                                 f", the file has {shard.size}")
                found[t.name] = TensorInfo(t.name, qt, shape, shard.base + int(t.data_offset), nbytes)
        self._check_layers(found)
        want = expected_tensors(self.config)
        if "output.weight" not in found:
            want.pop("output.weight")  # tied to the embedding
        for name, (shape, types) in want.items():
            ti = found.get(name)
            if ti is None:
                raise ModelFormatError(self.path, f"missing tensor {name}")
            if ti.shape != shape:
                raise ModelFormatError(self.path, f"tensor {name} has shape {list(ti.shape)}, expected {list(shape)}")
            if ti.qtype not in types:
                raise ModelFormatError(self.path, f"tensor {name} has type {ti.qtype.name}, which is not supported "
                                                  f"there (supported: {', '.join(t.name for t in types)})")
        return found

    def _check_layers(self, found: dict[str, TensorInfo]) -> None:
        """block_count against the layers the file's tensors hold, before a tensor list of that many layers is made
        (a damaged count of 2^32 - 1 would take all memory) and so that no layer is left out unseen."""
        n = self.config.n_layer
        top = max((int(name.split(".")[1]) for name in found
                   if name.startswith("blk.") and name.split(".")[1].isdigit()), default=-1)
        if top + 1 < n:
            raise ModelFormatError(self.path, f"{ARCH}.block_count is {n}, but the file's layer tensors stop at "
                                              f"blk.{top} (missing tensor blk.{top + 1}.*)")
        if top + 1 > n:
            raise ModelFormatError(self.path, f"tensors of blk.{top} are past {ARCH}.block_count {n} (a file with "
                                              f"{top + 1} layers?)")

    def shard_of(self, ti: TensorInfo) -> Shard:
        return next(s for s in reversed(self.shards) if s.base <= ti.offset)

    # ---- tensor access --------------------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        if name == "output.weight" and name not in self.tensors:
            name = "token_embd.weight"
        return self.tensors[name]

    @property
    def mapping(self) -> np.ndarray:
        """Every shard, mapped read-only into one range (uint8): the arena every lane reads expert bytes from."""
        return self._map

    def raw(self, name: str) -> np.ndarray:
        """uint8 view (..., row_bytes) of a tensor's bytes in the file mapping."""
        ti = self.info(name)
        return self._map[ti.offset:ti.offset + ti.nbytes].reshape(ti.shape[:-1] + (ti.row_bytes,))

    def dense(self, name: str) -> np.ndarray:
        """A dense tensor as float32 (dequantised copy)."""
        return quants.dequantize(self.info(name).qtype, self.raw(name))

    def expert_raw(self, layer: int, kind: str, expert: int) -> np.ndarray:
        """uint8 (rows, row_bytes) of one expert's gate / up / down matrix."""
        return self.raw(f"blk.{layer}.ffn_{kind}_exps.weight")[expert]

    def expert_type(self, layer: int, kind: str) -> T:
        return self.tensors[f"blk.{layer}.ffn_{kind}_exps.weight"].qtype

    @cached_property
    def types_summary(self) -> str:
        """What a user's file holds, by role: its llama.cpp file type (general.file_type) and each role's tensor
        types with their counts, e.g. "MXFP4_MOE file; experts MXFP4 x144; attention Q8_0 x192; embedding Q8_0;
        head Q8_0" (norms and the router, F32 in every file, left out)."""
        roles: dict[str, dict[str, int]] = {}
        for name, ti in self.tensors.items():
            if len(ti.shape) < 2 or "ffn_gate_inp" in name:
                continue
            role = ("experts" if "_exps." in name else "embedding" if name.startswith("token_embd")
                    else "head" if name.startswith("output") else "attention")
            counts = roles.setdefault(role, {})
            counts[ti.qtype.name] = counts.get(ti.qtype.name, 0) + 1
        ft = self.meta("general.file_type")
        try:
            head = [f"{LlamaFileType(int(ft)).name.removeprefix('MOSTLY_').removeprefix('ALL_')} file"]
        except (TypeError, ValueError):
            head = []
        parts = [f"{role} " + ", ".join(f"{t} x{n}" if n > 1 else t for t, n in sorted(roles[role].items(),
                                                                                     key=lambda kv: -kv[1]))
                 for role in ("experts", "attention", "embedding", "head") if role in roles]
        return "; ".join(head + parts)

    @cached_property
    def header_hash(self) -> str:
        """Identity of the model: sha256 of each shard's metadata and tensor table, the size and a sample of every
        tensor's bytes (its first and last 4 KiB), so a file regenerated with other weights differs. (One file:
        the same hash as before split files were read, so kept profiles still match.) Read with pread and no
        read-ahead: a page fault on the mapping would read around each sample (8 MB a fault with the block
        device's read_ahead_kb of 8192 here: a235b's 1,130 tensors took 16 s cold)."""
        h = hashlib.sha256()
        fds = [os.open(s.path, os.O_RDONLY) for s in self.shards]
        try:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

            def read(start: int, end: int) -> bytes:
                i = max(k for k, s in enumerate(self.shards) if s.base <= start)
                return os.pread(fds[i], end - start, start - self.shards[i].base)

            for s in self.shards:
                h.update(read(s.base, s.base + s.header))
            for ti in sorted(self.tensors.values(), key=lambda t: t.offset):
                h.update(read(ti.offset, ti.offset + min(ti.nbytes, HASH_SAMPLE)))
                h.update(read(max(ti.offset, ti.offset + ti.nbytes - HASH_SAMPLE), ti.offset + ti.nbytes))
        finally:
            for fd in fds:
                os.close(fd)
        h.update(str(self.size).encode())
        return h.hexdigest()

    @cached_property
    def tokenizer(self):
        from stratad.model.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.reader, self.path)

    def close(self) -> None:
        """Drop the mappings; the shards' range is unmapped once no view of it is left."""
        _close_reader(self.reader)
        self._map = None


_KNOWN_TYPES = frozenset(int(t) for t in T)  # the type codes the gguf package can read


class _UnknownType(ValueError):
    """A tensor's type code that is none of the gguf package's (a type newer than it: llama.cpp's Q1_0, Q2_0 ...)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _Reader(GGUFReader):
    """gguf's reader working on a plain ndarray view of its np.memmap: numpy's memmap subclass runs
    __array_finalize__ on every view the reader makes, some 2 million for a 151,936-token vocabulary and its
    merges (docs/perf-notes.md has the open time and memory). Each tensor's type code is checked against gguf's own
    before gguf converts it: a code it does not know is _UnknownType, not whatever its conversion raises."""

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, v):
        self._data = v.view(np.ndarray) if isinstance(v, np.memmap) else v

    def _build_tensors(self, start_offs, fields):
        for field in fields:  # parts: name length, name, n_dims, dims, type code, offset (gguf's tensor info)
            code = int(field.parts[4][0])
            if code not in _KNOWN_TYPES:
                raise _UnknownType(code)
        return super()._build_tensors(start_offs, fields)


def _close_reader(reader) -> None:
    d = getattr(reader, "data", None)
    while d is not None and not isinstance(d, np.memmap):
        d = d.base if isinstance(d, np.ndarray) else None
    if d is not None and d._mmap is not None:
        d._mmap.close()


def _read_gguf(path: Path):
    """A GGUFReader of one file, or ModelFormatError saying what is wrong with it."""
    if not path.is_file():
        raise ModelFormatError(path, "no such model file")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelFormatError(path, "not a GGUF file (bad magic)")
    reader = _Reader.__new__(_Reader)  # kept when __init__ fails: how far it got tells where the fault is
    try:
        reader.__init__(path, "r")
    except _UnknownType as e:  # a type newer than the gguf package (llama.cpp's Q1_0 / Q2_0 ...), not damage
        raise ModelFormatError(path, f"a tensor of type code {e.code}, which this version does not read "
                                     f"(supported: {quants.supported_names()})") from None
    except (ValueError, IndexError, OSError, KeyError) as e:
        size = path.stat().st_size
        if hasattr(reader, "data_offset"):  # header and tensor table were read; the tensor data is short
            raise ModelFormatError(path, f"truncated file or corrupt tensor table: the tensor data does not "
                                         f"fit the file's {size} bytes ({e})") from None
        raise ModelFormatError(path, f"truncated or corrupt GGUF header ({e})") from None
    return reader
