"""Every error code of the daemon's protocol has its HTTP status and error type in both APIs: the table below must
name each code of protos' ErrorCode, so a code added to the protocol fails here until the gateway maps it."""
from __future__ import annotations

import pytest

from protos.messages import ErrorCode
from stratad.client import DaemonUnavailable, RequestError
from stratad.gateway.errors import ApiError

# code -> (OpenAI status, OpenAI type, Anthropic status, Anthropic type)
BAD_INPUT = (400, "invalid_request_error", 400, "invalid_request_error")
SERVER_FAULT = (500, "server_error", 500, "api_error")
TRY_AGAIN = (503, "server_error", 503, "api_error")
EXPECTED = {
    ErrorCode.BAD_REQUEST: BAD_INPUT,
    ErrorCode.PROMPT_TOO_LONG: BAD_INPUT,
    ErrorCode.QUEUE_FULL: (429, "rate_limit_error", 529, "overloaded_error"),
    ErrorCode.SHUTTING_DOWN: TRY_AGAIN,
    ErrorCode.CLIENT_TOO_SLOW: TRY_AGAIN,  # the daemon cut the gateway off; the next request is served
    ErrorCode.LANE_FAILED: SERVER_FAULT,
    ErrorCode.INTERNAL: SERVER_FAULT,
    # the gateway's own frames, version and request ids: nothing the HTTP client sent
    ErrorCode.BAD_FRAME: SERVER_FAULT,
    ErrorCode.BAD_VERSION: SERVER_FAULT,
    ErrorCode.DUPLICATE_REQUEST: SERVER_FAULT,
    ErrorCode.UNKNOWN_REQUEST: SERVER_FAULT,
}


def test_every_code_is_mapped():
    assert set(EXPECTED) == set(ErrorCode), f"codes without an HTTP mapping: {set(ErrorCode) - set(EXPECTED)}"


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.value)
def test_code_in_both_shapes(code):
    err = ApiError.of(RequestError(code, f"what went wrong ({code.value})", "r1"))
    o_status, o_body = err.openai()
    a_status, a_body = err.anthropic()
    assert (o_status, o_body["error"]["type"], a_status, a_body["error"]["type"]) == EXPECTED[code]
    assert o_body["error"]["code"] == code.value and o_body["error"]["message"] == f"what went wrong ({code.value})"
    assert set(o_body["error"]) == {"message", "type", "param", "code"}
    assert a_body == {"type": "error", "error": {"type": a_body["error"]["type"],
                                                 "message": f"what went wrong ({code.value})"}}
    assert o_body["error"]["param"] == ("messages" if code == ErrorCode.PROMPT_TOO_LONG else None)


def test_no_daemon_and_unexpected_errors():
    assert ApiError.of(DaemonUnavailable("no daemon at /run/x")).openai()[0] == 503
    status, body = ApiError.of(KeyError("k")).anthropic()
    assert status == 500 and body["error"] == {"type": "api_error", "message": "KeyError: 'k'"}
