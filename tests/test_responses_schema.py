"""The Responses API's input as the daemon's messages (responses_schema.py), and what it refuses by name: the
conversation a stateless client (Codex CLI with store = false) sends whole, item by item."""
from __future__ import annotations

import pytest

from stratad.gateway.errors import ApiError
from stratad.gateway.responses_schema import ResponsesRequest, input_messages


def messages(**body):
    return input_messages(ResponsesRequest.model_validate({"model": "m"} | body))


def test_a_string_input_is_one_user_message_after_the_instructions():
    assert messages(input="hi", instructions="be brief") == [{"role": "system", "content": "be brief"},
                                                             {"role": "user", "content": "hi"}]


def test_items_become_turns_calls_join_their_assistant_message_and_outputs_are_tool_messages():
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome"},
                                     {"type": "input_text", "text": "and Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Answer now."}]},
        {"type": "message", "role": "assistant", "content": "Rome sunny, Oslo rain."},
        {"role": "user", "content": "Thanks"},
    ]
    assert messages(input=items) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Rome\nand Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "tool", "content": "rain", "tool_call_id": "c2", "name": "get_weather"},
        {"role": "assistant", "content": "Rome sunny, Oslo rain.", "reasoning_content": "Answer now."},
        {"role": "user", "content": "Thanks"},
    ]


def test_a_call_after_a_finished_call_turn_opens_no_new_message_but_text_after_calls_does():
    items = [{"role": "user", "content": "q"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "r"},
             {"role": "assistant", "content": "done"}]
    out = messages(input=items)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "assistant"]
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]}


@pytest.mark.parametrize("body,field", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
])
def test_what_is_not_served_is_refused_by_name(body, field):
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi"} | body)
    with pytest.raises(ApiError) as e:
        req.refuse()
        input_messages(req)
    assert field in e.value.message and e.value.kind == "invalid_request", e.value.message


def test_reasoning_effort_switches_thinking():
    def thinking(**kw):
        return ResponsesRequest.model_validate({"model": "m", "input": "hi"} | kw).enable_thinking()
    assert thinking() is None and thinking(reasoning={"effort": "none"}) is False
    assert thinking(reasoning={"effort": "low"}) is True and thinking(reasoning={"summary": "auto"}) is None
