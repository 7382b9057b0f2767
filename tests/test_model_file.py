"""ModelFile: opening a qwen3moe GGUF, its typed config and raw tensor views, and an error for every bad file that
names the file and the problem."""
from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.gguf_writer import GGUFValue

from stratad.model import generator, quants, writer
from stratad.model.config import ARCH, PRESETS
from stratad.model.errors import ModelFormatError
from stratad.model.gguf_file import ModelFile, expected_tensors
from stratad.model.rope import RopeScaling
from stratad.model.generated_vocab import build_vocab, write_tokenizer
from stratad.model.writer import TensorSource

TINY = PRESETS["tiny"]


def tiny_tensors(seed: int = 0, expert_q: T = T.IQ3_S, dense_q: T = T.Q8_0) -> list[TensorSource]:
    return generator.model_tensors(TINY, expert_q, dense_q, skew=1.0, seed=seed)


def write(path: Path, tensors: list[TensorSource], config=TINY, **kw) -> Path:
    writer.write_model(path, config, tensors, build_vocab(config.vocab_size), **kw)
    return path


def replace(tensors: list[TensorSource], name: str, new: TensorSource | None) -> list[TensorSource]:
    assert any(t.name == name for t in tensors), name
    return [(new if t.name == name else t) for t in tensors if t.name != name or new is not None]


def random_source(name: str, qtype: T, shape: tuple[int, ...]) -> TensorSource:
    rows = int(np.prod(shape[:-1]))
    return TensorSource(name, qtype, shape,
                        lambda: [quants.random_rows(qtype, np.random.default_rng(1), rows, shape[-1], 0.05)])


def as_bytes(src: TensorSource) -> np.ndarray:
    """A tensor's bytes, uint8 in numpy byte shape (..., row_bytes)."""
    flat = np.concatenate([np.ascontiguousarray(c).view(np.uint8).ravel() for c in src.chunks()])
    return flat.reshape(src.shape[:-1] + (-1,))


def write_raw(path: Path, tensors: list[tuple[str, T, np.ndarray]], arch: str = ARCH, config=TINY,
              drop_keys: tuple[str, ...] = (), set_keys: dict | None = None) -> Path:
    """A GGUF written with gguf's GGUFWriter directly: any architecture, any tensor type, keys left out or
    given any value and type (set_keys: key -> (value, GGUFValueType))."""
    w = GGUFWriter(str(path), arch)
    writer._metadata(w, config, "test", LlamaFileType.ALL_F32)
    write_tokenizer(w, build_vocab(config.vocab_size))
    for key in drop_keys:
        del w.kv_data[0][key]
    for key, (value, vtype) in (set_keys or {}).items():
        w.kv_data[0][key] = GGUFValue(value, vtype, None)
    for name, qtype, data in tensors:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def raw_list(tensors: list[TensorSource]) -> list[tuple[str, T, np.ndarray]]:
    return [(t.name, t.qtype, as_bytes(t)) for t in tensors]


def open_error(path) -> ModelFormatError:
    with pytest.raises(ModelFormatError) as ei:
        ModelFile(path)
    e = ei.value
    assert e.path == str(path)
    assert str(e).startswith(f"{path}: "), str(e)  # the message names the file first
    return e


# ---- a good file ----------------------------------------------------------------------------------------------


def test_tiny_loads_with_preset_config(tiny_model, tiny_model_path):
    assert tiny_model.config == TINY
    assert tiny_model.size == tiny_model_path.stat().st_size
    assert 1 << 20 < tiny_model.size < 16 << 20  # a few MB


def test_custom_config_round_trips(tmp_path):
    c = dataclasses.replace(TINY, n_layer=2, rope_base=10000.0, rms_eps=1e-5, context_length=4096, n_expert=8,
                            n_expert_used=2)
    p = tmp_path / "c.gguf"
    generator.make_model(p, c, "Q4_K", "F16", seed=3)
    m = ModelFile(p)
    assert m.config == c
    m.close()


def test_tensor_names_types_and_bytes(tiny_model):
    """llama.cpp's names and numpy-order shapes, every tensor expected (output.weight included), and the bytes
    behind each view are the bytes that were written."""
    want = expected_tensors(TINY)
    assert set(tiny_model.tensors) == set(want)
    for name, (shape, types) in want.items():
        ti = tiny_model.tensors[name]
        assert ti.shape == shape and ti.qtype in types
        assert ti.offset % 32 == 0  # GGUF's default alignment
    assert tiny_model.tensors["blk.0.ffn_gate_exps.weight"].shape == (16, 256, 256)
    assert tiny_model.expert_type(0, "down") == T.IQ3_S
    sources = {t.name: t for t in tiny_tensors()}
    for name in ("token_embd.weight", "output_norm.weight", "blk.3.attn_k.weight", "blk.1.ffn_down_exps.weight"):
        assert np.array_equal(tiny_model.raw(name), as_bytes(sources[name]))
    e = tiny_model.expert_raw(2, "up", 5)
    assert np.array_equal(e, tiny_model.raw("blk.2.ffn_up_exps.weight")[5])
    assert e.shape == (256, quants.fmt(T.IQ3_S).row_bytes(256))


def test_raw_is_a_view_of_the_mapping(tiny_model):
    r = tiny_model.raw("blk.0.ffn_up_exps.weight")
    assert not r.flags.owndata and not r.flags.writeable
    assert np.shares_memory(r, tiny_model._map)  # no copy: the file's pages
    ti = tiny_model.info("blk.0.ffn_up_exps.weight")
    base = r
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert not isinstance(base, np.ndarray)  # the chain ends at the mmap object, not at an owned array
    assert r.__array_interface__["data"][0] - tiny_model._map.__array_interface__["data"][0] == ti.offset


def test_dense_dequantises(tiny_model):
    w = tiny_model.dense("blk.0.attn_q.weight")
    assert w.dtype == np.float32 and w.shape == (TINY.q_dim, TINY.d_model)
    assert np.sqrt(np.mean(w.astype(np.float64) ** 2)) == pytest.approx(1 / np.sqrt(TINY.d_model), rel=0.1)


def test_header_hash(tmp_path, tiny_model, tiny_model_path):
    h = tiny_model.header_hash
    assert len(h) == 64 and h == tiny_model.header_hash
    again = ModelFile(tiny_model_path)
    assert again.header_hash == h  # stable across openings
    again.close()
    cp = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_model_path, cp)
    m = ModelFile(cp)
    assert m.header_hash == h  # and across copies
    m.close()
    other = write(tmp_path / "renamed.gguf", tiny_tensors(), name="another-name")  # metadata differs
    m = ModelFile(other)
    assert m.header_hash != h
    m.close()
    q4 = tmp_path / "q4k.gguf"
    generator.make_model(q4, "tiny", "Q4_K", router_skew=1.0)  # tensor table differs
    m = ModelFile(q4)
    assert m.header_hash != h
    m.close()
    reseeded = tmp_path / "seed7.gguf"
    generator.make_model(reseeded, "tiny", "IQ3_S", router_skew=1.0, seed=7)  # only the weights differ
    m = ModelFile(reseeded)
    assert m.header_hash != h
    m.close()


def test_tied_output(tmp_path):
    """No output.weight: the LM head is the embedding (as llama.cpp does)."""
    from stratad.engine.reference import ReferenceEngine, rms_norm

    p = write(tmp_path / "tied.gguf", replace(tiny_tensors(), "output.weight", None))
    m = ModelFile(p)
    assert "output.weight" not in m.tensors
    assert m.info("output.weight").name == "token_embd.weight"
    assert np.array_equal(m.raw("output.weight"), m.raw("token_embd.weight"))
    eng = ReferenceEngine(m, "float")
    logits = eng.forward([1, 2, 3, 4], eng.new_kv())
    assert logits.shape == (1, TINY.vocab_size) and np.all(np.isfinite(logits))
    # the head really is the embedding: recompute the last position's logits by hand
    h = eng.forward([1, 2, 3, 4], eng.new_kv(), logits="none")[-1:]
    want = rms_norm(h, m.dense("output_norm.weight"), TINY.rms_eps) @ m.dense("token_embd.weight").T
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-6 * np.abs(want).max())
    m.close()


# ---- bad files ------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    e = open_error(tmp_path / "nope.gguf")
    assert e.problem == "no such model file"
    assert "no such model file" in open_error(tmp_path).problem  # a directory is no model file either


@pytest.mark.parametrize("content", [b"", b"GG", b"\x00" * 4096, "random", "text"])
def test_not_gguf(tmp_path, content):
    if content == "random":
        content = np.random.default_rng(0).bytes(100_000)
    elif content == "text":
        content = b"# a README, not a model\n" * 100
    p = tmp_path / "x.gguf"
    p.write_bytes(content)
    assert open_error(p).problem == "not a GGUF file (bad magic)"


def test_unsupported_gguf_version(tmp_path, tiny_model_path):
    data = bytearray(tiny_model_path.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    p = tmp_path / "v99.gguf"
    p.write_bytes(bytes(data))
    assert "version 99" in open_error(p).problem


def _cut_points(path: Path) -> dict[str, list[int]]:
    r = GGUFReader(path)
    kv_tok = min(f.offset for f in r.fields.values() if f.name.startswith("tokenizer."))
    table = min(t.field.offset for t in r.tensors)  # the tensor table follows the key/value metadata
    size = path.stat().st_size
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert 100 < kv_tok < table < r.data_offset - 64
    return {
        "header": [6, 16, 23, 24, 100, kv_tok + 3, (kv_tok + table) // 2, table - 1],
        "tensor table": [table + 1, table + 40, (table + r.data_offset) // 2, r.data_offset - 64],
        "tensor data": [r.data_offset, r.data_offset + 1, int(emb.data_offset) + 100, size // 2, size - 1],
    }


@pytest.mark.parametrize("where", ["header", "tensor table", "tensor data"])
def test_truncated(tmp_path, tiny_model_path, where):
    """A valid file cut short anywhere past its magic: a ModelFormatError saying so, never a raw
    IndexError / ValueError from the reader."""
    data = tiny_model_path.read_bytes()
    cuts = _cut_points(tiny_model_path)[where]
    for cut in cuts:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        e = open_error(p)  # pytest.raises(ModelFormatError) lets any other exception through: it would fail here
        assert "truncated" in e.problem, (cut, e.problem)
        if where == "tensor data":
            assert "tensor data" in e.problem and f"the file's {cut} bytes" in e.problem, e.problem
        else:
            assert "header" in e.problem, (cut, e.problem)


def test_truncated_tensor_table_checked_by_us(tmp_path, monkeypatch, tiny_model_path):
    """Our own bound check names the tensor that runs past the end (the reader's views are lazily trusted)."""
    data = tiny_model_path.read_bytes()
    r = GGUFReader(tiny_model_path)
    last = max(r.tensors, key=lambda t: t.data_offset)
    p = tmp_path / "short.gguf"
    p.write_bytes(data[:-10])

    import stratad.model.gguf_file as gf

    class LenientReader(gf._Reader):  # a reader that maps tensors past the end without complaint
        def _build_tensors(self, start_offs, fields):
            size = self.data.size
            self.data = np.concatenate([self.data, np.zeros(64, np.uint8)])
            super()._build_tensors(start_offs, fields)
            self.data = self.data[:size]

    monkeypatch.setattr(gf, "_Reader", LenientReader)
    e = open_error(p)
    assert f"truncated: tensor {last.name} ends at byte" in e.problem and f"the file has {len(data) - 10}" in e.problem


def test_unknown_architecture(tmp_path):
    p = write_raw(tmp_path / "llama.gguf", raw_list(tiny_tensors()), arch="llama")
    e = open_error(p)
    assert e.problem == "unknown architecture 'llama'; supported: qwen3moe"


def test_missing_architecture(tmp_path):
    p = write_raw(tmp_path / "noarch.gguf", raw_list(tiny_tensors()), drop_keys=("general.architecture",))
    assert "unknown architecture None" in open_error(p).problem


@pytest.mark.parametrize("key", ["qwen3moe.expert_count", "qwen3moe.block_count", "qwen3moe.embedding_length",
                                 "qwen3moe.expert_feed_forward_length", "qwen3moe.attention.head_count_kv"])
def test_missing_metadata_key(tmp_path, key):
    p = write_raw(tmp_path / "nokey.gguf", raw_list(tiny_tensors()), drop_keys=(key,))
    assert open_error(p).problem == f"missing metadata key {key}"


def test_optional_metadata_defaults(tmp_path):
    """rope base, rms epsilon and key length may be left out (defaults; head_dim = d_model / n_head)."""
    p = write_raw(tmp_path / "defaults.gguf", raw_list(tiny_tensors()),
                  drop_keys=("qwen3moe.rope.freq_base", "qwen3moe.attention.layer_norm_rms_epsilon",
                             "qwen3moe.attention.key_length"))
    m = ModelFile(p)
    assert m.config == TINY  # the tiny preset's values are the defaults
    m.close()


def test_bad_shape_metadata(tmp_path):
    c = dataclasses.replace(TINY, n_expert_used=32)  # more experts used than exist
    p = write(tmp_path / "bad.gguf", tiny_tensors(), config=c)
    assert "bad model shape: expert_used_count 32 exceeds expert_count 16" in open_error(p).problem


@pytest.mark.parametrize("count,problem", [
    (3, "tensors of blk.3 are past qwen3moe.block_count 3 (a file with 4 layers?)"),
    (5, "qwen3moe.block_count is 5, but the file's layer tensors stop at blk.3 (missing tensor blk.4.*)"),
    (2**32 - 1, f"qwen3moe.block_count is {2**32 - 1}, but the file's layer tensors stop at blk.3 (missing tensor "
                "blk.4.*)")])
def test_block_count_that_is_not_the_files_layers(tmp_path, count, problem):
    """A block count the tensors do not have: refused by name before a tensor list of that many layers is made
    (2^32 - 1 took all the memory there was), and fewer layers than the file holds are not served unseen."""
    p = write_raw(tmp_path / "count.gguf", raw_list(tiny_tensors()),
                  set_keys={f"{ARCH}.block_count": (count, GGUFValueType.UINT32)})
    assert open_error(p).problem == problem


@pytest.mark.parametrize("name", ["blk.2.ffn_up_exps.weight", "blk.0.attn_norm.weight", "output_norm.weight",
                                  "token_embd.weight", "blk.3.ffn_gate_inp.weight"])
def test_missing_tensor(tmp_path, name):
    p = write(tmp_path / "missing.gguf", replace(tiny_tensors(), name, None))
    assert open_error(p).problem == f"missing tensor {name}"


@pytest.mark.parametrize("name,qtype,shape", [
    ("blk.1.attn_q.weight", T.Q8_0, (256, 512)),  # wrong row length
    ("blk.1.attn_k.weight", T.Q8_0, (64, 256)),  # wrong row count
    ("blk.0.ffn_down_exps.weight", T.IQ3_S, (15, 256, 256)),  # one expert short
    ("blk.3.ffn_gate_exps.weight", T.Q4_K, (16, 256, 512)),  # expert rows too long
    ("blk.2.attn_q_norm.weight", T.F32, (32,)),
])
def test_misshaped_tensor(tmp_path, name, qtype, shape):
    p = write(tmp_path / "shape.gguf", replace(tiny_tensors(), name, random_source(name, qtype, shape)))
    want = expected_tensors(TINY)[name][0]
    assert open_error(p).problem == f"tensor {name} has shape {list(shape)}, expected {list(want)}"


@pytest.mark.parametrize("qtype", [T.TQ1_0, T.TQ2_0, T.Q8_K, T.NVFP4, T.Q1_0],
                         ids=["TQ1_0", "TQ2_0", "Q8_K", "NVFP4", "Q1_0"])
def test_unsupported_tensor_type(tmp_path, qtype):
    """A type the model reader has no decoder for (written with GGUFWriter's raw_dtype): the error names it. NVFP4
    and Q1_0 are llama.cpp's newest (file types 39 and 40), which gguf 0.19 reads."""
    name = "blk.1.ffn_down_exps.weight"
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    nbytes = 16 * 256 * 256 // block_values * block_bytes
    data = np.frombuffer(np.random.default_rng(0).bytes(nbytes), np.uint8).reshape(16, 256, -1)
    tensors = [(n, q, a) if n != name else (n, qtype, data) for n, q, a in raw_list(tiny_tensors())]
    p = write_raw(tmp_path / "unsupported.gguf", tensors)
    assert GGUFReader(p).tensors[0].tensor_type is not None  # gguf itself reads the file
    assert open_error(p).problem == (f"tensor {name} has unsupported type {qtype.name}; supported: "
                                     f"{', '.join(t.name for t in quants.FORMATS)}")


def test_tensor_type_newer_than_gguf(tmp_path, tiny_model_path):
    """A type code the gguf package does not know (llama.cpp b11434's Q2_0 is 42): named as an unsupported type,
    not as a damaged file."""
    data = bytearray(Path(tiny_model_path).read_bytes())
    name = b"blk.1.ffn_down_exps.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (42).to_bytes(4, "little")
    p = tmp_path / "newer.gguf"
    p.write_bytes(bytes(data))
    problem = open_error(p).problem
    assert problem.startswith("a tensor of type code 42, which this version does not read (supported: ")
    assert "truncated" not in problem and "corrupt" not in problem


@pytest.mark.parametrize("name,qtype", [
    ("output_norm.weight", T.Q8_0),  # norms are float
    ("blk.1.attn_k_norm.weight", T.Q4_0),
])
def test_type_not_supported_there(tmp_path, name, qtype):
    shape = expected_tensors(TINY)[name][0]
    p = write(tmp_path / "type.gguf", replace(tiny_tensors(), name, random_source(name, qtype, shape)))
    e = open_error(p)
    assert e.problem.startswith(f"tensor {name} has type {qtype.name}, which is not supported there (supported: ")


def _table_entry(r: GGUFReader, name: str) -> tuple[int, int]:
    """File offsets of a tensor's first dimension and of its type in the tensor table."""
    f = next(t for t in r.tensors if t.name == name).field
    # parts: name length, name, n_dims, dims, type, data offset (views of the reader's mapping)
    base = r.data.ctypes.data
    return f.parts[3].ctypes.data - base, f.parts[4].ctypes.data - base


def test_not_whole_blocks(tmp_path):
    """A row that is not a whole number of blocks: the writer cannot produce one, a corrupt tensor table can."""
    name = "blk.0.attn_norm.weight"
    p = write_raw(tmp_path / "ok.gguf", raw_list(tiny_tensors()))
    data = bytearray(p.read_bytes())
    dims_off, type_off = _table_entry(GGUFReader(p), name)
    assert int.from_bytes(data[dims_off:dims_off + 8], "little") == TINY.d_model
    data[type_off:type_off + 4] = int(T.Q8_0).to_bytes(4, "little")
    data[dims_off:dims_off + 8] = (250).to_bytes(8, "little")  # 250 values: not a whole number of Q8_0 blocks
    p.write_bytes(bytes(data))
    e = open_error(p)
    assert "corrupt tensor table" in e.problem and "250" in e.problem, e.problem


# ---- metadata of the wrong type ---------------------------------------------------------------------------------
V = GGUFValueType


@pytest.mark.parametrize("key,value,vtype,found,expected", [
    ("qwen3moe.block_count", "4", V.STRING, "STRING", "an integer"),
    ("qwen3moe.expert_count", 16.0, V.FLOAT32, "FLOAT32", "an integer"),
    ("qwen3moe.context_length", True, V.BOOL, "BOOL", "an integer"),
    ("qwen3moe.rope.freq_base", "1e6", V.STRING, "STRING", "a number"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", [1e-6], V.ARRAY, "ARRAY of FLOAT32", "a number"),
    ("general.architecture", 7, V.UINT32, "UINT32", "STRING"),
    ("qwen3moe.rope.scaling.type", 2, V.UINT32, "UINT32", "STRING"),
    ("qwen3moe.rope.scaling.factor", "4", V.STRING, "STRING", "a number"),
    ("split.count", "3", V.STRING, "STRING", "an integer"),
])
def test_metadata_of_the_wrong_type(tmp_path, key, value, vtype, found, expected):
    """Every type error names the file, the key, the type expected and the type found (block_count as a string
    used to surface as int()'s 'invalid literal')."""
    p = write_raw(tmp_path / "typed.gguf", raw_list(tiny_tensors()), set_keys={key: (value, vtype)})
    e = open_error(p)
    assert e.problem.startswith(f"metadata key {key} has type {found}, expected {expected}"), e.problem


def test_integer_widths_and_float64_accepted(tmp_path):
    """Any integer width (a converter may write UINT64) and FLOAT64 are the same values."""
    p = write_raw(tmp_path / "wide.gguf", raw_list(tiny_tensors()),
                  set_keys={"qwen3moe.block_count": (4, V.UINT64), "qwen3moe.rope.freq_base": (1e6, V.FLOAT64),
                            "qwen3moe.attention.head_count": (4, V.INT16)})
    m = ModelFile(p)
    assert m.config == TINY
    m.close()


def test_tokenizer_without_merges(tmp_path):
    p = write_raw(tmp_path / "nomerges.gguf", raw_list(tiny_tensors()), drop_keys=("tokenizer.ggml.merges",))
    m = ModelFile(p)  # the tensors are fine; the tokenizer is read when first used (the daemon: at start)
    with pytest.raises(ModelFormatError) as ei:
        m.tokenizer
    assert str(ei.value).startswith(f"{p}: ") and "tokenizer.ggml.merges" in ei.value.problem
    m.close()


# ---- RoPE scaling keys --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [RopeScaling("yarn", 4.0, 2048), RopeScaling("linear", 2.0),
                                     RopeScaling("yarn", 8.0, 1024, attn_factor=0.5)])
def test_rope_scaling_round_trips(tmp_path, scaling):
    c = dataclasses.replace(TINY, rope_scaling=scaling)
    m = ModelFile(write(tmp_path / "scaled.gguf", tiny_tensors(), config=c))
    assert m.config == c
    assert m.meta("qwen3moe.rope.scaling.type") == scaling.kind
    m.close()


def test_rope_scaling_llama_cpp_defaults(tmp_path):
    """As llama.cpp reads them: a factor without a type is linear, yarn's original length defaults to the trained
    one, a factor of 0 means none, the yarn keys (ext_factor, betas) are read."""
    def scaling(keys):
        m = ModelFile(write_raw(tmp_path / "k.gguf", raw_list(tiny_tensors()), set_keys=keys))
        r = m.config.rope_scaling
        m.close()
        return r

    assert scaling({"qwen3moe.rope.scaling.factor": (2.0, V.FLOAT32)}) == RopeScaling("linear", 2.0)
    assert scaling({"qwen3moe.rope.scaling.factor": (0.0, V.FLOAT32)}) == RopeScaling()
    assert scaling({"qwen3moe.rope.scaling.type": ("yarn", V.STRING), "qwen3moe.rope.scaling.factor": (4.0, V.FLOAT32),
                    "qwen3moe.rope.scaling.yarn_beta_fast": (16.0, V.FLOAT32)}) == \
        RopeScaling("yarn", 4.0, TINY.context_length, beta_fast=16.0)


@pytest.mark.parametrize("keys,msg", [
    ({"qwen3moe.rope.scaling.type": ("longrope", V.STRING)}, "rope scaling type 'longrope' is not supported"),
    ({"qwen3moe.rope.scaling.type": ("yarn", V.STRING), "qwen3moe.rope.scaling.factor": (0.5, V.FLOAT32)},
     "rope scaling factor must be >= 1, got 0.5"),
    ({"qwen3moe.rope.scaling.type": ("yarn", V.STRING), "qwen3moe.rope.scaling.factor": (4.0, V.FLOAT32),
      "qwen3moe.rope.scaling.yarn_log_multiplier": (0.1, V.FLOAT32)}, "yarn_log_multiplier is not supported"),
    # not finite (the context length is the original's times the factor: inf made serving's int() overflow)
    ({"qwen3moe.rope.scaling.factor": (math.inf, V.FLOAT32)}, "rope scaling factor must be finite, got inf"),
    ({"qwen3moe.rope.scaling.type": ("yarn", V.STRING), "qwen3moe.rope.scaling.factor": (4.0, V.FLOAT32),
      "qwen3moe.rope.scaling.attn_factor": (math.nan, V.FLOAT32)}, "rope scaling attn_factor must be finite, got nan"),
    ({"qwen3moe.rope.freq_base": (math.nan, V.FLOAT32)}, "rope_base must be positive and finite, got nan"),
    ({"qwen3moe.attention.layer_norm_rms_epsilon": (math.inf, V.FLOAT32)}, "rms_eps must be positive and finite"),
])
def test_unservable_rope_scaling_and_norm_values(tmp_path, keys, msg):
    assert msg in open_error(write_raw(tmp_path / "r.gguf", raw_list(tiny_tensors()), set_keys=keys)).problem
