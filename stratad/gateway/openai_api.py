"""OpenAI's endpoints: /v1/chat/completions, /v1/completions, /v1/models (plain JSON and SSE streams); `handle`
serves /v1/responses too (responses_api.py)."""
from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stratad.gateway import sse
from stratad.gateway.errors import ApiError, openai_response
from stratad.gateway.generation import IDLE, Generation, Job
from stratad.gateway.handling import CLIENT_CLOSED, Disconnected, failed, unless_disconnected
from stratad.gateway.openai_schema import ChatRequest, CompletionRequest
from stratad.gateway.parsing import CallArgs, CallStart, Reasoning, Text


def _usage(g: Generation) -> dict:
    return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
            "total_tokens": g.prompt_tokens + g.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": g.cached_tokens}}


async def _start(request: Request, job: Job) -> Generation:
    st = request.app.state
    g = Generation(st.backend, st.metrics, job)
    await unless_disconnected(request, g.begin)
    return g


async def handle(request: Request, endpoint: str, whole, frames) -> Response:
    """Read, start (refusals become the API's errors with their status), then answer whole or as a stream."""
    try:
        p = await request.app.state.intake.prepare(request, endpoint)
        req = p.req
        g = await _start(request, p.job)
        if req.stream:
            return sse.response(frames(g, req, request.app.state.backend.model_name))
        body = await unless_disconnected(request, lambda: whole(g, req, request.app.state.backend.model_name))
        return JSONResponse(body)
    except Disconnected:
        return Response(status_code=CLIENT_CLOSED)
    except Exception as e:  # noqa: BLE001 - every error is answered in the API's shape
        return openai_response(failed(request, e))


# ---- chat completions ----------------------------------------------------------------------------------------
async def _chat_whole(g: Generation, req: ChatRequest, model: str) -> dict:
    text, reasoning, calls = [], [], []
    async for ev in g.events():
        if isinstance(ev, Text):
            text.append(ev.text)
        elif isinstance(ev, Reasoning):
            reasoning.append(ev.text)
        elif isinstance(ev, CallStart):
            calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
        elif isinstance(ev, CallArgs):
            calls[ev.index]["function"]["arguments"] += ev.fragment
    msg = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model or model, "choices": [{"index": 0, "message": msg, "logprobs": None,
                                                        "finish_reason": g.finish_reason}],
            "usage": _usage(g)}


def _delta(ev) -> dict | None:
    if isinstance(ev, Text):
        return {"content": ev.text}
    if isinstance(ev, Reasoning):
        return {"reasoning_content": ev.text}
    if isinstance(ev, CallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    if isinstance(ev, CallArgs):
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]}
    return None  # CallEnd: nothing to send


async def _stream(g: Generation, req, model: str, obj: str, choice):
    """SSE frames of a chat or completion stream; choice(delta_event) -> the choice's fields, or None."""
    cid = f"{'chatcmpl' if obj == 'chat.completion.chunk' else 'cmpl'}-{uuid.uuid4().hex}"
    usage = bool(req.stream_options and req.stream_options.include_usage)
    created = int(time.time())

    def chunk(choices, **extra):
        body = {"id": cid, "object": obj, "created": created, "model": req.model or model, "choices": choices}
        return sse.frame(body | ({"usage": None} if usage else {}) | extra)

    if obj == "chat.completion.chunk":
        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    try:
        async for ev in g.events(sse.KEEPALIVE_S):
            if ev is IDLE:
                yield sse.comment()
            elif (fields := choice(ev)) is not None:
                yield chunk([{"index": 0, **fields, "finish_reason": None}])
        last = {"delta": {}} if obj == "chat.completion.chunk" else {"text": ""}
        yield chunk([{"index": 0, **last, "finish_reason": g.finish_reason}])
        if usage:
            yield chunk([], usage=_usage(g))
    except Exception as e:  # noqa: BLE001 - a lane that died mid-stream: the stream ends with an error event
        yield sse.frame(g.metrics.failed(e).openai()[1])
    yield sse.frame("[DONE]")


def _chat_frames(g: Generation, req: ChatRequest, model: str):
    return _stream(g, req, model, "chat.completion.chunk",
                   lambda ev: None if (d := _delta(ev)) is None else {"delta": d})


async def chat_completions(request: Request) -> Response:
    return await handle(request, "chat", _chat_whole, _chat_frames)


# ---- completions ---------------------------------------------------------------------------------------------
async def _completion_whole(g: Generation, req: CompletionRequest, model: str) -> dict:
    text = "".join([ev.text async for ev in g.events()])
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": g.finish_reason}],
            "usage": _usage(g)}


def _completion_frames(g: Generation, req: CompletionRequest, model: str):
    return _stream(g, req, model, "text_completion", lambda ev: {"text": ev.text, "logprobs": None})


async def completions(request: Request) -> Response:
    return await handle(request, "completions", _completion_whole, _completion_frames)


def _model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "stratad"}


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_object(request.app.state.backend.model_name)]})


async def model(request: Request) -> Response:
    """GET /v1/models/{id} (the openai package's models.retrieve): the served model by its name, else 404."""
    name, asked = request.app.state.backend.model_name, request.path_params["model"]
    if asked != name:
        return openai_response(ApiError("not_found", f"the model {asked!r} does not exist: this server serves "
                                                     f"{name!r} (requests may name any model: {name!r} answers)",
                                        "model", "model_not_found"))
    return JSONResponse(_model_object(name))
