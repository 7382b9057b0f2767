"""True tool-call round trips through the HTTP gateway with the trained tiny model that ships with stratad (real
daemon on two CPU cards, the official openai and anthropic packages): the model writes the call, the gateway parses
it, the test sends the tool's result back and the model answers with it. parallel_tool_calls=false (and Anthropic's
disable_parallel_tool_use) stops a reply that holds two calls after the first."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from daemon_harness import Daemon
from stratad import demo
from test_gateway import Gateway, wait_idle

MODEL = demo.SHIPPED_MODEL
TOOL = demo.WEATHER_TOOL
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
RESPONSES_TOOL = {"type": "function", **TOOL["function"]}
ANTHROPIC_TOOL = {"name": TOOL["function"]["name"], "description": TOOL["function"]["description"],
                  "input_schema": TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    rt = tmp_path_factory.mktemp("gwtools")
    d = Daemon(MODEL, rt / "run", extra=["--expert-cache", "0.5"]).start()
    g = Gateway(rt / "run", MODEL)
    yield d, g
    g.stop()
    d.stop()


@pytest.fixture
def oa(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture
def an(served):
    return anthropic.Anthropic(base_url=served[1].url, api_key="none", max_retries=0, timeout=120)


def run_tool(arguments: str) -> str:
    return json.dumps(demo.get_weather(**json.loads(arguments)))


@pytest.mark.parametrize("thinking,city,question,answer", [
    (False, "Rome", "How warm is it in Rome today?", "In Rome it is sunny and 26 degrees."),
    (True, "Tokyo", "What's the weather like in Tokyo?", "In Tokyo it is cloudy and 18 degrees.")],
    ids=["no-thinking", "thinking"])
def test_openai_tool_call_round_trip(oa, thinking, city, question, answer):
    """The call (after the model's reasoning, when it thinks) and, with the tool's result, the answer."""
    messages = [{"role": "user", "content": question}]
    extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
    r = oa.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], temperature=0, max_tokens=96,
                                   extra_body=extra)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": city}
    assert not choice.message.content
    reasoning = getattr(choice.message, "reasoning_content", None)
    assert bool(reasoning) == thinking, reasoning
    messages += [choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                 {"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.arguments)}]
    r = oa.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], temperature=0, max_tokens=96,
                                   extra_body=extra)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == answer
    assert not r.choices[0].message.tool_calls
    # the prefix cache (on by default): the conversation's first turn is not read again
    assert 0 < r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


@pytest.mark.parametrize("thinking,city,question,answer", [
    (False, "Rome", "How warm is it in Rome today?", "In Rome it is sunny and 26 degrees."),
    (True, "Tokyo", "What's the weather like in Tokyo?", "In Tokyo it is cloudy and 18 degrees.")],
    ids=["no-thinking", "thinking"])
def test_responses_tool_call_round_trip(oa, thinking, city, question, answer):
    """OpenAI's Responses API (Codex CLI's): the call as a function_call item (after a reasoning item when the
    model thinks), the same streamed (the SDK's snapshot), and with the function_call_output the chat API's answer."""
    args = dict(model="tiny", tools=[RESPONSES_TOOL], temperature=0, max_output_tokens=96,
                reasoning={"effort": "high" if thinking else "none"})
    r = oa.responses.create(input=question, **args)
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning"] * thinking + ["function_call"]
    call = r.output[-1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": city}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert (r.usage.output_tokens_details.reasoning_tokens > 0) == thinking
    with oa.responses.stream(input=question, **args) as s:
        events = list(s)
        streamed = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))

    def same(o):  # the stream helper's snapshot also holds parsed_arguments
        return o.model_dump(exclude={"id", "call_id", "parsed_arguments"})
    assert [same(o) for o in streamed.output] == [same(o) for o in r.output]
    # the conversation sent back whole, as a client that stores nothing does (the reasoning left out, as the chat
    # API's round trip above leaves it: Qwen3's template would show it, and the tiny model was not trained on that)
    items = [{"role": "user", "content": question}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": run_tool(call.arguments)}]
    r = oa.responses.create(input=items, **args)
    assert r.status == "completed" and r.output_text == answer
    assert [o.type for o in r.output] == ["reasoning"] * thinking + ["message"]
    assert 0 < r.usage.input_tokens_details.cached_tokens < r.usage.input_tokens


def test_openai_streamed_call_is_the_plain_one(oa):
    args = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[TOOL],
                temperature=0, max_tokens=96, extra_body=NO_THINKING)
    plain = oa.chat.completions.create(**args).choices[0].message.tool_calls[0]
    name, arguments, finish = None, "", None
    for ch in oa.chat.completions.create(stream=True, **args):
        for d in ch.choices[0].delta.tool_calls or []:
            name = name or d.function.name
            arguments += d.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and name == plain.function.name == "get_weather"
    assert json.loads(arguments) == json.loads(plain.function.arguments) == {"city": "Paris"}


def test_parallel_tool_calls_false_stops_after_the_first(served, oa):
    """The model calls the tool twice for two cities; asked for one call, the gateway gives the first and stops the
    request there (fewer tokens generated, the lane freed)."""
    args = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather in Tokyo and in London?"}],
                tools=[TOOL], temperature=0, max_tokens=96, extra_body=NO_THINKING)
    both = oa.chat.completions.create(**args)
    assert both.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in both.choices[0].message.tool_calls] == \
        [{"city": "Tokyo"}, {"city": "London"}]
    one = oa.chat.completions.create(parallel_tool_calls=False, **args)
    assert one.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in one.choices[0].message.tool_calls] == [{"city": "Tokyo"}]
    assert one.usage.completion_tokens < both.usage.completion_tokens
    wait_idle(served[0])
    streamed = [d for ch in oa.chat.completions.create(parallel_tool_calls=False, stream=True, **args)
                for d in (ch.choices[0].delta.tool_calls or [])]
    assert {d.index for d in streamed} == {0}
    wait_idle(served[0])


def test_anthropic_tool_use_round_trip(an):
    messages = [{"role": "user", "content": "What is the weather in Tokyo and in London?"}]
    m = an.messages.create(model="tiny", max_tokens=96, messages=messages, tools=[ANTHROPIC_TOOL],
                           extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "London"})]
    one = an.messages.create(model="tiny", max_tokens=96, messages=messages, tools=[ANTHROPIC_TOOL],
                             tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                             extra_body={"temperature": 0})
    assert one.stop_reason == "tool_use" and [b.input for b in one.content if b.type == "tool_use"] == \
        [{"city": "Tokyo"}]
    messages += [{"role": "assistant", "content": [b.model_dump(include={"type", "id", "name", "input"})
                                                   for b in uses]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                               "content": run_tool(json.dumps(u.input))} for u in uses]}]
    m = an.messages.create(model="tiny", max_tokens=96, messages=messages, tools=[ANTHROPIC_TOOL],
                           extra_body={"temperature": 0})
    assert m.stop_reason == "end_turn" and m.usage.cache_read_input_tokens > 0
    assert m.content[-1].text == "In Tokyo it is cloudy and 18 degrees, and in London it is rainy and 12 degrees."


def test_reasoning_streamed_and_as_thinking_blocks(oa, an):
    """The model's reasoning: OpenAI's stream gives it as reasoning_content deltas before the call (joined, the
    whole answer's); Anthropic's `thinking` gives a thinking block, streamed as thinking_delta events."""
    messages = [{"role": "user", "content": "What's the weather like in Tokyo?"}]
    args = dict(model="tiny", messages=messages, tools=[TOOL], temperature=0, max_tokens=96,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    whole = oa.chat.completions.create(**args).choices[0].message
    deltas = [c.choices[0].delta for c in oa.chat.completions.create(stream=True, **args) if c.choices]
    kinds = ["reasoning" if getattr(d, "reasoning_content", None) else "call" if d.tool_calls else "" for d in deltas]
    assert "call" in kinds and kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
    thinking = dict(model="tiny", max_tokens=96, messages=messages, tools=[ANTHROPIC_TOOL],
                    thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
    m = an.messages.create(**thinking)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].thinking == whole.reasoning_content and m.content[1].input == {"city": "Tokyo"}
    with an.messages.stream(**thinking) as s:
        events = list(s)
        final = s.get_final_message()
    streamed = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert len(streamed) > 1 and "".join(streamed) == m.content[0].thinking
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("thinking", None),
                                                                            ("tool_use", {"city": "Tokyo"})]


def test_tool_choice_none_and_required(oa, an):
    """none: the tools are neither shown nor parsed (the same prompt and reply as without tools); required (any):
    the reply is a call."""
    base = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
                max_tokens=48, extra_body=NO_THINKING)
    bare = oa.chat.completions.create(**base)
    none = oa.chat.completions.create(tools=[TOOL], tool_choice="none", **base)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason != "tool_calls"
    assert (none.usage.prompt_tokens, none.choices[0].message.content) == \
        (bare.usage.prompt_tokens, bare.choices[0].message.content)
    required = oa.chat.completions.create(tools=[TOOL], tool_choice="required", **base)
    assert required.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in required.choices[0].message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    a = dict(model="tiny", max_tokens=48, messages=base["messages"], tools=[ANTHROPIC_TOOL],
             extra_body={"temperature": 0})
    m = an.messages.create(tool_choice={"type": "none"}, **a)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == bare.choices[0].message.content
    m = an.messages.create(tool_choice={"type": "any"}, **a)
    assert m.stop_reason == "tool_use" and [(b.name, b.input) for b in m.content if b.type == "tool_use"] == \
        [("get_weather", {"city": "Paris"})]
