"""Server-sent events: the frames and the response that carries them."""
from __future__ import annotations

import json
from typing import AsyncIterator

from starlette.responses import StreamingResponse

KEEPALIVE_S = 15.0  # an idle stream (a long prompt being read, a queue) sends a comment or a ping this often


def frame(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def comment(text: str = "keep-alive") -> str:
    return f": {text}\n\n"


def response(frames: AsyncIterator[str]) -> StreamingResponse:
    """Starlette cancels `frames` when the client disconnects (the generation then cancels its request)."""
    return StreamingResponse(frames, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
