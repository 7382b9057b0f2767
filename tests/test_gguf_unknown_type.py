"""A tensor type code the gguf package does not know is told from damage by the code itself (checked against
GGMLQuantizationType's values), not by the wording of gguf's error: a gguf release that rewords it (or raises
something else for it) still gives "a tensor of type code N", never "truncated or corrupt"."""
from __future__ import annotations

from pathlib import Path

import gguf.gguf_reader
import pytest

from stratad.model.errors import ModelFormatError
from stratad.model.gguf_file import ModelFile


def with_type_code(src: Path, dst: Path, code: int, name: bytes = b"blk.1.ffn_down_exps.weight") -> Path:
    data = bytearray(src.read_bytes())
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = code.to_bytes(4, "little")
    dst.write_bytes(bytes(data))
    return dst


def problem(path: Path) -> str:
    with pytest.raises(ModelFormatError) as e:
        ModelFile(path)
    return e.value.problem


@pytest.mark.parametrize("code", [42, 0xFFFF_FFFF])
def test_an_unknown_code_is_named_whatever_gguf_says(tiny_model_path, tmp_path, monkeypatch, code):
    real = gguf.gguf_reader.GGMLQuantizationType

    def reworded(value):
        try:
            return real(value)
        except ValueError:
            raise ValueError("unsupported quantisation") from None

    monkeypatch.setattr(gguf.gguf_reader, "GGMLQuantizationType", reworded)
    p = with_type_code(Path(tiny_model_path), tmp_path / "newer.gguf", code)
    got = problem(p)
    assert got.startswith(f"a tensor of type code {code}, which this version does not read (supported: "), got
    assert "truncated" not in got and "corrupt" not in got


def test_a_known_code_on_a_short_file_is_still_damage(tiny_model_path, tmp_path):
    data = Path(tiny_model_path).read_bytes()
    p = tmp_path / "short.gguf"
    p.write_bytes(data[:len(data) // 2])
    assert "truncated" in problem(p)
