"""The tiny preset written with another chat template in its GGUF (a real one, or one a test makes up)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from stratad.model import quants
from stratad.model.config import PRESETS
from stratad.model.generated_vocab import build_vocab
from stratad.model.generator import model_tensors
from stratad.model.writer import write_model


def tiny_with_template(path: Path, template: str, name: str) -> Path:
    """IQ3_S experts, Q8_0 dense, router skew 1.0, seed 0: the tiny_model_path fixture's weights."""
    c = PRESETS["tiny"]
    eq = quants.parse_type("IQ3_S")
    vocab = dataclasses.replace(build_vocab(c.vocab_size), chat_template=template)
    write_model(path, c, model_tensors(c, eq, quants.parse_type("Q8_0"), 1.0, 0, 1), vocab, name=name, file_type=eq)
    return path
