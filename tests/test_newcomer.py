"""A newcomer's first commands: `stratad make-model` into a folder that does not exist yet (or cannot be written),
and `make demo`, which says its model's text is random and shows the next turn reusing the first one's KV."""
from __future__ import annotations

import os
import re

import pytest

from daemon_harness import ROOT  # noqa: F401 - sets PYTHONPATH for the demo's daemon
from stratad import cli, demo
from stratad.model.gguf_file import ModelFile


def test_make_model_creates_the_folders(tmp_path, capsys):
    out = tmp_path / "var" / "lib" / "stratad" / "model.gguf"
    assert cli.main(["make-model", "--out", str(out)]) == 0
    assert out.stat().st_size > 0


@pytest.mark.parametrize("case", ["parent is a file", "read-only folder"])
def test_make_model_cannot_write_says_where_in_one_line(tmp_path, capsys, case):
    if case == "parent is a file":
        (tmp_path / "file").write_text("")
        out, named = tmp_path / "file" / "model.gguf", tmp_path / "file"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        (tmp_path / "ro").mkdir(mode=0o500)
        out, named = tmp_path / "ro" / "sub" / "model.gguf", tmp_path / "ro" / "sub"
    assert cli.main(["make-model", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {named}: ") and len(err.strip().splitlines()) == 1


def test_demo_says_the_text_is_random_and_reuses_the_first_turn(tiny_model_path, capsys):
    assert demo.main(["--model", str(tiny_model_path), "--cards", "cpu,cpu", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    note = out.index("random weights")
    assert note < out.index("[chat 0]") and note < out.index("[chat 1]")
    m = re.search(r"next turn \(lane \d\): (\d+) prompt tokens, (\d+) of them reused from the first turn", out)
    assert m, out
    prompt, reused = int(m[1]), int(m[2])
    tok = ModelFile(tiny_model_path).tokenizer
    first = len(tok.encode(tok.apply_chat_template(demo.CHATS[0])))
    assert first >= 64 and first <= reused < prompt  # past coordinator PREFIX_MIN: the first turn's lane took it
