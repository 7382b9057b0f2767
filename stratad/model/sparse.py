"""A full-size model file without the disk for one: metadata, tokenizer and tensor table real, every tensor's bytes
a hole that reads as zeros (a sparse file). What opening a file of a big shape costs (ModelFile maps it, it does
not read it) is measured on these: `scripts/model_open_bench.py`, `tests/test_model_open_scale.py`. The zeros are
no model to serve."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from stratad.model import generator, quants
from stratad.model.config import ARCH, PRESETS
from stratad.model.writer import FILE_TYPES, _metadata, _PartWriter


def write_sparse(out: str | os.PathLike, preset: str, expert_quant: str = "IQ3_S",
                 split_max_size: int = 0) -> list[str]:
    """Write the preset's file (experts of expert_quant, dense Q8_0) to `out`, or llama.cpp's split shards of it
    (split_max_size > 0, gguf-split's names), with holes for the tensor data; the files appear only once
    complete. Returns the files written. Raises OSError where the filesystem cannot hold a file of that size."""
    from stratad.model.tokenizer import build_vocab, write_tokenizer

    c = PRESETS[preset]
    eq, dq = quants.parse_type(expert_quant), quants.parse_type("Q8_0")
    sources = generator.model_tensors(c, eq, dq, skew=0.0, seed=0)  # shapes only: no tensor is generated
    w = _PartWriter(Path(out), ARCH, split_max_size=split_max_size)
    parts: list[Path] = []
    try:
        _metadata(w, c, f"sparse-{preset}", FILE_TYPES[eq])
        write_tokenizer(w, build_vocab(c.vocab_size))
        for t in sources:
            byte_shape = t.shape[:-1] + (quants.fmt(t.qtype).row_bytes(t.shape[-1]),)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
        parts = w.format_shard_names(Path(out))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        ends = {}
        for shard, tensors in enumerate(w.tensors):  # each shard's data: aligned offsets, then a hole to its end
            pos = w.fout[shard].tell()
            for ti in tensors.values():
                pos = -(-pos // w.data_alignment) * w.data_alignment + ti.nbytes
            ends[shard] = -(-pos // w.data_alignment) * w.data_alignment
        w.close()
        for shard, p in enumerate(parts):
            os.truncate(p, ends[shard])
        done = [p.with_name(p.name.removesuffix(".part")) for p in parts]
        for p, d in zip(parts, done):
            os.replace(p, d)
        return [str(d) for d in done]
    except BaseException:
        w.close()
        for p in parts:
            p.unlink(missing_ok=True)
        raise


def resident_bytes() -> int:
    """This process's resident memory (VmRSS): pages of a mapped file count once touched, so a file opened
    without being read adds only what its parse keeps."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")
