"""Property-based damage (hypothesis) to a valid GGUF's header, key/value metadata and tensor table: bytes
overwritten anywhere before the tensor data (a length or count made huge, a type code changed, a string's bytes
broken), and the model's shape keys set to edge values. Opening it as the daemon does (ModelFile, then the
tokenizer) either works, with a shape it can serve, or raises ModelFormatError naming the file: never another
exception, a memory blow-up or a hang."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratad.model.config import ARCH, ModelConfig
from stratad.model.errors import ModelFormatError
from stratad.model.gguf_file import ModelFile
from stratad.model.tokenizer import Tokenizer
from test_model_file import raw_list, tiny_tensors, write_raw

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# values that break a length, a count or a type code in telling ways, besides random bytes
WORDS = st.sampled_from([b"\xff" * 8, b"\x00" * 8, (2**31).to_bytes(8, "little"), (2**63 - 1).to_bytes(8, "little"),
                         (1000).to_bytes(8, "little"), b"\x80\x80\x80\x80", b"\x0c\x00\x00\x00", b"\x08\x00\x00\x00"])
EDITS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.one_of(WORDS, st.binary(min_size=1, max_size=8))),
                 min_size=1, max_size=4)


class Damaged:
    """A copy of the tiny model whose first header_end bytes each example overwrites, and puts back after."""

    def __init__(self, src: Path, path: Path):
        shutil.copyfile(src, path)
        self.path, self.header_end = path, GGUFReader(src).data_offset
        self.header = path.read_bytes()[:self.header_end]

    def __repr__(self) -> str:  # hypothesis prints its arguments: not the file's bytes
        return f"Damaged({self.path.name}, header of {self.header_end} bytes)"

    def write(self, edits) -> None:
        b = bytearray(self.header)
        for where, new in edits:
            at = 8 + int(where * (self.header_end - 8))  # past the magic and the version
            b[at:at + len(new)] = new
        with open(self.path, "r+b") as f:
            f.write(bytes(b[:self.header_end]))


@pytest.fixture(scope="module")
def damaged(tiny_model_path, tmp_path_factory) -> Damaged:
    return Damaged(tiny_model_path, tmp_path_factory.mktemp("fuzzgguf") / "damaged.gguf")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's reader on a huge offset
@FUZZ
@given(edits=EDITS)
def test_damaged_metadata_is_refused_by_name(damaged, edits):
    damaged.write(edits)
    try:
        ModelFile(damaged.path).close()
        Tokenizer.from_file(damaged.path)
    except ModelFormatError as e:
        assert str(e).startswith(f"{damaged.path}: ") and e.problem


SHAPE_KEYS = sorted(ModelConfig.KEYS) + sorted(ModelConfig.ROPE_KEYS)
INTS = st.sampled_from([0, 1, 3, 7, 4096, 2**31 - 1, 2**32 - 1])
FLOATS = st.sampled_from([0.0, -1.0, 1e-45, 0.5, 4.0, 1e38, math.inf, -math.inf, math.nan])


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.dictionaries(st.sampled_from(SHAPE_KEYS), st.one_of(INTS, FLOATS), min_size=1, max_size=3))
def test_any_shape_metadata_opens_servable_or_is_refused(tmp_path_factory, values):
    """The model's shape keys (llama.cpp's qwen3moe.* and rope.scaling.*) at edge values: ModelFile opens with a
    shape that has no problems and a finite context, or refuses the file by name (before any allocation of that
    size: a block_count of 2^32 - 1 took all memory, an infinite rope factor overflowed, nan norms were served)."""
    keys = {}
    for key, v in values.items():
        if key == "rope.scaling.type":
            v = "yarn" if v else "linear"
        kind = GGUFValueType.STRING if isinstance(v, str) else \
            GGUFValueType.FLOAT32 if isinstance(v, float) else GGUFValueType.UINT32
        keys[f"{ARCH}.{key}"] = (v, kind)
    p = write_raw(tmp_path_factory.mktemp("shape") / "shape.gguf", raw_list(tiny_tensors()), set_keys=keys)
    try:
        m = ModelFile(p)
    except ModelFormatError as e:
        assert e.problem
        return
    assert not m.config.problems() and math.isfinite(m.config.max_context)
    m.close()
