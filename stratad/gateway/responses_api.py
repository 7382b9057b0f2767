"""OpenAI's Responses API: POST /v1/responses, a whole response or its event stream (responses_schema.py reads
the request). The reply's parsed events become output items in order: reasoning (its text as `reasoning_text`
content), the message (`output_text`), each function call."""
from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from stratad.gateway import sse
from stratad.gateway.generation import IDLE, Generation
from stratad.gateway.openai_api import handle
from stratad.gateway.parsing import CallArgs, CallEnd, CallStart, Reasoning, Text
from stratad.gateway.responses_schema import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Reply:
    """The response being built: its output items, and each event of the stream (with its sequence number)."""

    def __init__(self, g: Generation, req: ResponsesRequest, model: str):
        self.g, self.req, self.model = g, req, model
        self.id, self.created = _id("resp"), int(time.time())
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.seq = 0

    # ---- the response object ----------------------------------------------------------------------------
    def usage(self) -> dict:
        g = self.g
        reasoning = "".join(c["text"] for it in self.output if it["type"] == "reasoning" for c in it["content"])
        return {"input_tokens": g.prompt_tokens, "input_tokens_details": {"cached_tokens": g.cached_tokens},
                "output_tokens": g.completion_tokens,
                # the reasoning's tokens counted by encoding its text again (the daemon counts the reply's whole)
                "output_tokens_details": {"reasoning_tokens": len(g.backend.tokenizer.encode(reasoning))
                                          if reasoning else 0},
                "total_tokens": g.prompt_tokens + g.completion_tokens}

    def response(self, status: str, error: dict | None = None) -> dict:
        req = self.req
        done = status in ("completed", "incomplete")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": req.model or self.model, "output": self.output if status != "in_progress" else [],
                "instructions": req.instructions, "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
                "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
                "text": {"format": {"type": "text"}}, "store": False, "metadata": {}, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": self.usage() if done else None}

    def status(self) -> str:
        return "incomplete" if self.g.finish_reason == "length" else "completed"

    # ---- items ------------------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return sse.frame({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def start(self, item: dict) -> list[str]:
        """Close the open item and open this one (stream frames; the whole answer ignores them)."""
        frames = self.close()
        self.output.append(item)
        self.open = item
        frames.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                 item=item | {"status": "in_progress"} | _empty(item)))
        if item["type"] in ("message", "reasoning"):
            frames.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output)
                                     - 1, content_index=0, part=_part(item, "")))
        return frames

    def add(self, ev) -> list[str]:
        """One parsed event into the output; its stream frames."""
        frames: list[str] = []
        if isinstance(ev, (Text, Reasoning)):
            kind = "message" if isinstance(ev, Text) else "reasoning"
            if self.open is None or self.open["type"] != kind:
                frames += self.start({"type": "message", "id": _id("msg"), "role": "assistant",
                                      "content": [{"type": "output_text", "text": "", "annotations": []}]}
                                     if kind == "message" else
                                     {"type": "reasoning", "id": _id("rs"), "summary": [],
                                      "content": [{"type": "reasoning_text", "text": ""}]})
            self.open["content"][0]["text"] += ev.text
            frames.append(self.event("response.output_text.delta" if kind == "message" else
                                     "response.reasoning_text.delta", item_id=self.open["id"],
                                     output_index=len(self.output) - 1, content_index=0, delta=ev.text,
                                     **({"logprobs": []} if kind == "message" else {})))
        elif isinstance(ev, CallStart):
            frames += self.start({"type": "function_call", "id": _id("fc"), "call_id": ev.id, "name": ev.name,
                                  "arguments": ""})
        elif isinstance(ev, CallArgs):
            self.open["arguments"] += ev.fragment
            frames.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.output) - 1, delta=ev.fragment))
        elif isinstance(ev, CallEnd):
            frames += self.close()
        return frames

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        at = dict(item_id=item["id"], output_index=self.output.index(item))
        if item["type"] == "function_call":
            return [self.event("response.function_call_arguments.done", **at, arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=at["output_index"], item=item)]
        text = item["content"][0]["text"]
        done = ("response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done")
        return [self.event(done, **at, content_index=0, text=text,
                           **({"logprobs": []} if item["type"] == "message" else {})),
                self.event("response.content_part.done", **at, content_index=0, part=_part(item, text)),
                self.event("response.output_item.done", output_index=at["output_index"], item=item)]


def _part(item: dict, text: str) -> dict:
    return ({"type": "output_text", "text": text, "annotations": []} if item["type"] == "message"
            else {"type": "reasoning_text", "text": text})


def _empty(item: dict) -> dict:
    """An item as output_item.added gives it: nothing written yet."""
    if item["type"] == "function_call":
        return {"arguments": ""}
    return {"content": []}


async def _whole(g: Generation, req: ResponsesRequest, model: str) -> dict:
    r = _Reply(g, req, model)
    async for ev in g.events():
        r.add(ev)
    r.close()
    return r.response(r.status())


async def _frames(g: Generation, req: ResponsesRequest, model: str):
    r = _Reply(g, req, model)
    yield r.event("response.created", response=r.response("in_progress"))
    yield r.event("response.in_progress", response=r.response("in_progress"))
    try:
        async for ev in g.events(sse.KEEPALIVE_S):
            if ev is IDLE:
                yield sse.comment()
                continue
            for f in r.add(ev):
                yield f
        for f in r.close():
            yield f
        status = r.status()
        yield r.event(f"response.{status}", response=r.response(status))
    except Exception as e:  # noqa: BLE001 - a lane that died mid-stream: the response fails, naming why
        err = g.metrics.failed(e).openai()[1]["error"]
        yield r.event("response.failed", response=r.response("failed", {"code": err.get("code") or "server_error",
                                                                       "message": err["message"]}))


async def responses(request: Request) -> Response:
    return await handle(request, "responses", _whole, _frames)
