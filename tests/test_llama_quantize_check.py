"""scripts/llama_quantize_check.py's own bookkeeping, without llama.cpp: a stand-in `llama-quantize` that copies its
float input (every tensor stays F32, not the type asked for; general.file_type says the one asked for): the exit
status follows the checks (types that are
not mixes.py's with an importance matrix fail it), and the temporary folder and the imatrix are deleted."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from stratad.model.generator import make_model

ROOT = Path(__file__).resolve().parents[1]

FAKE = f"""#!{sys.executable}
import shutil, sys
import gguf
args = sys.argv[1:]
if args[0] == "--imatrix":
    args = args[2:]
src, out, ftype, threads = args
print("version: 0 (stand-in)")
shutil.copy(src, out)
r = gguf.GGUFReader(out, "r+")  # the file type asked for, as llama-quantize writes it
r.fields["general.file_type"].parts[-1][0] = gguf.LlamaFileType["MOSTLY_" + ftype]
"""


@pytest.fixture(scope="module")
def lq():
    spec = importlib.util.spec_from_file_location("llama_quantize_check", ROOT / "scripts" / "llama_quantize_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llq")
    src = tmp / "f32.gguf"
    make_model(src, "tiny", mix="f32", seed=3)
    fake = tmp / "llama-quantize"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    return src, fake


def test_failures_name_what_failed(lq):
    ok = {"rc": 0, "file_type": "Q4_K_M", "imatrix": "uniform", "loads": True, "greedy_ok": True,
          "stratad_decode_exact": True, "file_type_key_ok": True, "types_match": True}
    assert lq.failures([ok, {"rc": 1, "file_type": "IQ1_S", "imatrix": "none"}]) == []
    assert lq.failures([ok | {"imatrix": "none", "types_match": False, "differences": [{}]}]) == []
    (f,) = lq.failures([ok | {"types_match": False, "differences": [{}, {}]}])
    assert f == "Q4_K_M (uniform imatrix): 2 tensor types differ from mixes.py's"
    (f,) = lq.failures([ok | {"stratad_decode_exact": False, "stratad_decode_differs": ["blk.0.x (Q4_K)"]}])
    assert "stratad's decoding differs from gguf-py's: blk.0.x (Q4_K)" in f
    (f,) = lq.failures([ok | {"loads": False, "load_error": "ValueError: x"}])
    assert "does not load (ValueError: x)" in f


def test_exit_status_follows_the_checks_and_the_temporary_folder_goes(lq, setup, tmp_path, monkeypatch, capsys):
    """Q8_0 asked for, F32 written: it loads, generates and decodes (nothing quantised to compare), but with the
    uniform imatrix its tensors' types are not mixes.py's: exit 1, naming it. Without --work the temporary folder
    (the imatrix, the outputs) is gone afterwards."""
    src, fake = setup
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "r.json"
    rc = lq.main(["--llama-quantize", str(fake), "--model", str(src), "--types", "Q8_0", "--json", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "FAILED Q8_0 (uniform imatrix):" in err and "tensor types differ from mixes.py's" in err, err
    assert "FAILED Q8_0 (none imatrix)" not in err  # the rules that need an imatrix: reported, not failed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["imatrix"], r["loads"], r["greedy_ok"], r["types_match"]) for r in rows] == [
        ("none", True, True, False), ("uniform", True, True, False)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no llq-* folder left


def test_a_given_work_folder_keeps_only_what_was_asked(lq, setup, tmp_path):
    src, fake = setup
    work = tmp_path / "work"
    lq.run_check(str(fake), src, ["Q8_0"], ["uniform"], work=work, log=lambda s: None)
    assert list(work.iterdir()) == []  # the imatrix and the output deleted, the folder the caller's
    lq.run_check(str(fake), src, ["Q8_0"], ["uniform"], work=work, keep=True, log=lambda s: None)
    assert sorted(p.name for p in work.iterdir()) == ["Q8_0-imatrix.gguf", "uniform.imatrix.gguf"]


def test_a_passing_file_exits_0(lq, setup, tmp_path, monkeypatch):
    """The same stand-in, compared without an imatrix only: nothing that counts fails."""
    src, fake = setup
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert lq.main(["--llama-quantize", str(fake), "--model", str(src), "--types", "Q8_0", "--imatrix", "none"]) == 0
    assert os.listdir(tmp_path) == []
