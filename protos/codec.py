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
        msg = _adapter(union).validate_json(frame)  # parsed and validated in one pass (pydantic-core)
    except ValidationError as e:
        _check_version(frame)
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise FrameError(ErrorCode.BAD_FRAME, f"frame is not JSON ({first['msg']})") from None
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise FrameError(ErrorCode.BAD_FRAME, f"invalid message at {where}: {first['msg']}") from None
    if msg.v != PROTOCOL_VERSION:
        _check_version(frame)
    return msg


def _check_version(frame: bytes) -> None:
    try:
        obj = json.loads(frame)
    except ValueError:
        return
    v = obj.get("v", PROTOCOL_VERSION) if isinstance(obj, dict) else PROTOCOL_VERSION
    if v != PROTOCOL_VERSION:
        raise FrameError(ErrorCode.BAD_VERSION, f"protocol version {v!r} not supported (this daemon speaks "
                                                f"{PROTOCOL_VERSION})")


def peek(frame: bytes) -> dict:
    """A trusted peer's frame as a plain dict, for routing without a full validation (lane -> client relay)."""
    return json.loads(frame)
