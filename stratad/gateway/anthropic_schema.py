"""Anthropic's Messages request body, checked, and turned into a daemon Job (or a prompt to count)."""
from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stratad.gateway import tools
from stratad.gateway.content import string_field, text_of
from stratad.gateway.errors import ApiError
from stratad.gateway.generation import Job


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier, cache_control and the like change nothing


class ToolSpec(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    type: str | None = None  # "custom" or absent; Anthropic's server tools (bash_..., web_search_...) are refused


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Open):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None  # accepted; Qwen3's reasoning has no budget to set


class Message(_Open):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountRequest(_Open):
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def chat(self, backend) -> tuple[dict, tools.ToolPlan]:
        """generate()'s messages, tools, enable_thinking, prefill; and the tool plan."""
        for i, t in enumerate(self.tools or []):
            if t.type not in (None, "custom"):
                raise ApiError("invalid_request", f"tools[{i}].type: server tool {t.type!r} is not supported",
                               f"tools[{i}].type")
        tool_list = [{"type": "function", "function": {"name": t.name, **({"description": t.description}
                                                                          if t.description else {}),
                                                       "parameters": t.input_schema}} for t in self.tools or []]
        tc = self.tool_choice or ToolChoice(type="auto")
        if tc.type == "tool" and not tc.name:
            raise ApiError("invalid_request", "tool_choice.name: required with type 'tool'", "tool_choice.name")
        choice = {"auto": "auto", "none": "none", "any": "required"}.get(tc.type) or {"name": tc.name}
        # Anthropic's default is no extended thinking; adaptive leaves it to the model's template
        thinking = {"enabled": True, "between_tools": True, "disabled": False, "adaptive": None}[
            self.thinking.type] if self.thinking else False
        oc = (self.model_extra or {}).get("output_config")
        fmt = oc.get("format") if isinstance(oc, dict) else None
        if fmt:
            raise ApiError("invalid_request", "output_config.format: structured outputs are not supported (they need "
                           "constrained decoding)", "output_config.format")
        plan = tools.plan(tool_list, choice, thinking, backend)
        messages, prefill = self._messages()
        if prefill and plan.prefill:
            raise ApiError("invalid_request", "messages: a final assistant turn to continue cannot be combined with "
                           "a required tool call (tool_choice)", "messages")
        return dict(messages=messages, **plan.generate_args() | {"prefill": plan.prefill or prefill}), plan

    def _system(self) -> str:
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        out = []
        for j, b in enumerate(self.system):
            if b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise ApiError("invalid_request", f"system[{j}].type: text blocks only", f"system[{j}].type")
            out.append(b["text"])
        return "\n".join(out)

    def _messages(self) -> tuple[list[dict], str]:
        """Anthropic turns -> the daemon's messages (tool results become tool messages); a final assistant turn
        is the reply's start (prefill), not a message."""
        out: list[dict] = [{"role": "system", "content": s}] if (s := self._system()) else []
        names: dict[str, str] = {}
        for i, m in enumerate(self.messages):
            blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
            texts, calls, reasoning, results = [], [], [], []
            for j, b in enumerate(blocks):
                where, typ = f"messages[{i}].content[{j}]", b.get("type")
                if typ == "text" and isinstance(b.get("text"), str):
                    texts.append(b["text"])
                elif typ == "tool_use" and m.role == "assistant":
                    name, call_id = string_field(b, "name", where), string_field(b, "id", where, None)
                    if not isinstance(b.get("input"), dict) or not name:
                        raise ApiError("invalid_request", f"{where}: a tool_use needs a name and an object input",
                                       where)
                    names[call_id or ""] = name
                    calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": b["input"]}})
                elif typ == "tool_result" and m.role == "user":
                    use_id = string_field(b, "tool_use_id", where, None)
                    results.append({"role": "tool", "content": text_of(b.get("content"), f"{where}.content"),
                                    "tool_call_id": use_id} | ({"name": names[use_id]} if use_id in names else {}))
                elif typ == "thinking" and m.role == "assistant":
                    reasoning.append(string_field(b, "thinking", where, ""))
                elif typ == "redacted_thinking":
                    pass  # Anthropic's encrypted reasoning: nothing a local model can read
                else:
                    raise ApiError("invalid_request", f"{where}.type: {typ!r} is not supported in a {m.role} turn "
                                   "(text, tool_use, tool_result, thinking)", f"{where}.type")
            if m.role == "user":
                out.extend(results)
                if texts or not results:
                    out.append({"role": "user", "content": "\n".join(texts)})
                continue
            if i == len(self.messages) - 1 and not calls:
                if all(m["role"] == "system" for m in out):
                    raise ApiError("invalid_request", "messages: no user turn before the final assistant turn "
                                   "(which is the start of the reply, a prefill)", "messages")
                return out, "".join(texts)
            d: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                d["tool_calls"] = calls
            if reasoning:
                d["reasoning_content"] = "\n".join(reasoning)
            out.append(d)
        return out, ""


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    # sampling: older clients send these (the current SDK no longer has them; extra_body does)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    ignore_eos: bool = False  # as vLLM's OpenAI extension: exactly max_tokens tokens

    def job(self, backend) -> Job:
        chat, plan = self.chat(backend)
        tc = self.tool_choice
        parallel = not (tc and tc.disable_parallel_tool_use)
        return Job(dict(**chat, max_tokens=self.max_tokens, temperature=1.0 if self.temperature is None
                        else self.temperature, top_p=1.0 if self.top_p is None else self.top_p,
                        top_k=self.top_k or 0, seed=secrets.randbits(31), stop=list(self.stop_sequences or []),
                        ignore_eos=self.ignore_eos),
                   parse=True, tools_on=plan.tools_on, param_types=plan.param_types, parallel_tool_calls=parallel,
                   id_prefix="toolu_", hold_calls=True)  # streamed too: a tool_use block only for a call that parsed
