"""Property-based HTTP bodies (hypothesis) through the gateway's intake, as a handler meets them: each endpoint's
valid body with one value anywhere in it (a message's content part, a tool's schema, a sampling field) replaced by
a value of another type, removed, or given a stranger beside it, and bodies that are not JSON objects. Each is made
into its request and the daemon's Job (rendered by the real Qwen3 and Qwen3-Coder templates and counted), or
refused as the client's error (a 4xx naming it): never an internal error, which the client would see as a 500.
A sample of them also goes over HTTP to the real daemon's gateway: a 4xx in its API's error shape or a reply read
whole, and the daemon then serves a greedy request as it did before."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon_harness import Daemon
from tiny_models import tiny_with_template
from stratad.gateway.backend import Model
from stratad.gateway.errors import ApiError
from stratad.gateway.intake import _ENDPOINTS, prepare
from stratad.gateway.local_client import LocalGateway, free_port

EXAMPLES = 150  # per endpoint and template: in-process, a few seconds each on 2 cores
HTTP_EXAMPLES = 40  # per endpoint, to the daemon: ~0.02 s each
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
         "responses": "/v1/responses", "count_tokens": "/v1/messages/count_tokens"}
REALDATA = Path(__file__).parent / "data" / "realdata"
TEMPLATES = {"qwen3": "Qwen-Qwen3-0.6B.jinja", "qwen3-coder": "Qwen3-Coder.jinja"}

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
# a valid body of each endpoint using most of what it takes: turns of every role, parts, tools, calls, sampling
VALID = {
    "chat": {
        "model": "m", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n\n"],
        "stream": True, "stream_options": {"include_usage": True}, "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "weather", "description": "d", "parameters": WEATHER}}],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Rome?"}, {"type": "text", "text": "Now."}]},
            {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "user", "content": "Thanks"}],
    },
    "completions": {"model": "m", "prompt": "Once upon", "max_tokens": 4, "temperature": 0, "stop": "\n",
                    "stream": False, "seed": 3},
    "messages": {
        "model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}], "temperature": 0.5,
        "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 1024}, "stream": True,
        "tool_choice": {"type": "auto"},
        "tools": [{"name": "weather", "description": "d", "input_schema": WEATHER}],
        "messages": [
            {"role": "user", "content": "Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "Thanks"}]}],
    },
    "responses": {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 16, "stream": True, "store": False,
        "temperature": 0.7, "parallel_tool_calls": True, "tool_choice": "auto",
        "reasoning": {"effort": "medium"},
        "tools": [{"type": "function", "name": "weather", "description": "d", "parameters": WEATHER,
                   "strict": False}],
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Rome?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Look it up."}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
            {"role": "user", "content": "Thanks"}],
    },
}
VALID["count_tokens"] = {k: v for k, v in VALID["messages"].items()
                         if k in ("model", "system", "messages", "tools", "tool_choice", "thinking")}

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                    st.text(max_size=12), st.sampled_from(["", "user", "assistant", "tool", "function", "text",
                                                           "auto", "none", "required", "{}", "{", "null"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=8)


def _paths(value, at=()):
    """Every place in a JSON value: (path, its value)."""
    yield at, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from _paths(v, at + (k,))


def _mutate(draw, body) -> None:
    """body changed at one place: its value replaced, removed, or a stranger beside it."""
    path, value = draw(st.sampled_from(list(_paths(body))[1:]))
    parent = body
    for k in path[:-1]:
        parent = parent[k]
    how = draw(st.sampled_from(["replace", "remove", "stranger"]))
    if how == "replace":
        parent[path[-1]] = draw(JSON)
    elif how == "remove":
        del parent[path[-1]]
    elif isinstance(value, dict):
        value[draw(st.text(max_size=8))] = draw(JSON)
    elif isinstance(value, list):
        value.insert(draw(st.integers(0, len(value))), draw(JSON))
    else:
        parent[path[-1]] = [value, value]


@st.composite
def mutated(draw, endpoint: str) -> bytes:
    """endpoint's valid body, changed at one to three places."""
    body = copy.deepcopy(VALID[endpoint])
    for _ in range(draw(st.integers(1, 3))):
        if body:
            _mutate(draw, body)
    return json.dumps(body, allow_nan=True).encode()


def bodies(endpoint: str):
    return st.one_of(mutated(endpoint), mutated(endpoint), mutated(endpoint), mutated(endpoint),
                     JSON.map(lambda v: json.dumps(v).encode()),  # a JSON value, an object only by chance
                     st.binary(max_size=64))


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def model(request, tmp_path_factory):
    return Model(tiny_with_template(tmp_path_factory.mktemp("fuzzbodies") / f"tiny-{request.param}.gguf",
                                    (REALDATA / TEMPLATES[request.param]).read_text(),
                                    f"stratad-tiny-{request.param}"), 8192)


def test_the_valid_bodies_are_taken(model):
    for endpoint in _ENDPOINTS:
        got = prepare(model, endpoint, json.dumps(VALID[endpoint]).encode(), compact=False)
        assert got.job is not None or got.input_tokens > 0, endpoint


def _with(endpoint: str, path: tuple, value) -> bytes:
    body = copy.deepcopy(VALID[endpoint])
    parent = body
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return json.dumps(body).encode()


# what the fuzzing found (each was a 500: a TypeError or an AttributeError in the gateway), and the 400 it gets now
@pytest.mark.parametrize("endpoint,path,value,param", [
    ("chat", ("messages", 1, "content", 0, "type"), ["text"], "messages[1].content[0].type"),
    ("chat", ("messages", 1, "content", 0, "text"), 7, "messages[1].content[0].text"),
    ("messages", ("messages", 1, "content", 2, "id"), ["t1"], "messages[1].content[2].id"),
    ("messages", ("messages", 2, "content", 0, "tool_use_id"), {}, "messages[2].content[0].tool_use_id"),
    ("messages", ("messages", 1, "content", 0, "thinking"), 1, "messages[1].content[0].thinking"),
    ("responses", ("input", 3, "call_id"), ["c1"], "input[3].call_id"),
    ("responses", ("input", 3, "arguments"), ["{}"], "input[3].arguments"),
    ("responses", ("input", 4, "call_id"), [None], "input[4].call_id"),
    ("responses", ("text",), {"format": "json"}, "text.format"),
])
def test_a_value_of_the_wrong_type_inside_a_part_is_named(model, endpoint, path, value, param):
    with pytest.raises(ApiError) as e:
        prepare(model, endpoint, _with(endpoint, path, value), compact=False)
    assert (e.value.kind, e.value.param) == ("invalid_request", param), e.value.message


@pytest.mark.parametrize("endpoint,path", [("chat", ("tools", 0, "function", "parameters", "properties")),
                                           ("messages", ("tools", 0, "input_schema", "properties")),
                                           ("responses", ("tools", 0, "parameters", "properties"))])
def test_a_tool_schema_without_object_properties_is_shown_as_written(model, endpoint, path):
    for props in (True, [1], {"city": "string"}):
        assert prepare(model, endpoint, _with(endpoint, path, props), compact=False).job.generate["tools"]


@pytest.mark.parametrize("endpoint", sorted(_ENDPOINTS))
def test_a_body_is_taken_or_refused_as_the_clients_error(model, endpoint):
    @FUZZ
    @given(body=bodies(endpoint))
    def check(body):
        for compact in (False, True):  # in the event loop, and as the intake worker prepares a big body
            try:
                prepare(model, endpoint, body, compact)
            except ApiError as e:
                assert e.kind == "invalid_request", (e.kind, e.message)
                assert e.message

    check()


def test_the_daemon_answers_every_body_as_the_clients_error_or_a_reply(tiny_model_path, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu", http=addr)
    greedy = {"model": "m", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Hello"}]}
    try:
        d.start()
        LocalGateway(int(addr.rpartition(":")[2])).wait_healthy(60)
        with httpx.Client(base_url=f"http://{addr}", timeout=60) as http:
            before = http.post(PATHS["chat"], json=greedy).json()["choices"][0]["message"]
            for endpoint in sorted(_ENDPOINTS):
                @settings(FUZZ, max_examples=HTTP_EXAMPLES)
                @given(body=bodies(endpoint))
                def check(body):
                    r = http.post(PATHS[endpoint], content=body, headers={"Content-Type": "application/json"})
                    assert r.status_code in (200, 400), (r.status_code, r.text[:300])
                    if r.status_code == 400:
                        err = r.json()["error"]
                        assert err["message"] and err["type"] == "invalid_request_error", err
                        assert (r.json().get("type") == "error") == (endpoint in ("messages", "count_tokens"))

                check()
            assert http.post(PATHS["chat"], json=greedy).json()["choices"][0]["message"] == before
        assert d.stop() == 0
    finally:
        if d.proc is not None:
            d.stop()
