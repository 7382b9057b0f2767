"""How the coordinator answers a prompt it cannot prepare, in its loop (a small frame) or in the intake worker (a big
one): the client's input (a template's refusal, token ids outside the vocabulary, a request too big for the context)
is the client's error; any other failure is internal, with its traceback in the log (a fault of ours must not read as
the client's mistake)."""
from __future__ import annotations

import logging
import pickle
from collections import deque
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from types import SimpleNamespace

import pytest

from coordinator.daemon import Coordinator
from coordinator.intake import PrepareFailed, prepare_frame
from stratad.prompts import PromptError, prompt_tokens
from protos import messages as M
from protos.codec import encode
from stratad.model.tokenizer import ChatTemplateError

CTX, MAX_BYTES = 8192, 4 * 16 * 8192


class Replies:
    def __init__(self):
        self.sent = []

    def send(self, sock, client, msg) -> bool:
        self.sent.append(msg)
        return True


def coordinator(tokenizer) -> Coordinator:
    """A coordinator with only what it reads before it queues a request."""
    co = Coordinator.__new__(Coordinator)
    co.stopping, co.requests, co.queue = False, {}, deque()
    co.context_length, co.max_prompt_bytes = CTX, MAX_BYTES
    co.tokenizer, co.io = tokenizer, Replies()
    co.cfg = SimpleNamespace(queue_limit=8)
    return co


def the_error(co: Coordinator) -> M.Error:
    (msg,) = co.io.sent
    assert isinstance(msg, M.Error), msg
    return msg


def broken(exc: BaseException) -> SimpleNamespace:
    """A tokenizer with a bug of ours: its encoding raises exc, which no client input should cause."""
    def fail(*a, **kw):
        raise exc

    return SimpleNamespace(vocab_size=1024, encode=fail, encode_chat=fail)


CHAT = M.Generate(req_id="r", messages=(M.ChatMessage(role="user", content="hi"),))
ROBOT = M.Generate(req_id="r", messages=(M.ChatMessage(role="robot", content="hi"),))
BAD_IDS = M.Generate(req_id="r", tokens=(1, 5000))
INTERNAL = [RuntimeError("internal state lost"), ValueError("an array of the wrong shape"), KeyError("merges")]


@pytest.mark.parametrize("g, says", [(ROBOT, "role 'robot'"), (BAD_IDS, "token id 5000 outside the vocabulary")])
def test_the_clients_input_is_bad_request_in_the_loop(tiny_model, g, says):
    co = coordinator(tiny_model.tokenizer)
    co._generate(None, b"client", g)
    err = the_error(co)
    assert err.code == M.ErrorCode.BAD_REQUEST and err.req_id == "r" and says in err.message


@pytest.mark.parametrize("exc", INTERNAL)
def test_anything_else_is_internal_in_the_loop_with_its_traceback_logged(exc, caplog):
    co = coordinator(broken(exc))
    with caplog.at_level(logging.ERROR, logger="stratad.coordinator"):
        co._generate(None, b"client", CHAT)
    err = the_error(co)
    assert err.code == M.ErrorCode.INTERNAL and err.req_id == "r", err
    assert err.message == f"the daemon failed preparing this prompt ({type(exc).__name__}; see its log)"
    (rec,) = [r for r in caplog.records if "preparing its prompt failed" in r.getMessage()]
    assert rec.exc_info[1] is exc and "request r" in rec.getMessage() and "Traceback" in caplog.text


def prepare(tokenizer, g: M.Generate):
    return prepare_frame(tokenizer, encode(g), prompt_tokens, CTX, MAX_BYTES)


def test_the_worker_answers_the_clients_input_with_its_error(tiny_model):
    tok = tiny_model.tokenizer
    for g, code, says in [(ROBOT, M.ErrorCode.BAD_REQUEST, "role 'robot'"),
                          (BAD_IDS, M.ErrorCode.BAD_REQUEST, "token id 5000"),
                          (CHAT.model_copy(update={"prefill": "x" * MAX_BYTES}), M.ErrorCode.PROMPT_TOO_LONG,
                           "bytes exceeds the limit")]:
        err = prepare(tok, g)
        assert isinstance(err, M.Error) and err.code == code and err.req_id == "r" and says in err.message, err
    err = prepare_frame(tok, b"[" * 1000, prompt_tokens, CTX, MAX_BYTES)
    assert err.code == M.ErrorCode.BAD_FRAME and err.req_id is None
    with_tools = CHAT.model_copy(update={"tools": (M.Tool(function=M.ToolFunction(name="f")),)})
    ok = prepare(tok, with_tools)
    assert ok.messages is None and ok.tools is None and ok.req_id == "r"  # what the loop gets: ids only
    assert list(ok.tokens) == prompt_tokens(tok, with_tools)
    assert prepare(tok, M.StatusRequest()) == M.StatusRequest()


@pytest.mark.parametrize("exc", INTERNAL)
def test_the_workers_own_faults_are_raised_with_the_request(exc):
    with pytest.raises(PrepareFailed) as e:
        prepare(broken(exc), CHAT)
    assert (e.value.req_id, e.value.cause, e.value.__cause__) == ("r", type(exc).__name__, exc)


@pytest.mark.parametrize("exc", [ChatTemplateError("role"), PromptError("token id 9"), PrepareFailed("r", "KeyError")])
def test_what_the_worker_raises_reaches_the_loop_as_itself(exc):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and back.args == exc.args and getattr(back, "req_id", None) == \
        getattr(exc, "req_id", None)


def resolved(result=None, exc: BaseException | None = None) -> Future:
    f = Future()
    if exc is not None:
        f.set_exception(exc)
    else:
        f.set_result(result)
    return f


def test_the_loop_answers_what_the_worker_made_of_a_frame(caplog):
    co = coordinator(None)
    with caplog.at_level(logging.ERROR, logger="stratad.coordinator"):
        co._prepared(None, b"c", None, resolved(exc=PrepareFailed("r", "RuntimeError")))
    err = the_error(co)
    assert (err.code, err.req_id) == (M.ErrorCode.INTERNAL, "r")
    assert err.message == "the daemon failed preparing this prompt (RuntimeError; see its log)"
    assert "preparing it failed in the intake worker" in caplog.text
    for exc in (BrokenProcessPool("gone"), KeyError("x")):
        co.io.sent.clear()
        co._prepared(None, b"c", None, resolved(exc=exc))
        assert the_error(co).code == M.ErrorCode.INTERNAL
    co.io.sent.clear()
    refusal = M.Error(req_id="r", code=M.ErrorCode.PROMPT_TOO_LONG, message="too long")
    co._prepared(None, b"c", None, resolved(refusal))
    assert the_error(co) == refusal
