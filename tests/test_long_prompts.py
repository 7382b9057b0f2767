"""The real daemon on two CPU cards: prompts around and over one prompt chunk give the in-process reference's tokens
and logits bit for bit; any int64 seed; a lane's failure is `bad_request` only for the request's own input."""
from __future__ import annotations

import numpy as np
import pytest
import zmq

from daemon_harness import Daemon
from stratad.engine.chunks import PROMPT_CHUNK
from lane.main import error_reply
from protos import messages as M
from protos.codec import decode
from stratad.client import RequestError
from stratad.engine.generation import BadRequest, Generation
from stratad.engine.reference import ReferenceEngine
from stratad.engine.sampling import SamplingParams
from stratad.model.config import ModelConfig
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile

LENGTHS = (1, PROMPT_CHUNK - 1, PROMPT_CHUNK, PROMPT_CHUNK + 1, 2500)  # the numpy card reads 1024 tokens a chunk
N = 4


# Smaller than the tiny preset (one chunk's reference read in 0.2 s instead of 2.5): chunking does not depend on
# the model's size. Q8_0 experts: IQ3_S and Q4_K rows are multiples of 256 values.
MICRO = ModelConfig(n_layer=2, d_model=64, n_head=2, n_head_kv=1, head_dim=32, n_expert=8, n_expert_used=2,
                    d_ff_expert=64, vocab_size=1024, context_length=4096)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "micro.gguf"
    make_model(path, MICRO, expert_quant="Q8_0", dense_quant="Q8_0", router_skew=1.0)
    return path


@pytest.fixture(scope="module")
def daemon(model_path, tmp_path_factory):
    d = Daemon(model_path, tmp_path_factory.mktemp("rt") / "run", extra=["--expert-cache", "0.5"]).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def model(model_path):
    m = ModelFile(model_path)
    yield m
    m.close()


def prompt(n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(n).integers(0, 1000, n)]


def in_process(model, tokens, params):
    g = Generation(ReferenceEngine(model, "canonical"), model.tokenizer, tokens, params, model.config.context_length,
                   digest=True)
    return [t for t, _ in g if t is not None], g.digest.hexdigest()


def test_prompts_around_a_chunk_match_the_reference(daemon, model):
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    with daemon.client(stream_timeout_s=120) as c:
        streams = {n: c.generate(tokens=prompt(n), max_tokens=N, ignore_eos=True, digest=True) for n in LENGTHS}
        for s in streams.values():
            s.result()
    for n, s in streams.items():
        assert s.stats.prompt_tokens == n and s.finish_reason == "length"
        assert (s.tokens, s.stats.logits_sha256) == in_process(model, prompt(n), params), n


def test_any_int64_seed(daemon, model):
    text = [{"role": "user", "content": "seeds"}]
    tokens = model.tokenizer.encode(model.tokenizer.apply_chat_template(text))
    with daemon.client() as c:
        for seed in (-1, -2**63, 2**63 - 1):
            s = c.generate(messages=text, max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
            s.result()
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
            assert s.tokens == in_process(model, tokens, params)[0], seed
        for seed in (2**63, -2**63 - 1):
            with pytest.raises(RequestError, match="seed") as e:
                c.generate(messages=text, max_tokens=6, seed=seed).result()
            assert e.value.code == M.ErrorCode.BAD_REQUEST
    s = zmq.Context.instance().socket(zmq.DEALER)  # past the client library's check: the daemon's names the field
    s.connect(f"ipc://{daemon.runtime_dir / 'client.sock'}")
    s.send(b'{"type":"generate","req_id":"s","tokens":[1],"sampling":{"seed":18446744073709551616}}')
    assert s.poll(5000)
    reply = decode(s.recv(), M.CoordinatorToClient)
    s.close(0)
    assert isinstance(reply, M.Error) and "seed" in reply.message


def test_bad_request_only_for_the_requests_input(model):
    """What the lane answers for a failed request: the input Generation refuses is the client's mistake; any other
    exception, a ValueError from inside the computation included, is the lane's."""
    params = SamplingParams(max_tokens=4)
    for tokens, why in (([], "empty"), ([5, 99999], "token id 99999 outside the vocabulary"),
                        ([1] * 10, "exceeds the context length")):
        with pytest.raises(BadRequest, match=why) as e:
            Generation(ReferenceEngine(model), model.tokenizer, tokens, params, 12)
        err = error_reply(0, "r1", e.value)
        assert (err.code, err.message, err.req_id) == (M.ErrorCode.BAD_REQUEST, str(e.value), "r1")
    try:  # the fault this lane had on prompts over one chunk: hidden states concatenated with logits
        np.concatenate([np.zeros((2, 3)), np.zeros((1, 4))])
    except ValueError as fault:
        err = error_reply(1, "r2", fault)
    assert err.code == M.ErrorCode.INTERNAL
    assert err.message.startswith("lane 1 failed serving the request: ValueError: all the input array")
