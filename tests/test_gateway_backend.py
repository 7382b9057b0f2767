"""The gateway's Model (stratad/gateway/backend.py) remembers the prompt it rendered last only by a digest and its
tokens: room() then as_tokens() on one request render it once, another input renders again, and the request's
input itself (a big body's messages, in the intake worker) is not kept alive until the next request."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

from tiny_models import tiny_with_template
from stratad.gateway import backend
from stratad.gateway.backend import Model

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "realdata" / "Qwen-Qwen3-0.6B.jinja").read_text()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model(tiny_with_template(tmp_path_factory.mktemp("gwbackend") / "tiny-qwen3.gguf", QWEN3_TEMPLATE,
                                    "stratad-tiny-qwen3"), 8192)


@pytest.fixture
def renders(monkeypatch):
    calls = []
    real = backend.prompt_tokens

    def counting(tokenizer, g):
        calls.append(g)
        return real(tokenizer, g)

    monkeypatch.setattr(backend, "prompt_tokens", counting)
    return calls


def chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "enable_thinking": False}


def test_one_request_is_rendered_once_another_again(model, renders):
    a = chat("Tell me about the experts on the cards.")
    room = model.room(a)
    tokens = model.prompt_tokens(dict(a), 5)  # as as_tokens() asks: an equal input, another max_tokens
    assert len(renders) == 1 and room == 8192 - len(tokens)
    assert model.prompt_tokens(chat("Something else.")) != tokens and len(renders) == 2
    assert model.prompt_tokens(a) == tokens and len(renders) == 3  # not the last one any more
    assert model.prompt_tokens({**a, "enable_thinking": True}) != tokens and len(renders) == 4


def test_the_last_input_is_not_kept(model):
    big = "the experts on the cards " * 4000  # 100 KB
    text = big + "!"  # one string object, only here and in the request
    tokens = model.prompt_tokens(chat(text))
    digest, kept = model._last
    assert isinstance(digest, bytes) and len(digest) == 32 and kept is tokens
    gc.collect()
    assert sys.getrefcount(text) == 2, [type(r) for r in gc.get_referrers(text)]  # `text` and getrefcount's own
