"""Errors as each API shapes them: one ApiError, written as OpenAI's or Anthropic's error body."""
from __future__ import annotations

from starlette.responses import JSONResponse

from protos.messages import ErrorCode
from stratad.client import DaemonUnavailable, RequestError

# kind -> (HTTP status, OpenAI type, HTTP status, Anthropic type)
_KINDS = {
    "invalid_request": (400, "invalid_request_error", 400, "invalid_request_error"),
    "authentication": (401, "authentication_error", 401, "authentication_error"),
    "not_found": (404, "not_found_error", 404, "not_found_error"),
    "method_not_allowed": (405, "invalid_request_error", 405, "invalid_request_error"),
    "too_large": (413, "invalid_request_error", 413, "request_too_large"),
    "overloaded": (429, "rate_limit_error", 529, "overloaded_error"),
    "unavailable": (503, "server_error", 503, "api_error"),
    "internal": (500, "server_error", 500, "api_error"),
}
# Every daemon error code -> kind (tests/test_gateway_errors.py checks that none is missing). The HTTP client's
# own input is a 400; what the gateway itself sent wrong as the daemon's client (a frame, a version, a request id:
# the HTTP client chose none of them) is the server's fault, as is a lane that died; a daemon that is stopping or
# has cut the gateway off for reading too slowly will serve again: 503, worth a retry.
_CODES = {
    ErrorCode.BAD_REQUEST: "invalid_request", ErrorCode.PROMPT_TOO_LONG: "invalid_request",
    ErrorCode.QUEUE_FULL: "overloaded",
    ErrorCode.SHUTTING_DOWN: "unavailable", ErrorCode.CLIENT_TOO_SLOW: "unavailable",
    ErrorCode.BAD_FRAME: "internal", ErrorCode.BAD_VERSION: "internal", ErrorCode.DUPLICATE_REQUEST: "internal",
    ErrorCode.UNKNOWN_REQUEST: "internal", ErrorCode.LANE_FAILED: "internal", ErrorCode.INTERNAL: "internal",
}


class ApiError(Exception):
    def __init__(self, kind: str, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code

    def __reduce__(self):  # pickled whole: the intake worker raises these
        return type(self), (self.kind, self.message, self.param, self.code)

    @classmethod
    def of(cls, e: Exception) -> "ApiError":
        """The daemon's errors (and anything else: an internal error, never a traceback to the client)."""
        if isinstance(e, ApiError):
            return e
        if isinstance(e, RequestError):
            param = "messages" if e.code == ErrorCode.PROMPT_TOO_LONG else None
            return cls(_CODES.get(e.code, "internal"), e.message, param, e.code.value)
        if isinstance(e, DaemonUnavailable):
            return cls("unavailable", str(e), code="daemon_unavailable")
        return cls("internal", f"{type(e).__name__}: {e}")

    def openai(self) -> tuple[int, dict]:
        status, typ = _KINDS[self.kind][:2]
        return status, {"error": {"message": self.message, "type": typ, "param": self.param, "code": self.code}}

    def anthropic(self) -> tuple[int, dict]:
        status, typ = _KINDS[self.kind][2:]
        return status, {"type": "error", "error": {"type": typ, "message": self.message}}


def openai_response(e: Exception) -> JSONResponse:
    status, body = ApiError.of(e).openai()
    return JSONResponse(body, status_code=status)


def anthropic_response(e: Exception) -> JSONResponse:
    status, body = ApiError.of(e).anthropic()
    return JSONResponse(body, status_code=status)


def pydantic_error(e, prefix: str = "") -> ApiError:
    """A request body's first validation error, naming the field (messages[0].content)."""
    err = e.errors()[0]
    where = prefix
    for p in err["loc"]:
        where += f"[{p}]" if isinstance(p, int) else (f".{p}" if where else str(p))
    msg = err["msg"]
    return ApiError("invalid_request", f"{where or 'body'}: {msg}", where or None)
