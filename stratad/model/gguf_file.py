"""Open a qwen3moe GGUF: memory-mapped, validated, with a typed config and raw tensor views.

Tensor bytes are never read whole into RAM: `ModelFile.raw(name)` is a view of the file's mapping. Layout and
names are llama.cpp's, so a real Qwen3-30B-A3B / 235B-A22B GGUF opens unchanged. Shapes below are numpy order
(the reverse of GGUF's ne order): experts are one 3-D tensor per layer, (n_expert, rows, cols).
"""
from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType

from stratad.model import quants
from stratad.model.config import ARCH, ModelConfig
from stratad.model.errors import ModelFormatError

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


class ModelFile:
    """A validated qwen3moe GGUF file. Raises ModelFormatError naming the file and the problem."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(self.path, "no such model file")
        self.size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelFormatError(self.path, "not a GGUF file (bad magic)")
        reader = GGUFReader.__new__(GGUFReader)  # kept when __init__ fails: how far it got tells where the fault is
        try:
            reader.__init__(self.path, "r")
        except (ValueError, IndexError, OSError, KeyError) as e:
            if hasattr(reader, "data_offset"):  # header and tensor table were read; the tensor data is short
                raise ModelFormatError(self.path, f"truncated file or corrupt tensor table: the tensor data does not "
                                                  f"fit the file's {self.size} bytes ({e})") from None
            raise ModelFormatError(self.path, f"truncated or corrupt GGUF header ({e})") from None
        self.reader = reader
        arch = self.meta("general.architecture")
        if arch != ARCH:
            raise ModelFormatError(self.path, f"unknown architecture {arch!r}; supported: {ARCH}")
        self.config = self._read_config()
        self.tensors = self._read_tensors()
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    # ---- metadata -------------------------------------------------------------------------------------------
    def meta(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _float(self, key: str, v) -> float:
        # a FLOAT32 value (llama.cpp writes these so) stands for the shortest decimal that rounds to it: 1e-6, not
        # 9.99999997e-07, so that a written config reads back equal
        f = self.reader.fields[key]
        return float(str(np.float32(v))) if f.types and f.types[0] == GGUFValueType.FLOAT32 else float(v)

    def _read_config(self) -> ModelConfig:
        vals = {}
        for key, field in ModelConfig.KEYS.items():
            v = self.meta(f"{ARCH}.{key}")
            if v is None:
                if field in ("rope_base", "rms_eps"):
                    continue
                if field == "head_dim" and "n_head" in vals:
                    v = vals["d_model"] // vals["n_head"]
                else:
                    raise ModelFormatError(self.path, f"missing metadata key {ARCH}.{key}")
            elif field in ("rope_base", "rms_eps"):
                v = self._float(f"{ARCH}.{key}", v)
            vals[field] = v
        tokens = self.meta("tokenizer.ggml.tokens")
        emb = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        if emb is not None:
            vals["vocab_size"] = int(emb.shape[1])
        elif tokens is not None:
            vals["vocab_size"] = len(tokens)
        else:
            raise ModelFormatError(self.path, "missing tensor token_embd.weight")
        cfg = ModelConfig(**{k: (float(v) if k in ("rope_base", "rms_eps") else int(v)) for k, v in vals.items()})
        if probs := cfg.problems():
            raise ModelFormatError(self.path, "bad model shape: " + "; ".join(probs))
        return cfg

    def _read_tensors(self) -> dict[str, TensorInfo]:
        found = {}
        for t in self.reader.tensors:
            try:
                qt = T(int(t.tensor_type))
                f = quants.fmt(qt)
            except ValueError:
                name = getattr(t.tensor_type, "name", str(t.tensor_type))
                raise ModelFormatError(self.path, f"tensor {t.name} has unsupported type {name}") from None
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * f.row_bytes(shape[-1]) if shape[-1] % f.block_values == 0 else -1
            if nbytes < 0:
                raise ModelFormatError(self.path, f"tensor {t.name}: row of {shape[-1]} values is not a whole number of {qt.name} blocks")
            found[t.name] = TensorInfo(t.name, qt, shape, int(t.data_offset), nbytes)
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
        for ti in found.values():
            if ti.offset + ti.nbytes > self.size:
                raise ModelFormatError(self.path, f"truncated: tensor {ti.name} ends at byte {ti.offset + ti.nbytes}, "
                                                  f"the file has {self.size}")
        return found

    # ---- tensor access --------------------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        if name == "output.weight" and name not in self.tensors:
            name = "token_embd.weight"
        return self.tensors[name]

    @property
    def mapping(self) -> np.ndarray:
        """The whole file, mapped read-only (uint8): the arena every lane reads expert bytes from."""
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
    def header_hash(self) -> str:
        """Identity of the model: sha256 of the metadata, the tensor table, the size and a sample of every
        tensor's bytes (its first and last 4 KiB), so a file regenerated with other weights differs."""
        h = hashlib.sha256()
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            h.update(m[: self.reader.data_offset])
            for ti in sorted(self.tensors.values(), key=lambda t: t.offset):
                h.update(m[ti.offset:ti.offset + min(ti.nbytes, HASH_SAMPLE)])
                h.update(m[max(ti.offset, ti.offset + ti.nbytes - HASH_SAMPLE):ti.offset + ti.nbytes])
        h.update(str(self.size).encode())
        return h.hexdigest()

    @cached_property
    def tokenizer(self):
        from stratad.model.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.reader, self.path)

    def close(self) -> None:
        for m in (getattr(self, "_map", None), getattr(self.reader, "data", None)):
            mm = getattr(m, "_mmap", None)
            if mm is not None:
                mm.close()
