"""The real Qwen vocabulary and chat templates of tests/data/realdata, loaded once per test process.

`qwen2()` is `Tokenizer.from_gguf` on llama.cpp's ggml-vocab-qwen2.gguf (decompressed to a temporary file; gguf's
reader takes ~7 s on a 2-core box, so every test module shares one load). `qwen3(template)` is the same BPE with
Qwen3's added tokens at their Qwen3 ids (listed below, from Qwen3's tokenizer_config.json) in place of the file's
[PAD] fillers, and a chat template: the layout a Qwen3 GGUF from llama.cpp's converter has.
"""
from __future__ import annotations

import atexit
import lzma
import shutil
import tempfile
from functools import cache
from pathlib import Path

import gguf

from stratad.model.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parent / "data" / "realdata"
VOCAB_XZ = DATA / "ggml-vocab-qwen2.gguf.xz"
QWEN3_TEMPLATE = DATA / "Qwen-Qwen3-0.6B.jinja"
CODER_TEMPLATE = DATA / "Qwen3-Coder.jinja"

N_VOCAB = 151936
# Qwen3's added tokens from id 151643 on: (text, special). Special ones are CONTROL in a GGUF, the others
# USER_DEFINED (llama.cpp's converter).
QWEN3_ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
FIRST_ADDED = 151643
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END, THINK, THINK_END = (
    151657, 151658, 151665, 151666, 151667, 151668)


@cache
def vocab_path() -> Path:
    d = Path(tempfile.mkdtemp(prefix="stratad-realvocab-"))
    atexit.register(shutil.rmtree, d, True)
    path = d / "ggml-vocab-qwen2.gguf"
    path.write_bytes(lzma.decompress(VOCAB_XZ.read_bytes()))
    return path


@cache
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(vocab_path())


@cache
def qwen2() -> Tokenizer:
    return Tokenizer.from_gguf(reader(), vocab_path())


@cache
def _qwen3_base() -> Tokenizer:
    f = reader().fields
    tokens = list(f["tokenizer.ggml.tokens"].contents())
    types = list(f["tokenizer.ggml.token_type"].contents())
    for k, (text, special) in enumerate(QWEN3_ADDED):
        i = FIRST_ADDED + k
        assert i < 151646 or tokens[i] == f"[PAD{i}]", tokens[i]  # only fillers are replaced
        tokens[i] = text
        types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    return Tokenizer(tokens, types, f["tokenizer.ggml.merges"].contents(), IM_END, bos_id=ENDOFTEXT,
                     pad_id=ENDOFTEXT, path="<qwen3 layout of ggml-vocab-qwen2>")


@cache
def qwen3(template: Path = QWEN3_TEMPLATE) -> Tokenizer:
    return _qwen3_base().with_chat_template(template.read_text(encoding="utf-8"))


def llama_cpp_vectors() -> list[tuple[str, list[int]]]:
    """(text, llama.cpp's ids) for each test vector."""
    inp, out = (open(DATA / f"ggml-vocab-qwen2.gguf.{ext}", encoding="utf-8", newline="").read()
                for ext in ("inp", "out"))
    sep = "\n__ggml_vocab_test__\n"
    assert inp.endswith(sep)
    texts = inp[: -len(sep)].split(sep)
    lines = out.split("\n")
    assert lines[-1] == "" and len(lines) - 1 == len(texts), (len(lines), len(texts))
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]
