"""Frames <-> messages. A frame is one ZeroMQ part holding a message as JSON; anything else is a FrameError."""
from __future__ import annotations

import json
from functools import lru_cache

from pydantic import BaseModel, TypeAdapter, ValidationError

from protos.messages import MAX_FRAME_BYTES, PROTOCOL_VERSION, ErrorCode


class FrameError(ValueError):
    def __init__(self, code: ErrorCode, message: str):
        self.code = code
        super().__init__(message)


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json().encode()


@lru_cache(maxsize=None)
def _adapter(union) -> TypeAdapter:
    return TypeAdapter(union)


def decode(frame: bytes, union) -> BaseModel:
    """Parse one frame as one of the message types in `union`; FrameError names what is wrong."""
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameError(ErrorCode.BAD_FRAME, f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    try:
        obj = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError(ErrorCode.BAD_FRAME, f"frame is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise FrameError(ErrorCode.BAD_FRAME, "frame is not a JSON object")
    v = obj.get("v", PROTOCOL_VERSION)
    if v != PROTOCOL_VERSION:
        raise FrameError(ErrorCode.BAD_VERSION, f"protocol version {v!r} not supported (this daemon speaks "
                                                f"{PROTOCOL_VERSION})")
    try:
        return _adapter(union).validate_python(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise FrameError(ErrorCode.BAD_FRAME, f"invalid message at {where}: {first['msg']}") from None
