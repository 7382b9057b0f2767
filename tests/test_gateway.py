"""The HTTP gateway against the real daemon on two CPU cards, with the official openai and anthropic packages as
clients. The tiny model (random weights) carries Qwen3's real chat template, so tools, tool calls, tool results and
enable_thinking are rendered as Qwen3 renders them; it never writes a tool call by itself, so the calls seen here
are forced (tool_choice) and the round trip is checked where it is exact: the prompt the daemon read. Calls the
model writes itself, and their results answered, are test_gateway_tools.py's (the trained tiny model)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_harness import MAX_GAP_S, ROOT, Daemon, Stalls
from tiny_models import tiny_with_template
from stratad.intake_worker import MAX_WAITING
from stratad.gateway.parsing import OutputParser
from stratad.model.tokenizer import Tokenizer

QWEN3_TEMPLATE = (ROOT / "tests" / "data" / "realdata" / "Qwen-Qwen3-0.6B.jinja").read_text()
KEY = "test-key-0123456789"
GREEDY = {"temperature": 0}  # Anthropic's SDK no longer has sampling arguments; the gateway still reads them
CHAT = [{"role": "user", "content": "Tell me about the experts on the cards."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """python -m stratad.gateway as the coordinator starts it, on a free loopback port."""

    def __init__(self, runtime_dir: Path, model: Path, *extra: str, wait_for: int = 200):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = runtime_dir.parent / f"gateway-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stratad.gateway", "--runtime-dir", str(runtime_dir), "--listen",
             f"127.0.0.1:{self.port}", "--model", str(model), *extra],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == wait_for:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(self.log.read_text())

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(15)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny preset with Qwen3's chat template in its GGUF."""
    return tiny_with_template(tmp_path_factory.mktemp("gwmodel") / "tiny-qwen3.gguf", QWEN3_TEMPLATE,
                              "stratad-tiny-qwen3")


class Supervised:
    """The gateway `stratad serve` starts itself (config key http), with the /health answers seen while the daemon
    started."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.seen: list[tuple[bool, int]] = []  # (the daemon was ready, /health's status)
        self.ready = threading.Event()
        self.done = threading.Event()
        self.t = threading.Thread(target=self.watch, daemon=True)
        self.t.start()

    def watch(self):
        while not self.done.is_set():
            try:
                ready = self.ready.is_set()
                self.seen.append((ready, httpx.get(self.url + "/health", timeout=2).status_code))
                if ready and self.seen[-1][1] == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.05)


@pytest.fixture(scope="module")
def daemon_and_gateway(model, tmp_path_factory):
    rt = tmp_path_factory.mktemp("gwrt")
    (rt / "api-key").write_text(KEY + "\n")
    port = free_port()
    cfg = rt / "stratad.toml"
    # two lanes and one waiting: the next request finds the queue full; lane 0's longer routing warm-up (~4 s)
    # keeps the lanes starting well after the gateway listens
    cfg.write_text(f'queue_limit = 1\nwarmup_tokens = 1024\nhttp = "127.0.0.1:{port}"\n'
                   f'api_key_file = "{rt / "api-key"}"\nprefix_cache = false\n')  # fresh reads: no cached tokens
    g = Supervised(port)
    d = Daemon(model, rt / "run", extra=["--expert-cache", "0.5"], config=cfg, http=None).start()  # the config's http
    g.ready.set()
    g.t.join(30)
    g.done.set()
    yield d, g
    d.stop()


@pytest.fixture(scope="module")
def daemon(daemon_and_gateway):
    return daemon_and_gateway[0]


@pytest.fixture(scope="module")
def gateway(daemon_and_gateway):
    return daemon_and_gateway[1]


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer.from_file(model)


@pytest.fixture
def oa(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def an(gateway):
    return anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=120)


def zmq_run(daemon, **kw):
    with daemon.client() as c:
        s = c.generate(**kw)
        s.result()
        return s


def metrics(gateway) -> dict:
    text = httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_idle(daemon, timeout_s=15.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if all(ln.req_id is None for ln in daemon.status().lanes):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"a lane is still busy: {daemon.status().lanes}")


# ---- serving -------------------------------------------------------------------------------------------------
def test_started_by_the_daemon_health_follows_the_lanes(gateway, daemon, oa):
    """`http` in the config: stratad serve starts the gateway; /health is 503 until the lanes serve, then 200."""
    codes = [code for _, code in gateway.seen]
    assert codes[-1] == 200 and set(codes) <= {200, 503}, codes
    assert 503 not in codes[codes.index(200):], codes  # ready stays ready
    assert 503 in codes, codes  # the gateway listens before the lanes serve
    assert [m.id for m in oa.models.list().data] == ["tiny-qwen3"]
    assert httpx.get(gateway.url + "/health").json()["status"] == "ok"


def test_health_without_a_daemon(model, tmp_path):
    g = Gateway(tmp_path / "none", model, wait_for=503)
    try:
        r = httpx.get(g.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = httpx.post(g.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT})
        assert r.status_code == 503 and r.json()["error"]["code"] == "daemon_unavailable"
    finally:
        g.stop()


def test_a_taken_http_address_stops_the_daemon_naming_it(model, tmp_path):
    """The daemon binds the gateway's address before any lane starts: taken, `stratad serve` ends at once with an
    error naming the address and the setting (instead of a gateway restarted for ever), leaving nothing behind."""
    rt = tmp_path / "rt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        addr = f"127.0.0.1:{s.getsockname()[1]}"
        r = subprocess.run([sys.executable, "-m", "stratad.cli", "serve", "--model", str(model), "--cards", "cpu",
                            "--runtime-dir", str(rt), "--http", addr], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"error: http = '{addr}': the HTTP gateway cannot listen there" in r.stderr, r.stderr[-2000:]
    assert "lane 0" not in r.stderr and "gateway started" not in r.stderr  # nothing was started
    assert sorted(p.name for p in rt.iterdir()) == []


def test_chat_plain_and_streamed_match_the_zmq_client(daemon, oa):
    """Greedy: the same tokens through HTTP as through the ZeroMQ client (text, count, finish reason, prompt)."""
    ref = zmq_run(daemon, messages=CHAT, max_tokens=16)
    r = oa.chat.completions.create(model="any", messages=CHAT, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == {"length": "length", "stop": "stop"}[ref.finish_reason]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.stats.prompt_tokens, ref.stats.generated_tokens)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(oa.chat.completions.create(model="any", messages=CHAT, max_completion_tokens=16, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.stats.generated_tokens


def test_completions_match_the_zmq_client(daemon, oa):
    ref = zmq_run(daemon, prompt="Once upon a time", max_tokens=12)
    r = oa.completions.create(model="any", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == ref.stats.generated_tokens
    streamed = oa.completions.create(model="any", prompt="Once upon a time", max_tokens=12, temperature=0,
                                     stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ref.text


def test_anthropic_messages_plain_and_streamed(daemon, an):
    """No `thinking` is Anthropic's default, thinking off: Qwen3's template then writes an empty think block."""
    ref = zmq_run(daemon, messages=CHAT, max_tokens=16, enable_thinking=False)
    m = an.messages.create(model="claude-x", max_tokens=16, messages=CHAT, extra_body=GREEDY)
    assert m.model == "claude-x" and m.content[0].type == "text" and m.content[0].text == ref.text
    assert m.usage.input_tokens == ref.stats.prompt_tokens and m.usage.output_tokens == ref.stats.generated_tokens
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.finish_reason]
    with an.messages.stream(model="claude-x", max_tokens=16, messages=CHAT, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == ref.text
    assert kinds[0] == "message_start" and kinds.index("content_block_start") < kinds.index("content_block_stop")
    assert kinds[-2:] == ["message_delta", "message_stop"]


def test_text_parts_and_a_system_message(daemon, oa, an):
    """Content as a list of text parts (joined by newlines) and a system message, in both APIs' shapes: the daemon
    reads the same prompt as the ZeroMQ client's plain strings, and answers the same."""
    system, parts = "You answer briefly.", ["Tell me about the experts", "on the cards."]
    plain = [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(parts)}]
    text_parts = [{"type": "text", "text": t} for t in parts]
    ref = zmq_run(daemon, messages=plain, max_tokens=6)
    r = oa.chat.completions.create(model="m", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": [{"type": "text", "text": system}]}, {"role": "user", "content": text_parts}])
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == (ref.text, ref.stats.prompt_tokens)
    ref = zmq_run(daemon, messages=plain, max_tokens=6, enable_thinking=False)
    m = an.messages.create(model="m", max_tokens=6, system=[{"type": "text", "text": system}], extra_body=GREEDY,
                           messages=[{"role": "user", "content": text_parts}])
    assert (m.content[0].text, m.usage.input_tokens) == (ref.text, ref.stats.prompt_tokens)


def test_openai_stop_seed_and_top_k(daemon, oa):
    """stop ends the reply before the string; a seed makes a sampled reply (temperature, top_k) the same every time
    and the same as the ZeroMQ client's with that seed."""
    ref = zmq_run(daemon, messages=CHAT, max_tokens=16)
    stop = ref.text.strip()[3:5]
    r = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=16, temperature=0, stop=["never!", stop])
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and stop not in text and ref.text.startswith(text)
    sampled = dict(model="m", messages=CHAT, max_tokens=10, temperature=1.0, extra_body={"top_k": 20})
    a, b, c = (oa.chat.completions.create(seed=seed, **sampled).choices[0].message.content for seed in (7, 7, 8))
    assert a == b == zmq_run(daemon, messages=CHAT, max_tokens=10, temperature=1.0, top_k=20, seed=7).text
    assert c != a


def test_stop_sequence_is_named(daemon, an):
    ref = zmq_run(daemon, messages=CHAT, max_tokens=16, enable_thinking=False)
    stop = ref.text.strip()[3:5]  # two characters the greedy reply writes
    m = an.messages.create(model="c", max_tokens=16, messages=CHAT, stop_sequences=[stop], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text and ref.text.startswith(m.content[0].text)


# ---- bad requests --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,field", [
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"temperature": 7}, "temperature"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": []}, "messages"), ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_openai_bad_request_names_the_field(oa, extra, field):
    args = {"model": "m", "messages": CHAT, "max_tokens": 4} | extra
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(**args)
    assert e.value.status_code == 400 and field in e.value.message


def test_prompt_too_long_names_the_limit(oa, an):
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="m", messages=CHAT, max_tokens=10**6)
    assert "context length" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="m", max_tokens=10**6, messages=CHAT)
    assert "context length" in e.value.message


def test_anthropic_bad_request_names_the_field(gateway, an):
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert "messages[0].content[0].type" in e.value.message
    r = httpx.post(gateway.url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": "m", "messages": CHAT})  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"x-api-key": KEY}, content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_an_answer_needs_a_user_turn(an):
    """A lone assistant turn is a prefill with nothing to answer: named, not "there are no messages"."""
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="m", max_tokens=4, messages=[{"role": "assistant", "content": "Hello"}])
    assert "no user turn" in e.value.message


def test_models_retrieve_and_unknown_endpoints_are_json(gateway, oa, an):
    """The openai package's models.retrieve; an endpoint this server lacks (OpenAI's Responses API, a wrong base
    URL) or a wrong method: a JSON error in the API's shape that names what is served, through the clients too."""
    assert oa.models.retrieve("tiny-qwen3").id == "tiny-qwen3"
    with pytest.raises(openai.NotFoundError) as e:
        oa.models.retrieve("gpt-4o")
    assert "'tiny-qwen3'" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        oa.vector_stores.create(name="x")
    assert "POST /v1/vector_stores" in e.value.message and "POST /v1/responses" in e.value.message
    with pytest.raises(anthropic.NotFoundError) as e:
        an.post("/v1/messages/batches", body={}, cast_to=object)
    assert "POST /v1/messages" in e.value.message
    r = httpx.get(gateway.url + "/v1/chat/completions", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "GET /v1/models" in r.json()["error"]["message"]
    r = httpx.get(gateway.url + "/v2/models", headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_responses_api_whole_and_streamed(gateway, oa):
    """POST /v1/responses through the openai package: a whole response, its stream (each event numbered in order,
    the SDK's snapshot built from them), a reply cut by max_output_tokens (incomplete), and refusals by name."""
    whole = oa.responses.create(model="m", input="Tell me about the experts.", max_output_tokens=6, temperature=0)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0 and whole.output_text
    (msg,) = whole.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    events = list(oa.responses.create(model="m", input="Tell me about the experts.", max_output_tokens=6,
                                      temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    # a body over HEAVY_BYTES (prepared in the gateway's worker, its prompt sent as token ids): the same reply, and
    # the settings it echoes kept
    pad = {"metadata": {"pad": "x" * (64 << 10)}}
    big = oa.responses.create(model="m", input="Tell me about the experts.", max_output_tokens=6, temperature=0,
                              instructions="", tools=[{"type": "function", "name": "f", "parameters": {}}],
                              tool_choice="none", extra_body=pad)
    small = oa.responses.create(model="m", input="Tell me about the experts.", max_output_tokens=6, temperature=0,
                                tools=[{"type": "function", "name": "f", "parameters": {}}], tool_choice="none")
    assert big.output_text == small.output_text and big.usage.input_tokens == small.usage.input_tokens
    assert big.tools[0].name == "f" and big.tool_choice == "none" and big.max_output_tokens == 6
    # a body shaped as Codex CLI sends it (store false, encrypted reasoning asked for, ids and statuses on the items
    # it sends back, an OpenAI reasoning item with only encrypted content): served, each event named on its own line
    codex = {"model": "stratad", "instructions": "You are a coding agent.", "store": False, "stream": True,
             "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k", "tool_choice": "auto",
             "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
             "text": {"verbosity": "medium"}, "max_output_tokens": 4,
             "tools": [{"type": "function", "name": "shell", "description": "Runs a command", "strict": False,
                        "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}}],
             "input": [{"type": "message", "role": "user", "id": "msg_0",
                        "content": [{"type": "input_text", "text": "List the files."}]},
                       {"type": "reasoning", "id": "rs_0", "summary": [], "encrypted_content": "gAAAA"},
                       {"type": "function_call", "id": "fc_0", "call_id": "call_0", "name": "shell",
                        "arguments": '{"command": ["ls"]}', "status": "completed"},
                       {"type": "function_call_output", "call_id": "call_0", "output": "README.md\n"}]}
    with httpx.stream("POST", gateway.url + "/v1/responses", json=codex, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln.removeprefix("event: ") for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(ln.removeprefix("data: ")) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in datas] and names[0] == "response.created" and names[-1] in (
        "response.completed", "response.incomplete"), names
    for field, extra in (("previous_response_id", {"previous_response_id": "resp_1"}),
                         ("text.format", {"text": {"format": {"type": "json_object"}}}),
                         ("input[0].content[0].type", {"input": [{"role": "user", "content": [
                             {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]})):
        with pytest.raises(openai.BadRequestError) as e:
            oa.responses.create(**({"model": "m", "input": "hi", "max_output_tokens": 4} | extra))
        assert field in e.value.message, e.value.message


def test_body_size_is_bounded(gateway):
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * (17 << 20) + b'"}]}'
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"x-api-key": KEY}, content=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(18):
            yield b"a" * (1 << 20)

    r = httpx.post(gateway.url + "/v1/messages", headers={"x-api-key": KEY}, content=chunked(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


# ---- tools ---------------------------------------------------------------------------------------------------
def test_tool_round_trip_is_rendered_as_the_template_renders_it(oa, an, tok):
    """A call and its result, sent back: the daemon reads exactly what Qwen3's template renders for them (the
    prompt's length, through both APIs), and the parser reads the rendered call back as the same call."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}
    convo = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]
    r = oa.chat.completions.create(model="m", messages=convo, tools=[WEATHER], max_tokens=2, temperature=0)
    rendered_msgs = CHAT + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "18C and sunny", "tool_call_id": "call_1", "name": "get_weather"}]
    text = tok.apply_chat_template(rendered_msgs, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\n18C and sunny\n</tool_response>" in text and '"name": "get_weather"' in text
    assert r.usage.prompt_tokens == len(tok.encode_chat(rendered_msgs, tools=[WEATHER]))
    # the assistant turn as rendered, read back by the output parser: the same call
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    p = OutputParser(new_id=lambda: "x")
    events = p.feed(turn) + p.finish()
    assert p.calls == 1 and events[0].name == "get_weather"
    assert json.loads("".join(e.fragment for e in events[1:-1])) == {"city": "Paris", "days": 2}
    # Anthropic's shape of the same turns (thinking off by default: the template's empty think block added)
    n = an.messages.count_tokens(model="m", tools=[{"name": "get_weather", "description": "The weather in a city",
                                                    "input_schema": WEATHER["function"]["parameters"]}],
                                 messages=CHAT + [
                                     {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1",
                                                                        "name": "get_weather",
                                                                        "input": {"city": "Paris", "days": 2}}]},
                                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                                                   "content": "18C and sunny"}]}])
    assert n.input_tokens == len(tok.encode_chat(rendered_msgs, tools=[WEATHER], enable_thinking=False))


@pytest.fixture(scope="module")
def xml_gateway(daemon, model, gateway):
    """A second gateway on the same daemon reading calls as Qwen3-Coder's XML (no key: loopback)."""
    g = Gateway(daemon.runtime_dir, model, "--tool-format", "xml")
    yield g
    g.stop()


def test_forced_call_streams_name_then_arguments(xml_gateway):
    """tool_choice naming a function: the reply is opened as that call (a prefill), so even random weights
    answer with it; OpenAI's stream gives the id and name first, then argument fragments."""
    oa = openai.OpenAI(base_url=xml_gateway.url + "/v1", api_key="unused", max_retries=0)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = oa.chat.completions.create(model="m", messages=CHAT, tools=[WEATHER], tool_choice=choice, max_tokens=24,
                                   temperature=0)
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "get_weather" and tc.id.startswith("call_")
    assert isinstance(json.loads(tc.function.arguments), dict)
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    deltas = [c.choices[0].delta.tool_calls for c in oa.chat.completions.create(
        model="m", messages=CHAT, tools=[WEATHER], tool_choice=choice, max_tokens=24, temperature=0, stream=True)
        if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].id.startswith("call_") and deltas[0][0].function.name == "get_weather"
    assert all(d[0].id is None and d[0].function.name is None for d in deltas[1:])
    assert "".join(d[0].function.arguments or "" for d in deltas) == tc.function.arguments
    an = anthropic.Anthropic(base_url=xml_gateway.url, api_key="unused", max_retries=0)
    with an.messages.stream(model="m", max_tokens=24, messages=CHAT, extra_body=GREEDY,
                            tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                            tool_choice={"type": "tool", "name": "get_weather"}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].name == "get_weather"
    assert final.content[0].id.startswith("toolu_") and "input_json" in kinds
    assert final.stop_reason in ("tool_use", "max_tokens")


def test_forced_json_call_that_does_not_parse_is_text(oa, an):
    """Qwen3's JSON format: the random continuation is no JSON object, so the call is given back as text (the
    finish reason no call's), in both APIs' whole answers and Anthropic's stream."""
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    r = oa.chat.completions.create(model="m", messages=CHAT, tools=[WEATHER], max_tokens=8, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    m = r.choices[0].message
    assert not m.tool_calls and m.content.startswith(opening) and r.choices[0].finish_reason == "length"
    args = dict(model="m", max_tokens=8, messages=CHAT, extra_body=GREEDY, tool_choice={"type": "any"},
                tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}])
    whole = an.messages.create(**args)
    with an.messages.stream(**args) as s:
        streamed = s.get_final_message()
    for msg in (whole, streamed):
        assert [b.type for b in msg.content] == ["text"] and msg.stop_reason == "max_tokens"
        assert msg.content[0].text.startswith("<tool_call>")
    assert streamed.content[0].text == whole.content[0].text


# ---- trouble -------------------------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_the_lane(gateway, daemon):
    before = metrics(gateway).get(("stratad:request_success_total", (("finished_reason", "abort"),)), 0)
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", headers={"x-api-key": KEY}, timeout=60,
                      json={"model": "m", "messages": CHAT, "max_tokens": 3000, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()  # held: a generator dropped early would close the connection here already
        seen = []
        while sum('"content"' in ln for ln in seen) < 3:
            seen.append(next(lines))
        assert any(ln.req_id for ln in daemon.status().lanes), seen
    assert wait_idle(daemon) < 5
    deadline = time.monotonic() + 5
    while metrics(gateway).get(("stratad:request_success_total", (("finished_reason", "abort"),)), 0) <= before:
        assert time.monotonic() < deadline, "the cancelled request was not counted"
        time.sleep(0.05)


def test_disconnect_before_a_plain_answer_frees_the_lane(gateway, daemon):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=httpx.Timeout(10, read=1.0),
                   json={"model": "m", "messages": CHAT, "max_tokens": 3000, "ignore_eos": True})
    assert wait_idle(daemon) < 5  # 3000 tokens would take a minute


def test_queue_full_is_429_and_529(daemon, oa, an):
    with daemon.client() as c:
        busy = [c.generate(messages=CHAT, max_tokens=3000, ignore_eos=True) for _ in range(2)]
        for s in busy:
            next(iter(s))
        queued = c.generate(messages=CHAT, max_tokens=2)
        assert queued.wait_accepted().queue_position == 1
        with pytest.raises(openai.RateLimitError) as e:
            oa.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
        assert e.value.status_code == 429 and "queue" in e.value.message
        with pytest.raises(anthropic.APIStatusError) as e:
            an.messages.create(model="m", max_tokens=2, messages=CHAT)
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        for s in busy:
            s.cancel()
            s.result()
        queued.result()
    wait_idle(daemon)


def test_metrics_parse_and_move_with_traffic(gateway, daemon, oa):
    m0 = metrics(gateway)
    r = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=5, temperature=0)
    m1 = metrics(gateway)
    gen = ("stratad:generation_tokens_total", ())
    assert m1[gen] - m0.get(gen, 0) == r.usage.completion_tokens
    assert m1[("stratad:prompt_tokens_total", ())] - m0.get(("stratad:prompt_tokens_total", ()), 0) == \
        r.usage.prompt_tokens
    assert m1[("stratad:time_to_first_token_seconds_count", ())] == m0.get(
        ("stratad:time_to_first_token_seconds_count", ()), 0) + 1
    assert m1[("stratad:daemon_up", ())] == 1 and m1[("stratad:num_requests_waiting", ())] == 0
    roles = [dict(k[1]) for k in m1 if k[0] == "stratad:lane_role"]
    assert sorted(r["lane"] for r in roles) == ["0", "1"]
    places = {dict(k[1])["place"] for k in m1 if k[0] == "stratad:lane_expert_work_share"}
    assert places == {"own_card", "peer_card", "host_read", "cpu_pool"}
    work = sum(v for k, v in m1.items() if k[0] == "stratad:expert_computations_total") - \
        sum(v for k, v in m0.items() if k[0] == "stratad:expert_computations_total")
    assert work > 0
    for name in ("stratad:lane_slots_used", "stratad:lane_slots_total", "stratad:lane_restarts_total",
                 "stratad:epoch_swaps_total", "stratad:prefix_cache_hits_total", "stratad:num_requests_running"):
        assert any(k[0] == name for k in m1), name


def test_api_key_is_enforced(gateway, model, daemon):
    body = {"model": "m", "messages": CHAT, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]}):
        r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(gateway.url + "/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(gateway.url + "/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="bad", max_retries=0).models.list()
    # not on loopback and no key: refused before it listens
    p = subprocess.run([sys.executable, "-m", "stratad.gateway", "--runtime-dir", str(daemon.runtime_dir),
                        "--listen", f"0.0.0.0:{free_port()}", "--model", str(model)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--api-key-file" in p.stderr


def test_big_bodies_do_not_pause_other_streams(daemon, gateway, an, tok):
    """Issue 26: parsing, rendering and tokenising a body grow with it; a big one (over the coordinator's
    HEAVY_BYTES) is prepared in the gateway's worker process, refused first by the daemon's own bounds. While big
    bodies are answered (a 7 MB tools description to count_tokens, a 7 MB prompt and 60,000 messages without
    max_tokens, a big body the daemon then serves), another client's stream never pauses a second
    (MAX_GAP_S)."""
    headers = {"x-api-key": KEY}
    ref = zmq_run(daemon, messages=CHAT, max_tokens=6)
    assert len(ref.text) >= 2
    stop = [ref.text[-2:]]  # greedy: the reply ends there within 6 tokens, without max_tokens
    ref = zmq_run(daemon, messages=CHAT, max_tokens=64, stop=stop)
    assert ref.finish_reason == "stop"
    times, started, done = [], threading.Event(), threading.Event()

    def other_client():
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", headers=headers, timeout=60, json={
                "model": "m", "messages": CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                times.append(time.monotonic())
                if len(times) == 5:
                    started.set()
                if done.is_set():
                    return

    t = threading.Thread(target=other_client, daemon=True)
    stalls = Stalls()  # this process's own stalls (building and sending 7 MB bodies holds the GIL) are not pauses
    t.start()
    try:
        assert started.wait(30)
        big = "the experts on the cards " * 280_000  # 7 MB
        r = httpx.post(gateway.url + "/v1/messages/count_tokens", headers=headers, timeout=60, json={
            "model": "m", "messages": CHAT, "tools": [{"name": "f", "description": big, "input_schema": {}}]})
        assert r.status_code == 400 and "exceeds the limit of" in r.json()["error"]["message"], r.text
        r = httpx.post(gateway.url + "/v1/chat/completions", headers=headers, timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": big}]})
        assert r.status_code == 400 and "exceeds the limit of" in r.json()["error"]["message"], r.text
        r = httpx.post(gateway.url + "/v1/chat/completions", headers=headers, timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": ""}] * 60_000})
        assert r.status_code == 400 and "exceed the context length" in r.json()["error"]["message"], r.text
        pad = "x" * (64 << 10)  # fields that change nothing: a body over HEAVY_BYTES with a short prompt
        n = an.messages.count_tokens(model="m", messages=CHAT, extra_body={"metadata": {"pad": pad}})
        assert n.input_tokens == len(tok.encode_chat(CHAT, enable_thinking=False))
        r = httpx.post(gateway.url + "/v1/chat/completions", headers=headers, timeout=60, json={
            "model": "m", "messages": CHAT, "stop": stop, "temperature": 0, "user": pad})
        assert r.status_code == 200, r.text
        r = r.json()
        assert (r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]) == (ref.text, "stop")
        assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == \
               (ref.stats.prompt_tokens, ref.stats.generated_tokens)
    finally:
        done.set()
        t.join(30)
        stalls.close()
    # the daemon's and the gateway's part of each pause: the spans this process was stalled itself taken off
    gaps = [(b - a - stalls.within(a, b), b - a) for a, b in zip(times[4:], times[5:])]
    assert len(gaps) > 10 and max(gaps)[0] < MAX_GAP_S, \
        f"the other stream paused {max(gaps)[0]:.2f} s ({max(gaps)[1]:.2f} s with this process's own stalls)"
    wait_idle(daemon)


def test_more_big_bodies_than_the_worker_takes_are_429_and_529(gateway):
    """At most MAX_WAITING big bodies (over HEAVY_BYTES) are in or waiting for the gateway's worker; the ones past
    that are refused at once as overloaded: 429 (OpenAI), 529 overloaded_error (Anthropic). 24 bodies of 300 KB at
    once (a prompt the worker renders and tokenises, then refuses: 400, past the context)."""
    words = "word " * 60_000

    def burst(path: str, body: dict, n: int = 24) -> list[httpx.Response]:
        go, out = threading.Barrier(n), [None] * n

        def post(i):
            with httpx.Client(headers={"x-api-key": KEY}, timeout=120) as c:
                go.wait()
                out[i] = c.post(gateway.url + path, json=body)

        ts = [threading.Thread(target=post, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        return out

    for path, body, refused in [
            ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": words}]},
             429),
            ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": words}]}, 529)]:
        rs = burst(path, body)
        codes = [r.status_code for r in rs]
        assert set(codes) <= {400, refused}, [(r.status_code, r.text[:200]) for r in rs]
        assert codes.count(400) >= MAX_WAITING and refused in codes, codes
        r = next(r for r in rs if r.status_code == refused)
        err = r.json()["error"]
        assert "large requests (over" in err["message"] and "send it again later" in err["message"], r.text
        if refused == 529:
            assert r.json()["type"] == "error" and err["type"] == "overloaded_error", r.text
        else:
            assert err["type"] == "rate_limit_error", r.text
        assert "context length" in next(r for r in rs if r.status_code == 400).json()["error"]["message"]


def gateway_process(daemon) -> psutil.Process:
    (child,) = [p for p in psutil.Process(daemon.proc.pid).children() if "stratad.gateway" in p.cmdline()]
    return child


def intake_workers(gateway_proc: psutil.Process) -> list[psutil.Process]:
    return [p for p in gateway_proc.children() if "spawn_main" in " ".join(p.cmdline())]


def test_a_killed_intake_worker_is_replaced(daemon, gateway, tok):
    """The gateway's worker for big bodies SIGKILLed: a big body then is answered (a 500 saying so, if it met the
    dead worker), a new worker is started, and it serves the next one."""
    headers = {"x-api-key": KEY}
    body = {"model": "m", "messages": CHAT, "metadata": {"pad": "x" * (64 << 10)}}  # over HEAVY_BYTES

    def count():
        return httpx.post(gateway.url + "/v1/messages/count_tokens", headers=headers, json=body, timeout=60)

    (old,) = intake_workers(gateway_process(daemon))
    old.kill()
    old.wait(10)
    r = count()
    assert r.status_code == 200 or (r.status_code == 500 and "died" in r.json()["error"]["message"]), r.text
    r = count()
    assert r.status_code == 200 and r.json()["input_tokens"] == len(tok.encode_chat(CHAT, enable_thinking=False))
    (new,) = intake_workers(gateway_process(daemon))
    assert new.pid != old.pid


def test_a_gateway_that_dies_is_restarted(daemon, gateway, oa):
    """SIGKILLed: its intake worker (started with it) follows it, and the daemon starts a new gateway, with a new
    worker, before any big body."""
    child = gateway_process(daemon)
    assert intake_workers(child), "the gateway's intake worker is not running"
    kids = child.children(recursive=True)  # the intake worker (and multiprocessing's tracker)
    child.kill()
    child.wait(10)
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, f"left behind by the gateway: {[p.cmdline() for p in alive]}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(gateway.url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the gateway was not restarted"
        time.sleep(0.1)
    assert oa.chat.completions.create(model="m", messages=CHAT, max_tokens=2).usage.completion_tokens >= 1
    new = gateway_process(daemon)
    assert new.pid != child.pid
    while not intake_workers(new):
        assert time.monotonic() < deadline, "the new gateway's intake worker was not started"
        time.sleep(0.1)


def kill_serving_lane(daemon) -> None:
    """SIGKILL the lane serving a request; status may still name a lane restarted a moment ago by its old pid
    (seen under load), so it is read again until a kill lands: for up to 60 s, since a restarted lane's first status
    took over 10 s on the 2-core box under load (a fresh-clone run beside other work)."""
    deadline = time.monotonic() + 60
    while True:
        lane = next((ln for ln in daemon.status().lanes if ln.req_id), None)
        try:
            if lane is not None:
                os.kill(lane.pid, signal.SIGKILL)
                return
        except ProcessLookupError:
            pass
        assert time.monotonic() < deadline, "no live lane serving the request"
        time.sleep(0.05)


def test_lane_death_ends_the_stream_with_an_error_event(daemon, oa, an):
    """Last (it restarts lanes): the stream ends with each API's error event, the daemon keeps serving."""
    stream = oa.chat.completions.create(model="m", messages=CHAT, max_tokens=3000, stream=True,
                                        extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    next(it)
    kill_serving_lane(daemon)
    with pytest.raises(openai.APIError) as e:
        for _ in it:
            pass
    assert "lane" in str(e.value)
    daemon.wait_ready(60, restarts=1)
    assert oa.chat.completions.create(model="m", messages=CHAT, max_tokens=2).usage.completion_tokens >= 1
    # Anthropic's stream: an `error` event (api_error) after the text so far, no message_stop
    with an.messages.stream(model="m", max_tokens=3000, messages=CHAT, extra_body={"ignore_eos": True}) as s:
        kinds = []
        with pytest.raises(anthropic.APIStatusError) as e:
            for ev in s:
                kinds.append(ev.type)
                # once: the events after the second text that were already read (its next content_block_delta,
                # before that delta's own text) kept the count at 2, and a second call, reading a status from
                # before the coordinator saw the lane die, found its pid gone and then no serving lane, ever
                if kinds.count("text") == 2 and ev.type == "text":
                    kill_serving_lane(daemon)
    assert "lane" in str(e.value) and e.value.body["error"]["type"] == "api_error"
    assert "content_block_start" in kinds and "message_stop" not in kinds
    daemon.wait_ready(60, restarts=2)
    # the Responses API: response.failed (its error naming the lane) after the text so far
    events = []
    for ev in oa.responses.create(model="m", input="hi", max_output_tokens=3000, stream=True,
                                  extra_body={"ignore_eos": True}):
        events.append(ev)
        if [e.type for e in events].count("response.output_text.delta") == 2 and ev.type.endswith("delta"):
            kill_serving_lane(daemon)
    assert events[-1].type == "response.failed" and "lane" in events[-1].response.error.message, events[-1]
    assert events[-1].response.status == "failed" and "response.completed" not in [e.type for e in events]
    daemon.wait_ready(60, restarts=3)
