"""Frames <-> messages. A frame is one ZeroMQ part holding a message as JSON; anything else is a FrameError.

Untrusted frames are parsed only by pydantic-core's JSON parser, after the size check: it refuses nesting deeper
than its recursion limit and numbers past its digit limit with a validation error, so a frame can neither recurse
nor allocate beyond a small multiple of MAX_FRAME_BYTES (Python's json.loads recursed into a RecursionError on
`[` * 1000 and killed the coordinator)."""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic_core import from_json

from protos.messages import MAX_FRAME_BYTES, PROTOCOL_VERSION, REQ_ID_MAX, ErrorCode


class FrameError(ValueError):
    def __init__(self, code: ErrorCode, message: str):
        self.code = code
        super().__init__(message)


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json().encode()


@lru_cache(maxsize=None)
def _adapter(union) -> TypeAdapter:
    return TypeAdapter(union)


class _Versioned(BaseModel):
    """Just the version of a frame that failed validation: a newer peer's message deserves bad_version."""
    model_config = ConfigDict(extra="ignore")
    v: Any = PROTOCOL_VERSION


_VERSION = TypeAdapter(_Versioned)


def decode(frame: bytes, union) -> BaseModel:
    """Parse one frame as one of the message types in `union`; FrameError names what is wrong."""
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameError(ErrorCode.BAD_FRAME, f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    try:
        msg = _adapter(union).validate_json(frame)  # parsed and validated in one pass (pydantic-core)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "json_invalid":  # not JSON, or past the parser's depth or number limits
            raise FrameError(ErrorCode.BAD_FRAME, f"frame is not JSON ({first['msg']})") from None
        _check_version(frame)
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise FrameError(ErrorCode.BAD_FRAME, f"invalid message at {where}: {first['msg']}") from None
    if msg.v != PROTOCOL_VERSION:
        _check_version(frame)
    return msg


def _check_version(frame: bytes) -> None:
    """A second parse, bounded as the first (same parser, a frame it already read whole)."""
    try:
        v = _VERSION.validate_json(frame).v
    except ValidationError:  # not an object
        return
    if v != PROTOCOL_VERSION:
        raise FrameError(ErrorCode.BAD_VERSION, f"protocol version {repr(v)[:40]} not supported (this daemon "
                                                f"speaks {PROTOCOL_VERSION})")


PEEK_BYTES = 4096  # where an encoded message's req_id is (after v and type): a frame's head, parsed alone


def req_id_of(frame: bytes) -> str | None:
    """The req_id of a frame not decoded (too big to decode where it must be answered), if its first PEEK_BYTES
    hold it whole as a top-level key: parsed as a partial JSON object (the same bounded parser; an unfinished string
    is left out, so a cut id is never returned). None for anything else."""
    try:
        head = from_json(frame[:PEEK_BYTES], allow_partial=True)
    except ValueError:
        return None
    rid = head.get("req_id") if isinstance(head, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= REQ_ID_MAX else None


def peek(frame: bytes) -> dict:
    """A trusted peer's frame as a plain dict, for routing without a full validation (lane -> client relay)."""
    return json.loads(frame)
