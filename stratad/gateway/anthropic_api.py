"""Anthropic's endpoints: /v1/messages (whole or as its event stream) and /v1/messages/count_tokens."""
from __future__ import annotations

import json
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stratad.gateway import sse
from stratad.gateway.anthropic_schema import MessagesRequest
from stratad.gateway.errors import anthropic_response
from stratad.gateway.generation import IDLE, Generation
from stratad.gateway.handling import CLIENT_CLOSED, Disconnected, failed, unless_disconnected
from stratad.gateway.parsing import CallArgs, CallEnd, CallStart, Reasoning, Text


_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop(g: Generation) -> tuple[str, str | None]:
    seq = g.stop_sequence()
    return ("stop_sequence", seq) if seq is not None else (_STOP[g.finish_reason], None)


def _usage(g: Generation, output: bool = True) -> dict:
    # Anthropic counts cache reads apart from input_tokens
    u = {"input_tokens": g.prompt_tokens - g.cached_tokens, "cache_read_input_tokens": g.cached_tokens,
         "cache_creation_input_tokens": 0}
    return u | {"output_tokens": g.completion_tokens if output else 0}


def _message(g: Generation, model: str, content: list, output: bool = True) -> dict:
    reason, seq = _stop(g) if output else (None, None)
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": _usage(g, output)}


async def _whole(g: Generation, req: MessagesRequest) -> dict:
    blocks: list[dict] = []
    args: dict[int, str] = {}
    async for ev in g.events():
        kind = {Text: "text", Reasoning: "thinking"}.get(type(ev))
        if kind:
            if not blocks or blocks[-1]["type"] != kind:
                blocks.append({"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {}))
            blocks[-1][kind] += ev.text
        elif isinstance(ev, CallStart):
            blocks.append({"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
            args[len(blocks) - 1] = ""
        elif isinstance(ev, CallArgs):
            args[len(blocks) - 1] += ev.fragment
    for k, a in args.items():  # held calls (Job.hold_calls): only calls whose arguments parse are given
        blocks[k]["input"] = json.loads(a)
    return _message(g, req.model, blocks)


async def _frames(g: Generation, req: MessagesRequest):
    yield sse.frame({"type": "message_start", "message": _message(g, req.model, [], output=False)}, "message_start")
    yield sse.frame({"type": "ping"}, "ping")
    index, open_kind = -1, None

    def start(block: dict):
        nonlocal index, open_kind
        index, open_kind = index + 1, block["type"]
        return sse.frame({"type": "content_block_start", "index": index, "content_block": block},
                         "content_block_start")

    def stop():
        nonlocal open_kind
        open_kind = None
        return sse.frame({"type": "content_block_stop", "index": index}, "content_block_stop")

    def delta(d: dict):
        return sse.frame({"type": "content_block_delta", "index": index, "delta": d}, "content_block_delta")

    try:
        async for ev in g.events(sse.KEEPALIVE_S):
            if ev is IDLE:
                yield sse.frame({"type": "ping"}, "ping")
            elif isinstance(ev, (Text, Reasoning)):
                kind = "text" if isinstance(ev, Text) else "thinking"
                if open_kind != kind:
                    if open_kind:
                        yield stop()
                    yield start({"type": "text", "text": ""} if kind == "text"
                                else {"type": "thinking", "thinking": "", "signature": ""})
                yield delta({"type": "text_delta", "text": ev.text} if kind == "text"
                            else {"type": "thinking_delta", "thinking": ev.text})
            elif isinstance(ev, CallStart):
                if open_kind:
                    yield stop()
                yield start({"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
            elif isinstance(ev, CallArgs):
                yield delta({"type": "input_json_delta", "partial_json": ev.fragment})
            elif isinstance(ev, CallEnd):
                yield stop()
        if open_kind:
            yield stop()
        reason, seq = _stop(g)
        yield sse.frame({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                         "usage": {"output_tokens": g.completion_tokens}}, "message_delta")
        yield sse.frame({"type": "message_stop"}, "message_stop")
    except Exception as e:  # noqa: BLE001 - a lane that died mid-stream: the stream ends with an error event
        yield sse.frame(g.metrics.failed(e).anthropic()[1], "error")


async def messages(request: Request) -> Response:
    st = request.app.state
    try:
        p = await st.intake.prepare(request, "messages")
        req = p.req
        g = Generation(st.backend, st.metrics, p.job)
        await unless_disconnected(request, g.begin)
        if req.stream:
            return sse.response(_frames(g, req))
        return JSONResponse(await unless_disconnected(request, lambda: _whole(g, req)))
    except Disconnected:
        return Response(status_code=CLIENT_CLOSED)
    except Exception as e:  # noqa: BLE001 - every error is answered in Anthropic's shape
        return anthropic_response(failed(request, e))


async def count_tokens(request: Request) -> Response:
    try:
        p = await request.app.state.intake.prepare(request, "count_tokens")
        return JSONResponse({"input_tokens": p.input_tokens})
    except Exception as e:  # noqa: BLE001
        return anthropic_response(failed(request, e))
