"""OpenAI's Responses API request (POST /v1/responses, what Codex CLI speaks), checked, and turned into a daemon Job.

Stateless: the conversation comes whole in `input` (messages, the function calls the model made and their outputs,
its reasoning), as a client does that stores nothing on the server; what needs stored responses
(`previous_response_id`, `conversation`, item references, background runs) is refused by name.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from stratad.gateway import tools
from stratad.gateway.content import string_field, text_of
from stratad.gateway.errors import ApiError
from stratad.gateway.generation import Job
from stratad.gateway.openai_schema import OpenBody, SamplingFields

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


class FunctionTool(OpenBody):
    type: str
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ReasoningConfig(OpenBody):
    effort: str | None = None


class ResponsesRequest(SamplingFields):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    reasoning: ReasoningConfig | None = None
    text: dict[str, Any] | None = None
    # besides the chat API's: what needs state on the server
    EXTRA_REFUSED = SamplingFields.EXTRA_REFUSED | {
        "previous_response_id": "this server stores no responses: send the whole conversation as input",
        "conversation": "this server stores no conversations: send the whole conversation as input",
        "background": "background responses are not supported",
        "prompt": "stored prompts are not supported",
    }

    def refuse(self) -> None:
        super().refuse()
        f = (self.text or {}).get("format")
        fmt = f.get("type", "text") if isinstance(f, dict) else "text" if f is None else f
        if fmt != "text":
            raise ApiError("invalid_request", f"text.format: type {fmt!r} is not supported (it needs constrained "
                           "decoding); only 'text'", "text.format")
        for i, t in enumerate(self.tools or []):
            if t.type != "function" or not t.name:
                raise ApiError("invalid_request", f"tools[{i}]: only function tools with a name are served (got "
                               f"type {t.type!r})", f"tools[{i}].type")

    def enable_thinking(self) -> bool | None:
        effort = self.reasoning.effort if self.reasoning else None
        return None if effort is None else effort != "none"  # Qwen3 thinks or does not

    def choice(self):
        c = self.tool_choice
        if isinstance(c, dict):
            if c.get("type") != "function" or not isinstance(c.get("name"), str) or not c["name"]:
                raise ApiError("invalid_request", "tool_choice: only 'auto', 'none', 'required' or "
                               "{'type': 'function', 'name': ...} are served", "tool_choice")
            return {"name": c["name"]}
        return c or "auto"


def _text(content, where: str) -> str:
    return text_of(content, where, _TEXT_PARTS)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` -> the daemon's messages (transformers' shape). A function call joins the
    assistant message before it (or opens one); reasoning items go with the assistant turn that follows them."""
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    names: dict[str, str] = {}
    reasoning: list[str] = []

    def assistant(opened_by_call: bool) -> dict:
        if out and out[-1]["role"] == "assistant" and (opened_by_call or "tool_calls" not in out[-1]):
            return out[-1]
        out.append({"role": "assistant", "content": ""})
        return out[-1]

    def take_reasoning(m: dict) -> None:
        if reasoning:
            m["reasoning_content"] = "\n".join(([m["reasoning_content"]] if m.get("reasoning_content") else [])
                                               + reasoning)
            reasoning.clear()

    for i, it in enumerate(items):
        where = f"input[{i}]"
        typ = it.get("type", "message")
        if typ == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError("invalid_request", f"{where}.role: {role!r} is not a message role", f"{where}.role")
            text = _text(it.get("content"), f"{where}.content")
            if role == "assistant":
                m = assistant(False)
                m["content"] += text
                take_reasoning(m)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif typ == "function_call":
            name, call_id = string_field(it, "name", where, ""), string_field(it, "call_id", where, "")
            if not name or not call_id:
                raise ApiError("invalid_request", f"{where}: a function_call needs a name and a call_id", where)
            try:
                args = json.loads(string_field(it, "arguments", where, "") or "{}")
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise ApiError("invalid_request", f"{where}.arguments: not a JSON object", f"{where}.arguments")
            m = assistant(True)
            m.setdefault("tool_calls", []).append({"id": call_id, "type": "function",
                                                   "function": {"name": name, "arguments": args}})
            take_reasoning(m)
            names[call_id] = name
        elif typ == "function_call_output":
            call_id = string_field(it, "call_id", where, "")
            if not call_id:
                raise ApiError("invalid_request", f"{where}.call_id: required", f"{where}.call_id")
            out.append({"role": "tool", "content": _text(it.get("output"), f"{where}.output"), "tool_call_id": call_id}
                       | ({"name": names[call_id]} if call_id in names else {}))
        elif typ == "reasoning":
            text = _text(it.get("content"), f"{where}.content") or _text(it.get("summary"), f"{where}.summary")
            if text:
                reasoning.append(text)
        else:
            raise ApiError("invalid_request", f"{where}.type: {typ!r} is not supported (message, function_call, "
                           "function_call_output, reasoning)", f"{where}.type")
    return out


def responses_job(req: ResponsesRequest, backend) -> Job:
    req.refuse()
    tool_list = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                               exclude_none=True)} for t in req.tools or []]
    p = tools.plan(tool_list, req.choice(), req.enable_thinking(), backend)
    gen = dict(messages=input_messages(req), **p.generate_args())
    gen.update(req.sampling(req.max_output_tokens or backend.room(gen)))
    return Job(gen, parse=True, tools_on=p.tools_on, param_types=p.param_types,
               parallel_tool_calls=req.parallel_tool_calls, id_prefix="call_", hold_calls=not req.stream)
