"""The tokenizer on the real Qwen2/Qwen3 vocabulary (tests/data/realdata): llama.cpp's test vectors, NFC, added
tokens, the pre-tokenizer key, streaming of characters split over tokens."""
from __future__ import annotations

import unicodedata

import gguf
import pytest

import realvocab as rv
from stratad.model.tokenizer import Tokenizer

VECTORS = rv.llama_cpp_vectors()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return rv.qwen2()


@pytest.fixture(scope="module")
def q3() -> Tokenizer:
    return rv.qwen3()


def test_real_vocab_metadata(tok):
    f = rv.reader().fields
    assert f["tokenizer.ggml.pre"].contents() == "qwen2" and tok.pre == "qwen2"
    assert tok.vocab_size == rv.N_VOCAB == len(f["tokenizer.ggml.tokens"].data)
    assert len(f["tokenizer.ggml.merges"].data) == 151387
    assert tok.eos_id == rv.ENDOFTEXT and tok.stop_ids == {rv.ENDOFTEXT}
    assert len(VECTORS) == 46


@pytest.mark.parametrize("k", range(len(VECTORS)))
def test_llama_cpp_vector(tok, k):
    text, expected = VECTORS[k]
    assert tok.encode(text) == expected
    assert tok.decode(expected) == text


def test_vectors_are_nfc_and_nfc_is_applied(tok):
    """Hugging Face's Qwen2 tokenizer NFC-normalises, llama.cpp does not: they can differ only on text that is not
    NFC, and none of llama.cpp's vectors is. On such text we give Hugging Face's ids (and decode to the NFC text)."""
    assert all(unicodedata.is_normalized("NFC", text) for text, _ in VECTORS)
    composed, decomposed = "Caf\u00e9 cr\u00e8me", "Cafe\u0301 cre\u0300me"
    assert tok.encode(decomposed) == tok.encode(composed) == tok.hf.encode(decomposed, add_special_tokens=False).ids
    assert tok.decode(tok.encode(decomposed)) == composed
    # Without the normalisation (llama.cpp's way) the decomposed text gives other ids.
    raw = [t.id for w, _ in tok.hf.pre_tokenizer.pre_tokenize_str(decomposed) for t in tok.hf.model.tokenize(w)]
    assert raw != tok.encode(composed)


def test_agrees_with_the_tokenizers_library(tok):
    texts = [t for t, _ in VECTORS] + ["<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b [PAD151650] c"]
    for text in texts:
        assert tok.encode(text) == tok.hf.encode(text, add_special_tokens=False).ids, text


def test_added_tokens_are_one_id(tok, q3):
    """Every CONTROL / USER_DEFINED token is one id in text (encode) and none when the text is plain."""
    for t, ids in ((tok, range(rv.FIRST_ADDED, rv.N_VOCAB)), (q3, range(rv.FIRST_ADDED, rv.FIRST_ADDED + 26))):
        for i in ids:
            assert t.token_type(i) in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
            text = t.token_text(i)
            assert t.encode(text) == [i], text
            assert t.encode(f"x{text}y") == t.encode("x") + [i] + t.encode("y")
            assert i not in t.encode(text, special=False)
            assert t.decode(t.encode(text, special=False)) == text
    assert [q3.token_text(i) for i in (rv.THINK, rv.THINK_END, rv.TOOL_CALL, rv.TOOL_RESPONSE)] == [
        "<think>", "</think>", "<tool_call>", "<tool_response>"]


@pytest.mark.parametrize("text", [
    "日本語の文章と稀な漢字：龘靐齉爩 鬱鬯 彁, 𠀀𠮷; 한국어 쀍똠",
    "emoji 🦙🫠🧑🏽‍💻 and flags 🇯🇵🇳🇴, a rare one 𓀀 and ❤️‍🔥",
])
def test_stream_decoder_holds_split_characters(tok, text):
    """With the real vocabulary many CJK characters and emoji are spread over tokens whose bytes are not whole
    UTF-8; the stream decoder emits each character only once all of its bytes have come."""
    ids = tok.encode(text)
    partial = [i for i in ids if _incomplete(tok.token_bytes(i))]
    assert partial, "the text should have characters split over tokens"
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert dec.flush() == ""
    assert "".join(pieces) == text == tok.decode(ids)
    assert "" in pieces and all("\ufffd" not in p for p in pieces)
    # cut before a split character's last token: everything before it comes out, the rest is one U+FFFD at flush
    k = ids.index(partial[0])
    dec = tok.stream_decoder()
    head = "".join(dec.push(i) for i in ids[: k + 1])
    assert text.startswith(head) and dec.flush() == "\ufffd"


def _incomplete(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True
