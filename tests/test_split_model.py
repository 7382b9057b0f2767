"""Split GGUFs (llama.cpp's PREFIX-00001-of-0000N.gguf shards): a generated model written as shards loads from its
first shard into one mapping and computes the same logits, bit for bit, as the same model in one file; a missing,
extra, mismatched or truncated shard is refused naming the shard and the key."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from stratad.engine.reference import ReferenceEngine
from stratad.model.errors import ModelFormatError
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile

SPLIT_BYTES = 1_000_000  # the tiny model (~4 MB) in several shards
PROMPT = [5, 17, 300, 2, 99, 640, 41, 8, 1000, 12]


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory, tiny_model_path) -> Path:
    """The session's tiny model (same preset, quants, skew and seed) written again as shards."""
    d = tmp_path_factory.mktemp("split")
    rep = make_model(d / "tiny.gguf", "tiny", expert_quant="IQ3_S", dense_quant="Q8_0", router_skew=1.0, seed=0,
                     split_max_size=SPLIT_BYTES)
    assert len(rep["files"]) >= 3 and rep["path"] == str(d / f"tiny-00001-of-{len(rep['files']):05d}.gguf")
    assert sorted(p.name for p in d.iterdir()) == sorted(Path(f).name for f in rep["files"])  # no .part left
    return d


def shards(d: Path) -> list[Path]:
    return sorted(d.glob("tiny-*-of-*.gguf"))


def copy_split(src: Path, dst: Path) -> list[Path]:
    dst.mkdir()
    return [Path(shutil.copyfile(p, dst / p.name)) for p in shards(src)]


def open_error(path: Path) -> ModelFormatError:
    with pytest.raises(ModelFormatError) as ei:
        ModelFile(path)
    return ei.value


def patch_key(path: Path, key: str, value: int) -> None:
    """Overwrite an integer split key's value in place (same type, same width)."""
    f = GGUFReader(path).fields[key]
    width, fmt = {2: (2, "<H"), 5: (4, "<i")}[int(f.types[0])]  # UINT16 / INT32, as the writers store them
    off = int(f.offset) + sum(int(p.nbytes) for p in f.parts[:-1])
    data = bytearray(path.read_bytes())
    data[off:off + width] = struct.pack(fmt, value)
    path.write_bytes(bytes(data))


def test_split_file_loads_with_the_same_logits(split_dir, tiny_model, tiny_model_path):
    files = shards(split_dir)
    m = ModelFile(files[0])
    assert [s.path for s in m.shards] == files and len(files) >= 3
    assert m.config == tiny_model.config and set(m.tensors) == set(tiny_model.tensors)
    assert m.size == sum(p.stat().st_size for p in files)
    # every tensor a view of the one mapping, at its shard's place, with the bytes of the unsplit file
    for name in m.tensors:
        r = m.raw(name)
        assert np.shares_memory(r, m.mapping) and not r.flags.writeable
        assert np.array_equal(r, tiny_model.raw(name)), name
    last = m.tensors["blk.3.ffn_down_exps.weight"]
    assert m.shard_of(last) is m.shards[-1] and last.offset >= m.shards[-1].base > 0
    assert m.header_hash != tiny_model.header_hash  # other files, another identity
    assert m.tokenizer.encode("hello world") == tiny_model.tokenizer.encode("hello world")
    ours, ref = ReferenceEngine(m), ReferenceEngine(tiny_model)
    a = ours.forward(PROMPT, ours.new_kv(), logits="all")
    b = ref.forward(PROMPT, ref.new_kv(), logits="all")
    assert np.array_equal(a, b)  # bit for bit
    m.close()


def test_one_file_keeps_its_identity(tiny_model, tiny_model_path):
    """One file is one shard: the mapping is the file and the hash the one kept profiles were saved under."""
    assert len(tiny_model.shards) == 1 and tiny_model.shards[0].base == 0
    assert tiny_model.mapping.size >= tiny_model_path.stat().st_size
    head = tiny_model_path.read_bytes()[:tiny_model.shards[0].header]
    assert bytes(tiny_model.mapping[:len(head)]) == head


def test_missing_shard(split_dir, tmp_path):
    files = copy_split(split_dir, tmp_path / "s")
    files[1].unlink()
    e = open_error(files[0])
    assert e.path == str(files[1]) and f"missing shard 2 of {len(files)}" in e.problem and "split.count" in e.problem


def test_extra_shard(split_dir, tmp_path):
    files = copy_split(split_dir, tmp_path / "s")
    extra = files[0].with_name(f"tiny-00001-of-{len(files) + 1:05d}.gguf")  # a shard of another split of it
    shutil.copyfile(files[0], extra)
    e = open_error(files[0])
    assert e.path == str(extra) and "extra shard" in e.problem and f"split.count = {len(files)}" in e.problem


@pytest.mark.parametrize("key,value,want", [
    ("split.no", 2, "split.no is 2, expected 1"),
    ("split.count", 99, "split.count is 99, expected {n}"),
    ("split.tensors.count", 7, "split.tensors.count is 7, expected {t}"),
])
def test_mismatched_shard(split_dir, tmp_path, key, value, want):
    files = copy_split(split_dir, tmp_path / "s")
    total = GGUFReader(files[0]).fields["split.tensors.count"].contents()
    patch_key(files[1], key, value)
    e = open_error(files[0])
    assert e.path == str(files[1]) and want.format(n=len(files), t=total) in e.problem, e.problem


def test_tensor_count_disagrees_with_the_shards(split_dir, tmp_path):
    files = copy_split(split_dir, tmp_path / "s")
    for p in files:  # consistent across the shards, but not what they hold
        patch_key(p, "split.tensors.count", 5)
    e = open_error(files[0])
    assert e.path == str(files[0]) and "split.tensors.count is 5 but the" in e.problem


def test_truncated_shard(split_dir, tmp_path):
    files = copy_split(split_dir, tmp_path / "s")
    data = files[2].read_bytes()
    files[2].write_bytes(data[:len(data) - 1000])
    e = open_error(files[0])
    assert e.path == str(files[2]) and "truncated" in e.problem


def test_not_the_first_shard(split_dir):
    files = shards(split_dir)
    e = open_error(files[1])
    assert e.path == str(files[1]) and f"this is shard 2 of {len(files)}" in e.problem and files[0].name in e.problem


def test_renamed_first_shard(split_dir, tmp_path):
    files = copy_split(split_dir, tmp_path / "s")
    renamed = files[0].rename(files[0].with_name("model.gguf"))
    e = open_error(renamed)
    assert "split.count" in e.problem and "PREFIX-00001-of-" in e.problem
