"""OpenAI's request bodies (chat completions, completions), checked, and turned into a daemon Job."""
from __future__ import annotations

import json
import secrets
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from stratad.gateway.content import text_of
from stratad.gateway.errors import ApiError
from stratad.gateway.generation import Job
from stratad.gateway import tools


class OpenBody(BaseModel):
    # Fields that do not change the result (user, metadata, store, service_tier, ...) are accepted and unused;
    # the ones that would are refused by name in `refuse()`.
    model_config = ConfigDict(extra="allow")


class FunctionSpec(OpenBody):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(OpenBody):
    type: Literal["function"]
    function: FunctionSpec


class CallFunction(OpenBody):
    name: str = Field(min_length=1)
    arguments: str


class ToolCallIn(OpenBody):
    id: str
    type: Literal["function"] = "function"
    function: CallFunction


class Message(OpenBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class NamedFunction(OpenBody):
    name: str


class NamedChoice(OpenBody):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(OpenBody):
    include_usage: bool = False


class SamplingFields(OpenBody):
    model: str = ""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM's extension: exactly max_tokens tokens (benchmarks, fixed-length tests)
    # fields not declared that would change the result: a 400 naming each (subclasses add their own)
    EXTRA_REFUSED: ClassVar[dict[str, str]] = {
        "top_logprobs": "log probabilities are not returned",
        "functions": "the deprecated functions API is not supported: use tools",
        "function_call": "the deprecated functions API is not supported: use tool_choice",
        "audio": "text only", "prediction": "predicted outputs are not supported",
        "web_search_options": "web search is not supported", "echo": "echo is not supported",
        "suffix": "suffix (insertion) is not supported", "best_of": "best_of is not supported",
        **{k: "constrained decoding is not supported"
           for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    }

    def refuse(self) -> None:
        """A field we cannot honour that would change the result: a 400 naming it, never ignored."""
        bad = {
            "n": self.n != 1 and "only n = 1 is supported",
            "logprobs": bool(self.logprobs) and "log probabilities are not returned",
            "presence_penalty": self.presence_penalty != 0 and "penalties are not supported",
            "frequency_penalty": self.frequency_penalty != 0 and "penalties are not supported",
            "logit_bias": bool(self.logit_bias) and "logit_bias is not supported",
        }
        for name, why in (self.model_extra or {}).items():
            if name in self.EXTRA_REFUSED and why not in (None, False, [], {}):
                bad[name] = self.EXTRA_REFUSED[name]
        for name, why in bad.items():
            if why:
                raise ApiError("invalid_request", f"{name}: {why}", name)

    def sampling(self, max_tokens: int) -> dict:
        return dict(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p, top_k=max(0, self.top_k or 0),
                    seed=secrets.randbits(31) if self.seed is None else self.seed,  # no seed: a fresh draw
                    stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []), ignore_eos=self.ignore_eos)


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def refuse(self) -> None:
        super().refuse()
        rf = (self.response_format or {}).get("type", "text")
        if rf != "text":
            raise ApiError("invalid_request", f"response_format: type {rf!r} is not supported (it needs constrained "
                           "decoding); only 'text'", "response_format")
        if self.modalities and set(self.modalities) != {"text"}:
            raise ApiError("invalid_request", "modalities: text only", "modalities")
        extra = set(self.chat_template_kwargs or {}) - {"enable_thinking"}
        if extra:
            key = sorted(extra)[0]
            raise ApiError("invalid_request", f"chat_template_kwargs.{key}: only enable_thinking is supported",
                           f"chat_template_kwargs.{key}")

    def enable_thinking(self) -> bool | None:
        kw = self.chat_template_kwargs or {}
        if "enable_thinking" in kw:
            if not isinstance(kw["enable_thinking"], bool):
                raise ApiError("invalid_request", "chat_template_kwargs.enable_thinking: expected true or false",
                               "chat_template_kwargs.enable_thinking")
            return kw["enable_thinking"]
        if self.reasoning_effort is not None:  # Qwen3 thinks or does not: any effort but none is on
            return self.reasoning_effort != "none"
        return None


def chat_messages(req: ChatRequest) -> list[dict]:
    """OpenAI messages -> the daemon's (transformers' shape: tool calls' arguments as mappings)."""
    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(req.messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": text_of(m.content, f"messages[{i}].content")}
        if m.tool_calls and m.role == "assistant":
            calls = []
            for j, tc in enumerate(m.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    args = json.loads(tc.function.arguments or "{}")
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise ApiError("invalid_request", f"{where}: not a JSON object", where)
                names[tc.id] = tc.function.name
                calls.append({"id": tc.id, "type": "function",
                              "function": {"name": tc.function.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.role == "assistant" and m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        if m.role == "tool":
            if not m.tool_call_id:
                raise ApiError("invalid_request", f"messages[{i}].tool_call_id: required in a tool message",
                               f"messages[{i}].tool_call_id")
            d["tool_call_id"] = m.tool_call_id
            if m.tool_call_id in names or m.name:
                d["name"] = m.name or names[m.tool_call_id]
        out.append(d)
    return out


def chat_job(req: ChatRequest, backend) -> Job:
    req.refuse()
    choice = req.tool_choice
    if isinstance(choice, NamedChoice):
        choice = {"name": choice.function.name}
    tool_list = [{"type": "function", "function": t.function.model_dump(
        include={"name", "description", "parameters"}, exclude_none=True)} for t in req.tools or []]
    p = tools.plan(tool_list, choice or "auto", req.enable_thinking(), backend)
    gen = dict(messages=chat_messages(req), **p.generate_args())
    gen.update(req.sampling(req.max_completion_tokens or req.max_tokens or backend.room(gen)))
    # a stream gives a call as it is written (OpenAI's argument deltas); a whole answer only calls that parse
    return Job(gen, parse=True, tools_on=p.tools_on, param_types=p.param_types,
               parallel_tool_calls=req.parallel_tool_calls, id_prefix="call_", hold_calls=not req.stream)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    max_tokens: int = Field(16, ge=1)  # OpenAI's default

    def job(self) -> Job:
        self.refuse()
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise ApiError("invalid_request", "prompt: one prompt per request (a list of several is a batch)",
                               "prompt")
            p = p[0]
        if isinstance(p, list):
            if not p:
                raise ApiError("invalid_request", "prompt: empty", "prompt")
            args = {"tokens": p}
        else:
            args = {"prompt": p}
        return Job(dict(**args, **self.sampling(self.max_tokens)), parse=False)
