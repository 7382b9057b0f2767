"""How a request's tools and tool_choice reach the model: which tools the template shows, whether calls are parsed,
and, for a call the client requires, the reply's forced opening (a prefill: no constrained decoding needed)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from stratad.gateway.errors import ApiError
from stratad.gateway.parsing import CALL_OPEN, THINK_CLOSE


@dataclass
class ToolPlan:
    tools: list[dict] | None = None  # as the template gets them ({"type": "function", "function": {...}})
    tools_on: bool = False  # parse calls out of the reply
    param_types: dict = field(default_factory=dict)
    enable_thinking: bool | None = None
    prefill: str = ""

    def generate_args(self) -> dict:
        return dict(tools=self.tools, enable_thinking=self.enable_thinking, prefill=self.prefill)


def call_opening(fmt: str, name: str | None) -> str:
    """The start of a call in the model's format, up to where the model takes over (a named call: its arguments)."""
    if name is None:
        return CALL_OPEN + "\n"
    if fmt == "xml":
        return f"{CALL_OPEN}\n<function={name}>\n"
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def plan(tools: list[dict], choice, enable_thinking: bool | None, backend, field_name: str = "tool_choice") -> ToolPlan:
    """choice: "auto" | "none" | "required" | {"name": NAME}."""
    forced = choice == "required" or isinstance(choice, dict)
    if not tools:
        if forced:
            raise ApiError("invalid_request", f"{field_name}: a tool call is required but no tools are given",
                           field_name)
        return ToolPlan(enable_thinking=enable_thinking)
    if choice == "none":  # the model is not shown the tools, and nothing is parsed as a call
        return ToolPlan(enable_thinking=enable_thinking)
    types = {t["function"]["name"]: _param_types(t["function"].get("parameters")) for t in tools}
    if not forced:
        return ToolPlan(tools, True, types, enable_thinking)
    name = choice["name"] if isinstance(choice, dict) else None
    if name is not None and name not in types:
        raise ApiError("invalid_request", f"{field_name}: no tool named {name!r} among the tools", field_name)
    # a forced call skips reasoning; a template that opens <think> itself gets it closed first
    close = THINK_CLOSE + "\n\n" if backend.reasoning_open(False) else ""
    return ToolPlan(tools, True, types, False, close + call_opening(backend.tool_format, name))


def _param_types(schema) -> dict:
    """A tool's parameters by name -> their JSON schema type (for reading Qwen3-Coder's text values); a schema that
    is not an object of objects types nothing (the template shows it as the client wrote it)."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return {}
    return {k: v.get("type") if isinstance(v, dict) else None for k, v in props.items()}
