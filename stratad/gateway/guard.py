"""The gateway's front door (pure ASGI middleware): the API key, and a bound on the body's size."""
from __future__ import annotations

import hmac
import json
from pathlib import Path

from stratad.gateway.errors import ApiError

OPEN_PATHS = ("/health",)  # a load balancer's probe needs no key


def load_key(path: str) -> str:
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"api_key_file {path} is empty")
    return key


async def _refuse(scope, send, err: ApiError) -> None:
    status, body = err.anthropic() if scope["path"].startswith("/v1/messages") else err.openai()
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _given_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    h = dict(headers)
    if b"x-api-key" in h:
        return h[b"x-api-key"]
    auth = h.get(b"authorization", b"")
    return auth[7:] if auth[:7].lower() == b"bearer " else None


class ApiKey:
    """Authorization: Bearer KEY or x-api-key: KEY, compared in constant time."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = _given_key(scope["headers"])
            if given is None or not hmac.compare_digest(given, self.key):
                return await _refuse(scope, send, ApiError(
                    "authentication", "missing API key (Authorization: Bearer or x-api-key)" if given is None
                    else "invalid API key"))
        await self.app(scope, receive, send)


class BodyLimit:
    """A body over max_bytes is a 413, whether it says its length (Content-Length) or streams (chunked)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = _TooLarge("too_large", f"the request body exceeds {self.max_bytes} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _refuse(scope, send, too_large)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large  # an ApiError: the handler answers it in its API's shape
            return msg

        try:
            await self.app(scope, counted, send)
        except _TooLarge:  # a route that does not read bodies through a handler's error path
            await _refuse(scope, send, too_large)


class _TooLarge(ApiError):
    pass
