"""A full-size model file without the disk for one: metadata, tokenizer and tensor table real, every tensor's bytes
a hole that reads as zeros (a sparse file). What opening a file of a big shape costs (ModelFile maps it, it does
not read it) is measured on these: `scripts/model_open_bench.py`, `tests/test_model_open_scale.py`. The zeros are
no model to serve."""
from __future__ import annotations

import os
from pathlib import Path

from stratad.model import generator, quants
from stratad.model.config import PRESETS
from stratad.model.writer import write_model


def write_sparse(out: str | os.PathLike, preset: str, expert_quant: str = "IQ3_S",
                 split_max_size: int = 0) -> list[str]:
    """Write the preset's file (experts of expert_quant, dense Q8_0) to `out`, or llama.cpp's split shards of it
    (split_max_size > 0, gguf-split's names), with holes for the tensor data; the files appear only once
    complete. Returns the files written. Raises OSError where the filesystem cannot hold a file of that size."""
    from stratad.model.generated_vocab import build_vocab

    c = PRESETS[preset]
    eq, dq = quants.parse_type(expert_quant), quants.parse_type("Q8_0")
    sources = generator.model_tensors(c, eq, dq, skew=0.0, seed=0)  # shapes only: no tensor is generated
    return write_model(out, c, sources, build_vocab(c.vocab_size), name=f"sparse-{preset}", file_type=eq,
                       split_max_size=split_max_size, holes=True)


def resident_bytes() -> int:
    """This process's resident memory (VmRSS): pages of a mapped file count once touched, so a file opened
    without being read adds only what its parse keeps."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")
