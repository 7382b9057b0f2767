"""Write a qwen3moe GGUF with llama.cpp's names and metadata, streaming tensors to disk one chunk at a time."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, LlamaFileType, RopeScalingType

from stratad.model import quants
from stratad.model.config import ARCH, ModelConfig


@dataclass
class TensorSource:
    """A tensor to write: its values come from `chunks()`, arrays of whole rows (raw blocks or floats)."""

    name: str
    qtype: T
    shape: tuple[int, ...]  # numpy order, in values
    chunks: Callable[[], Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) * quants.fmt(self.qtype).row_bytes(self.shape[-1])

    @classmethod
    def of(cls, name: str, qtype: T, array: np.ndarray) -> "TensorSource":
        """From float32 values in memory: quantised with gguf's quantiser (F32/F16/BF16/Q8_0)."""
        from gguf.quants import quantize

        data = array.astype(np.float32) if qtype == T.F32 else quantize(array.astype(np.float32), qtype)
        return cls(name, qtype, tuple(array.shape), lambda: [data])


class _Streamed:
    """What GGUFWriter.write_tensor_data needs (nbytes, tofile) without holding the tensor in memory."""

    def __init__(self, src: TensorSource):
        self.src = src
        self.nbytes = src.nbytes

    def tofile(self, f) -> None:
        written = 0
        for c in self.src.chunks():
            c = np.ascontiguousarray(c)
            c.tofile(f)
            written += c.nbytes
        if written != self.nbytes:
            raise ValueError(f"{self.src.name}: wrote {written} bytes, expected {self.nbytes}")


def _metadata(w: GGUFWriter, c: ModelConfig, name: str, file_type: int) -> None:
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.d_model)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(c.d_ff_expert * c.n_expert_used)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head_kv)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_expert_count(c.n_expert)
    w.add_expert_used_count(c.n_expert_used)
    w.add_expert_feed_forward_length(c.d_ff_expert)
    r = c.rope_scaling
    if r.scaled:
        w.add_rope_scaling_type(RopeScalingType(r.kind))
        w.add_rope_scaling_factor(r.factor)
        if r.orig_ctx:
            w.add_rope_scaling_orig_ctx_len(r.orig_ctx)
        if r.attn_factor != 1.0:
            w.add_rope_scaling_attn_factors(r.attn_factor)


FILE_TYPES = {T.F32: LlamaFileType.ALL_F32, T.F16: LlamaFileType.MOSTLY_F16, T.BF16: LlamaFileType.MOSTLY_BF16,
              T.Q8_0: LlamaFileType.MOSTLY_Q8_0, T.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
              T.IQ3_S: LlamaFileType.MOSTLY_IQ3_S}


class _PartWriter(GGUFWriter):
    """gguf's writer (its splitting: shards PREFIX-0000i-of-0000N.gguf, split keys in each, metadata in the
    first) writing every file as NAME.part, renamed once all are complete."""

    def format_shard_names(self, path) -> list:
        return [p.with_name(p.name + ".part") for p in super().format_shard_names(path)]


def write_model(path: str | os.PathLike, config: ModelConfig, tensors: Iterable[TensorSource], vocab,
                name: str = "stratad-generated", file_type: T | LlamaFileType = T.F32,
                split_max_size: int = 0, holes: bool = False) -> list[str]:
    """Write metadata, tokenizer and tensors; the file appears under `path` only once complete. split_max_size
    > 0: shards of at most that many tensor bytes (a bigger tensor gets a shard of its own), named as llama.cpp's
    gguf-split names them from `path` (model.gguf -> model-00001-of-00003.gguf ...). holes: every tensor's bytes a
    hole that reads as zeros (a sparse file; no tensor is generated). Returns the files written."""
    from stratad.model.generated_vocab import write_tokenizer

    tensors = list(tensors)
    w = _PartWriter(Path(path), ARCH, split_max_size=split_max_size)
    parts: list[Path] = []
    try:
        _metadata(w, config, name, file_type if isinstance(file_type, LlamaFileType)  # a mix's own file type
                  else FILE_TYPES.get(file_type, LlamaFileType.ALL_F32))
        write_tokenizer(w, vocab)
        for t in tensors:
            byte_shape = t.shape[:-1] + (quants.fmt(t.qtype).row_bytes(t.shape[-1]),)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
        parts = w.format_shard_names(Path(path))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if holes:  # each shard's data: aligned offsets, then a hole to its end
            ends = []
            for shard, infos in enumerate(w.tensors):
                pos = w.fout[shard].tell()
                for ti in infos.values():
                    pos = -(-pos // w.data_alignment) * w.data_alignment + ti.nbytes
                ends.append(-(-pos // w.data_alignment) * w.data_alignment)
            w.close()
            for p, end in zip(parts, ends):
                os.truncate(p, end)
        else:
            for t in tensors:
                w.write_tensor_data(_Streamed(t))
            w.close()
        done = [p.with_name(p.name.removesuffix(".part")) for p in parts]
        for p, d in zip(parts, done):
            os.replace(p, d)
        return [str(d) for d in done]
    except BaseException:
        w.close()
        for p in parts:
            p.unlink(missing_ok=True)
        raise


def row_chunks(rows: int, per_chunk: int, make: Callable[[int, int], np.ndarray]) -> Iterator[np.ndarray]:
    """make(start, count) for consecutive row ranges: bounds the memory a big tensor needs while written."""
    for s in range(0, rows, per_chunk):
        yield make(s, min(per_chunk, rows - s))
