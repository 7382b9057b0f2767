"""Property-based frames (hypothesis) sent to the real coordinator: arbitrary bytes, deep nesting, huge numbers,
messages of the right shape with a wrong type in one field, multi-part messages. Each gets exactly one error
reply; afterwards status answers and a greedy generation gives the tokens it gave before."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon_harness import Daemon, greedy, raw_socket
from protos import messages as M
from protos.codec import FrameError, decode, encode, req_id_of

EXAMPLES = 40  # per kind: the whole file runs in seconds on 2 cores
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

VALID = {"type": "generate", "req_id": "fz", "prompt": "hi", "sampling": {"max_tokens": 3}}
WRONG = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.integers(-2**70, 2**70),
                  st.text(max_size=20), st.lists(st.integers(), max_size=3),
                  st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


@st.composite
def wrong_typed(draw) -> bytes:
    """A valid generate message with one field (top level or sampling) replaced by a value of another type."""
    msg = json.loads(json.dumps(VALID))
    where = draw(st.sampled_from(["v", "req_id", "prompt", "tokens", "messages", "digest", "sampling.max_tokens",
                                  "sampling.temperature", "sampling.top_p", "sampling.stop", "sampling.seed"]))
    value = draw(WRONG)
    if where in ("tokens", "messages"):
        msg.pop("prompt")
    target = msg["sampling"] if where.startswith("sampling.") else msg
    target[where.split(".")[-1]] = value
    try:
        decode(json.dumps(msg).encode(), M.ClientToCoordinator)  # lax validation took it (1 for True, 3.0 for 3)
        target[where.split(".")[-1]] = {"not": "this"}
    except FrameError:
        pass
    return json.dumps(msg).encode()


def nested(depth: int, opener: str) -> bytes:
    return (opener * depth).encode()


FRAMES = st.one_of(
    st.binary(max_size=512),
    st.integers(1, 100_000).flatmap(lambda n: st.sampled_from([nested(n, "["), nested(n, '{"a":'),
                                                                  b'{"type":"generate","req_id":"x","tokens":' +
                                                                  nested(n, "[")])),
    st.integers(300, 200_000).map(lambda n: b'{"type":"generate","req_id":"x","tokens":[' + b"9" * n + b"]}"),
    st.integers(300, 200_000).map(lambda n: b'{"v":1e' + b"9" * n + b',"type":"status_request"}'),
    wrong_typed(),
)


@FUZZ
@given(st.text(min_size=1, max_size=M.REQ_ID_MAX), st.text(max_size=3000), st.sampled_from(["generate", "cancel"]))
def test_req_id_of_reads_an_encoded_messages_id_off_its_head(req_id, prompt, kind):
    """What the intake answers a big frame with before (or without) decoding it: the message's own req_id, whatever
    its characters (escaped in JSON: up to 6 bytes each) and whatever follows."""
    msg = M.Generate(req_id=req_id, prompt=prompt) if kind == "generate" else M.Cancel(req_id=req_id)
    assert req_id_of(encode(msg)) == req_id


@FUZZ
@given(FRAMES)
def test_req_id_of_never_raises_and_never_returns_a_cut_id(frame):
    rid = req_id_of(frame)
    assert rid is None or (isinstance(rid, str) and 0 < len(rid) <= M.REQ_ID_MAX)
    whole = b'{"v":1,"type":"generate","req_id":"' + b"a" * 100 + b'"}'
    assert req_id_of(whole[:60]) is None and req_id_of(whole) == "a" * 100


@pytest.fixture(scope="module")
def daemon(tiny_model_path, tmp_path_factory):
    d = Daemon(tiny_model_path, tmp_path_factory.mktemp("fuzz") / "run", cards="cpu").start()
    yield d
    assert d.stop() == 0


def test_any_frame_gets_one_error_and_the_daemon_is_unchanged(daemon):
    before = greedy(daemon)
    ctx, s = raw_socket(daemon)

    def one_reply(what) -> M.Error:
        assert s.poll(10_000), f"no reply to {what!r:.80}"
        reply = decode(s.recv(), M.CoordinatorToClient)
        assert isinstance(reply, M.Error) and reply.message, (what, reply)
        return reply

    @FUZZ
    @given(FRAMES)
    def single(frame):
        s.send(frame)
        one_reply(frame)
        assert not s.poll(0)  # and only one

    @FUZZ
    @given(st.lists(st.binary(max_size=64), min_size=2, max_size=5))
    def multipart(parts):
        s.send_multipart(parts)
        assert one_reply(parts).code == M.ErrorCode.BAD_FRAME

    try:
        single()
        multipart()
    finally:
        ctx.destroy(linger=0)
    assert daemon.status().lanes
    assert greedy(daemon) == before
