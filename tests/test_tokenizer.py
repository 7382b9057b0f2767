"""Tokenizer: generated vocabulary, GGUF metadata round trip, encode/decode, streaming, chat template, errors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import gguf
import pytest

from stratad.model import generated_vocab as gv
from stratad.model import tokenizer as tk
from stratad.model.errors import ModelFormatError
from stratad.model.generated_vocab import build_vocab, write_tokenizer
from stratad.model.tokenizer import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, Tokenizer, Vocab

REPO = Path(__file__).resolve().parents[1]
TINY = 1024

ROUND_TRIP_TEXTS = [
    "",
    "Hello, world!",
    "The expert cache on the GPU holds 128 experts; 0.98 hit rate.",
    "punctuation: ()[]{} <>\"'`~!@#$%^&*-_=+\\|/?,.;:",
    "line one\nline two\r\n\n\n  indented\ttab  trailing   \n",
    "   leading spaces and    runs of     spaces",
    "don't you'll we've I'M THEY'RE it's",
    "café naïve façade résumé Zürich smörgåsbord crème brûlée e\u0301 (decomposed)",
    "日本語のテキストと中文字符，还有한국어",
    "emoji: 🤖👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 and ❤️",
    "math ∑∫√∞ ≠ ≤ ≥ and arrows → ← ↔",
    "mixed 123456789 digits 151936 and code: if (x > y) { f(x); }",
    "<|im_start|>user\nhi<|im_end|>\n<think>hmm</think> done<|endoftext|>",
    "almost special: <|im_start and im_end|> and <think and /think>",
    "\x00\x01\x7f control bytes and \u200b zero width",
]


def _write_gguf(path: Path, vocab: Vocab | None = None, kv=None) -> Path:
    """A GGUF with general.architecture and tokenizer metadata only (no tensors).

    vocab: written with write_tokenizer. kv: list of (method name, value) called on the writer instead.
    """
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    if vocab is not None:
        write_tokenizer(w, vocab)
    for method, value in kv or []:
        getattr(w, method)(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _kv_from_vocab(v: Vocab, **override):
    kv = {
        "add_tokenizer_model": "gpt2",
        "add_tokenizer_pre": "qwen2",
        "add_token_list": v.tokens,
        "add_token_types": v.token_types,
        "add_token_merges": v.merges,
        "add_eos_token_id": v.eos_id,
        "add_pad_token_id": v.pad_id,
        "add_bos_token_id": v.bos_id,
        "add_add_bos_token": False,
        "add_chat_template": v.chat_template,
    }
    kv.update(override)
    return [(k, val) for k, val in kv.items() if val is not None]


@pytest.fixture(scope="module")
def tiny_vocab() -> Vocab:
    return build_vocab(TINY)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_vocab) -> Path:
    return _write_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf", tiny_vocab)


@pytest.fixture(scope="module")
def tok(tiny_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(tiny_gguf), tiny_gguf)


# ---------------------------------------------------------------------------------------------------- vocabulary


def test_tiny_vocab_layout(tiny_vocab):
    v = tiny_vocab
    assert len(v.tokens) == len(v.token_types) == TINY
    n_bpe = TINY - 5
    assert all(t == gguf.TokenType.NORMAL for t in v.token_types[:n_bpe])
    assert v.tokens[n_bpe : n_bpe + 5] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    assert v.token_types[n_bpe : n_bpe + 5] == [3, 3, 3, 4, 4]  # CONTROL x3, USER_DEFINED x2
    assert v.tokens[v.eos_id] == "<|im_end|>"
    assert v.tokens[v.pad_id] == v.tokens[v.bos_id] == "<|endoftext|>"
    assert v.add_bos_token is False
    assert len(set(v.tokens)) == TINY
    # every merge is "a b" over known tokens, and the BPE tokens are the 256 byte tokens plus one per merge
    known = set(v.tokens)
    for m in v.merges:
        a, b = m.split(" ")
        assert a in known and b in known and a + b in known
    assert len(v.merges) == n_bpe - 256
    assert set(tk.BYTE_TO_CHAR.values()) <= set(v.tokens[:256])


def test_build_vocab_a3b_size_types_and_speed():
    t0 = time.perf_counter()
    v = build_vocab(151936)
    dt = time.perf_counter() - t0
    assert dt < 10.0, f"build_vocab(151936) took {dt:.1f} s"
    assert len(v.tokens) == len(v.token_types) == 151936
    n_bpe = gv.BPE_MAX_TOKENS
    assert v.token_types[:n_bpe] == [int(gguf.TokenType.NORMAL)] * n_bpe
    assert v.tokens[n_bpe : n_bpe + 3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert v.token_types[n_bpe : n_bpe + 5] == [3, 3, 3, 4, 4]
    assert v.token_types[n_bpe + 5 :] == [int(gguf.TokenType.UNUSED)] * (151936 - n_bpe - 5)
    assert v.tokens[n_bpe + 5] == f"[PAD{n_bpe + 5}]" and v.tokens[-1] == "[PAD151935]"
    assert v.eos_id == n_bpe + 2 and v.pad_id == v.bos_id == n_bpe
    assert len(set(v.tokens)) == 151936
    # The padded vocabulary still builds a working tokenizer.
    t = Tokenizer.from_vocab(v)
    text = "The lane borrows an expert from its peer card. 🤖"
    assert t.decode(t.encode(text)) == text
    assert t.encode("<|im_end|>") == [v.eos_id]
    assert t.encode("[PAD2005]") != [2005]  # UNUSED tokens are not matched in text


def test_build_vocab_too_small():
    with pytest.raises(ValueError, match="too small"):
        build_vocab(200)
    assert len(build_vocab(261).tokens) == 261  # bytes + specials only, no merges
    assert build_vocab(261).merges == []


def test_build_vocab_deterministic_in_process():
    a, b = build_vocab(TINY), build_vocab(TINY)
    assert a == b
    assert a.tokens is not b.tokens  # callers may not share (and corrupt) each other's lists
    assert build_vocab(151936) == build_vocab(151936)


def _vocab_digest(v: Vocab) -> str:
    return hashlib.sha256(json.dumps(dataclasses.asdict(v), sort_keys=True).encode()).hexdigest()


def test_build_vocab_deterministic_across_processes():
    code = (
        "import dataclasses, hashlib, json; from stratad.model.generated_vocab import build_vocab; "
        "print(*[hashlib.sha256(json.dumps(dataclasses.asdict(build_vocab(n)), sort_keys=True).encode())"
        ".hexdigest() for n in (1024, 151936)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == [_vocab_digest(build_vocab(1024)), _vocab_digest(build_vocab(151936))]


def test_committed_bpe_matches_training():
    """data/bpe.json is what BpeTrainer makes of data/corpus.txt (regenerate: python -m
    stratad.model.generated_vocab --regenerate), and a smaller vocabulary is exactly what a smaller training run
    gives."""
    import tokenizers

    data = json.loads(gv.BPE_PATH.read_text(encoding="utf-8"))
    assert data["corpus_sha256"] == hashlib.sha256(gv.CORPUS_PATH.read_bytes()).hexdigest(), (
        "corpus.txt changed: regenerate bpe.json"
    )
    assert len(data["tokens"]) == gv.BPE_MAX_TOKENS
    if data["tokenizers_version"] != tokenizers.__version__:
        pytest.skip(f"bpe.json was trained with tokenizers {data['tokenizers_version']}")
    corpus = gv.CORPUS_PATH.read_text(encoding="utf-8")
    tokens, merges = gv.train_bpe(corpus, gv.BPE_MAX_TOKENS)
    assert tokens == data["tokens"] and merges == data["merges"]
    tokens, merges = gv.train_bpe(corpus, TINY - 5)
    v = build_vocab(TINY)
    assert v.tokens[: TINY - 5] == tokens and v.merges == merges


# ---------------------------------------------------------------------------------------------------- GGUF


def test_gguf_metadata_keys(tiny_gguf, tiny_vocab):
    r = gguf.GGUFReader(tiny_gguf)
    f = r.fields
    assert f["general.architecture"].contents() == "qwen3moe"
    assert f["tokenizer.ggml.model"].contents() == "gpt2"
    assert f["tokenizer.ggml.pre"].contents() == "qwen2"
    assert f["tokenizer.ggml.tokens"].contents() == tiny_vocab.tokens
    assert f["tokenizer.ggml.token_type"].contents() == tiny_vocab.token_types
    assert f["tokenizer.ggml.merges"].contents() == tiny_vocab.merges
    assert f["tokenizer.ggml.eos_token_id"].contents() == tiny_vocab.eos_id
    assert f["tokenizer.ggml.padding_token_id"].contents() == tiny_vocab.pad_id
    assert f["tokenizer.ggml.bos_token_id"].contents() == tiny_vocab.bos_id
    assert f["tokenizer.ggml.add_bos_token"].contents() is False
    assert f["tokenizer.chat_template"].contents() == DEFAULT_CHAT_TEMPLATE


def test_tokenizer_properties(tok, tiny_vocab):
    assert tok.vocab_size == TINY
    assert tok.eos_id == tiny_vocab.eos_id
    assert tok.stop_ids == {tiny_vocab.eos_id, tiny_vocab.tokens.index("<|endoftext|>")}
    assert tok.token_text(tok.eos_id) == "<|im_end|>"
    assert tok.token_text(256) == tiny_vocab.tokens[256]
    with pytest.raises(ValueError):
        tok.token_text(TINY)


# ---------------------------------------------------------------------------------------------------- encode/decode


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tok, text):
    """Decoding gives the text back, NFC-normalised as Hugging Face's Qwen2 tokenizer normalises it (only the
    decomposed e + U+0301 of one text changes)."""
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == _nfc(text)
    assert tok.hf.decode(ids, skip_special_tokens=False) == _nfc(text)  # agrees with the tokenizers library
    assert tok.hf.encode(text, add_special_tokens=False).ids == ids


def test_nfc_normalisation(tok):
    assert unicodedata.normalize("NFC", "e\u0301") == "\u00e9"
    assert tok.encode("caf" + "e\u0301 ok") == tok.encode("caf\u00e9 ok")
    assert tok.decode(tok.encode("e\u0301")) == "\u00e9"


def test_bpe_merges_are_used(tok):
    # Frequent corpus words are single tokens with the leading space folded in.
    for word in (" the", " expert", " cache"):
        assert len(tok.encode(word)) == 1, word
    assert len(tok.encode("the expert cache")) < len("the expert cache")


@pytest.mark.parametrize("special", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
def test_special_tokens_encode_to_one_id(tok, tiny_vocab, special):
    sid = tiny_vocab.tokens.index(special)
    assert tok.encode(special) == [sid]
    ids = tok.encode(f"before{special}after")
    assert ids.count(sid) == 1
    assert tok.decode(ids) == f"before{special}after"


def test_encode_plain_text(tok, tiny_vocab):
    """special=False: added tokens in the text are text (what encode_chat does with the caller's strings)."""
    text = "a<|im_end|>b<think>c"
    ids = tok.encode(text, special=False)
    assert not set(ids) & {tiny_vocab.tokens.index(t) for t in ("<|im_end|>", "<think>")}
    assert tok.decode(ids) == text
    assert tok.encode("no specials here", special=False) == tok.encode("no specials here")


def test_decode_skip_special(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><think>x</think>")
    assert tok.decode(ids, skip_special=True) == "user\nhi<think>x</think>"


# ---------------------------------------------------------------------------------------------------- streaming


def _stream(tok, ids):
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_stream_decoder_matches_decode(tok, text):
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == _nfc(text)
    assert tail == ""
    assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_holds_back_split_emoji(tok):
    text = "ok 🤖👍🏽!"
    ids = tok.encode(text)
    # The emoji are not in the vocabulary: each is spread over several byte tokens.
    assert any(len(tok.token_bytes(i)) < 4 and tok.token_bytes(i)[0] >= 0x80 for i in ids)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == text
    assert "" in pieces  # some tokens completed no character
    for p in pieces:  # every piece is whole characters
        assert "\ufffd" not in p
        p.encode("utf-8")  # no lone surrogates
    # The emoji text appears only once all of its bytes have arrived.
    assert "🤖" in pieces


def test_stream_decoder_flush_unfinished_character(tok):
    ids = tok.encode("a🤖")
    cut = ids[:-1]  # the emoji's last byte never comes
    pieces, tail = _stream(tok, cut)
    assert "".join(pieces) == "a"
    assert tail == "\ufffd"
    assert "".join(pieces) + tail == tok.decode(cut)


def test_stream_decoder_one_token_at_a_time_after_flush(tok):
    dec = tok.stream_decoder()
    first = tok.encode("first 🤖")
    out = "".join(dec.push(i) for i in first) + dec.flush()
    second = tok.encode(" second")
    out2 = "".join(dec.push(i) for i in second) + dec.flush()
    assert (out, out2) == ("first 🤖", " second")


# ---------------------------------------------------------------------------------------------------- chat


def test_chat_template_two_messages(tok):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    )
    ids = tok.encode(tok.apply_chat_template(msgs))
    im_start = tok.encode("<|im_start|>")[0]
    assert ids.count(im_start) == 3 and ids.count(tok.eos_id) == 2


def test_chat_template_rejects_bad_message(tok):
    with pytest.raises(ChatTemplateError, match="string content"):
        tok.apply_chat_template([{"role": "user"}])


def test_chat_template_is_sandboxed(tmp_path, tiny_vocab):
    v = dataclasses.replace(tiny_vocab, chat_template="{{ messages.__class__.__mro__ }}")
    path = _write_gguf(tmp_path / "evil.gguf", v)
    t = Tokenizer.from_gguf(gguf.GGUFReader(path), path)
    with pytest.raises(ChatTemplateError):
        t.apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------------- errors


def _load(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(path), path)


def _expect_error(path: Path, *needles: str) -> ModelFormatError:
    with pytest.raises(ModelFormatError) as ei:
        _load(path)
    err = ei.value
    assert err.path == str(path)
    for n in needles:
        assert n in err.problem, (n, err.problem)
    return err


def test_error_no_tokens(tmp_path, tiny_vocab):
    path = _write_gguf(tmp_path / "notokens.gguf", kv=_kv_from_vocab(tiny_vocab, add_token_list=None))
    _expect_error(path, "tokenizer.ggml.tokens", "missing")


def test_error_no_tokenizer_at_all(tmp_path):
    path = _write_gguf(tmp_path / "bare.gguf")
    _expect_error(path, "tokenizer.ggml.model", "missing")


def test_error_wrong_model(tmp_path, tiny_vocab):
    path = _write_gguf(tmp_path / "llama.gguf", kv=_kv_from_vocab(tiny_vocab, add_tokenizer_model="llama"))
    _expect_error(path, "tokenizer.ggml.model", "'llama'", "gpt2")


@pytest.mark.parametrize("pre", ["llama-bpe", "deepseek-llm", "default"])
def test_error_unknown_pre_tokenizer(tmp_path, tiny_vocab, pre):
    """A pre-tokenizer without an implementation is refused by name, never split with the qwen2 regex."""
    path = _write_gguf(tmp_path / "pre.gguf", kv=_kv_from_vocab(tiny_vocab, add_tokenizer_pre=pre))
    _expect_error(path, "tokenizer.ggml.pre", repr(pre), "not implemented", "qwen2")


def test_error_missing_pre_tokenizer(tmp_path, tiny_vocab):
    path = _write_gguf(tmp_path / "nopre.gguf", kv=_kv_from_vocab(tiny_vocab, add_tokenizer_pre=None))
    _expect_error(path, "tokenizer.ggml.pre", "missing", "qwen2")


def test_error_merge_with_unknown_token(tmp_path, tiny_vocab):
    merges = tiny_vocab.merges + ["Ġexpert zzzunknown"]
    path = _write_gguf(tmp_path / "merges.gguf", kv=_kv_from_vocab(tiny_vocab, add_token_merges=merges))
    _expect_error(path, "tokenizer.ggml.merges", "unknown token", "zzzunknown")


def test_error_malformed_merge(tmp_path, tiny_vocab):
    merges = ["Ġ t x"] + tiny_vocab.merges
    path = _write_gguf(tmp_path / "merges2.gguf", kv=_kv_from_vocab(tiny_vocab, add_token_merges=merges))
    _expect_error(path, "tokenizer.ggml.merges[0]", "'a b'")


def test_error_eos_out_of_range(tmp_path, tiny_vocab):
    path = _write_gguf(tmp_path / "eos.gguf", kv=_kv_from_vocab(tiny_vocab, add_eos_token_id=TINY + 7))
    _expect_error(path, "tokenizer.ggml.eos_token_id", str(TINY + 7), "out of range")


def test_error_missing_eos(tmp_path, tiny_vocab):
    path = _write_gguf(tmp_path / "noeos.gguf", kv=_kv_from_vocab(tiny_vocab, add_eos_token_id=None))
    _expect_error(path, "tokenizer.ggml.eos_token_id", "missing")


def test_error_token_type_count(tmp_path, tiny_vocab):
    types = tiny_vocab.token_types[:-3]
    path = _write_gguf(tmp_path / "types.gguf", kv=_kv_from_vocab(tiny_vocab, add_token_types=types))
    _expect_error(path, "tokenizer.ggml.token_type", f"{TINY - 3} entries", f"{TINY} tokens")


def test_error_chat_template_does_not_compile(tmp_path, tiny_vocab):
    path = _write_gguf(tmp_path / "tpl.gguf", kv=_kv_from_vocab(tiny_vocab, add_chat_template="{% for x in %}"))
    _expect_error(path, "tokenizer.chat_template", "does not compile")


def test_missing_chat_template_falls_back_to_default(tmp_path, tiny_vocab):
    path = _write_gguf(tmp_path / "notpl.gguf", kv=_kv_from_vocab(tiny_vocab, add_chat_template=None))
    assert _load(path).chat_template == DEFAULT_CHAT_TEMPLATE
