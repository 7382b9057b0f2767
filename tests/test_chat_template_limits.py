"""A chat template from a downloaded model file cannot make a render take the host's memory or hold the process that
renders: what it would write or build past MAX_CHARS, or a render past MAX_SECONDS, is a ChatTemplateError saying so,
refused from the operands' sizes before anything is allocated (a child under a memory limit shows it). Real
templates render long conversations as before, and the daemon refuses such a request (bad_request, HTTP 400) and
goes on serving."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

import realvocab as rv
from daemon_harness import ROOT, Daemon
from tiny_models import tiny_with_template
from protos import messages as M
from stratad.client import RequestError
from stratad.gateway.local_client import free_port
from stratad.model import chat_template
from stratad.model.chat_template import MAX_CHARS, ChatTemplate, ChatTemplateError
from stratad.model.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "hi"}]
TOO_BIG = r"^chat template (builds a value of \d+ characters, over the limit of 33554432|output exceeds 33554432 " \
          r"characters)$"

HOSTILE = {
    "str_times": "{{ 'x' * 10**10 }}",
    "times_str": "{{ 10**10 * messages[0].content }}",
    "list_times": "{{ [1] * 10**10 }}",  # all constants: Jinja would fold it while compiling, at the GGUF's load
    "center": "{{ 'x' | center(10**10) }}",
    "center_constant": "{{ 1 | string | center(10**10) }}",
    "percent_star": "{{ '%*s' % (10**10, 'x') }}",
    "percent_width": "{{ '%10000000000s' % 'x' }}",
    "percent_precision": "{{ '%.10000000000f' % 1.5 }}",
    "format_filter": "{{ '%*s' | format(10**10, 'x') }}",
    "replace_repeated": "{% set ns = namespace(s='ab') %}{% for i in range(10) %}"
                        "{% set ns.s = ns.s | replace('', 'x' * 10**5) %}{% endfor %}{{ ns.s }}",
    "replace_method": "{% set ns = namespace(s='ab') %}{% for i in range(10) %}"
                      "{% set ns.s = ns.s.replace('', 'x' * 10**5) %}{% endfor %}{{ ns.s }}",
    "str_methods": "{{ messages[0].content.ljust(10**10) }}",
    "bytes_methods": "{{ 'x'.encode().center(10**10) }}",
    "str_format": "{{ '{:>{}}'.format('x', 10**10) }}",
    "format_map": "{{ '{a:>10000000000}'.format_map({'a': 1}) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(10**8) }}",
    "translate": "{{ ('a' * 1000).translate({97: 'x' * 10**6}) }}",
    "join": "{{ ([''] * 10**5) | join('x' * 10**5) }}",
    "indent": "{{ 'a\nb' | indent(10**10) }}",
    "wordwrap": "{{ ('x ' * 10**6) | wordwrap(1, wrapstring='y' * 10**5) }}",
    "batch": "{{ [1] | batch(10**10, 0) | list | length }}",
    "slice": "{{ [1] | slice(10**10) | list | length }}",
    "sum_of_lists": "{{ ([[1]] * 10**6) | sum(start=[]) | length }}",
    "tojson_indent": "{{ [[[1]]] | tojson(indent=10**9) }}",
    "doubling_plus": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "doubling_tilde": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling_macro": "{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}"
                      "{% for i in range(64) %}{% set ns.s = twice(ns.s) %}{% endfor %}",
    "doubling_list": "{% set ns = namespace(l=['x' * 1000]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                     "{% endfor %}{{ ns.l | string | length }}",
    "nested_literals": "{% set a = 'x' * 1000 %}{% set b = [a, a, a, a, a, a, a, a, a, a] %}"
                       "{% set c = [b, b, b, b, b, b, b, b, b, b] %}{% set d = [c, c, c, c, c, c, c, c, c, c] %}"
                       "{% set e = [d, d, d, d, d, d, d, d, d, d] %}{% set f = [e, e, e, e, e, e, e, e, e, e] %}"
                       "{{ f | string | length }}",
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}xxxx{% endfor %}{% endfor %}",
    "nested_loops_in_a_block": "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}"
                               "{% endfor %}{% endfor %}{% endset %}",
    "big_power": "{{ 3 ** (10**9) }}",
    "repeated_squares": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
                        "{% endfor %}",
}


def _says(name: str) -> str:
    """What the refusal of HOSTILE[name] says."""
    if name in ("big_power", "repeated_squares"):
        return r"^chat template computes a number of more than 65536 bits$"
    return TOO_BIG


def _refused(source: str, messages=CHAT) -> tuple[str, float]:
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source).render(messages)
    return str(e.value), time.perf_counter() - t0


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_refused_quickly(name):
    message, took = _refused(HOSTILE[name])
    assert took < 3, took
    assert re.match(_says(name), message), message


def test_hostile_templates_allocate_nothing_big():
    """In a child limited to 1 GiB of address space beyond what it has after its imports, every hostile template is
    refused by the limits (none with a MemoryError: nothing near its size was asked for)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_AS is enforced on Linux")
    child = (
        "import json, resource, sys\n"
        "from stratad.model.chat_template import ChatTemplate, ChatTemplateError\n"
        "vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize:')) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))\n"
        "out = {}\n"
        "for name, source in json.load(sys.stdin).items():\n"
        "    try:\n"
        "        ChatTemplate(source).render([{'role': 'user', 'content': 'hi'}])\n"
        "        out[name] = 'rendered'\n"
        "    except ChatTemplateError as e:\n"
        "        out[name] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run([sys.executable, "-c", child], input=json.dumps(HOSTILE), capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out.keys() == HOSTILE.keys()
    for name, message in out.items():
        assert re.match(_says(name), message), (name, message)  # not "chat template failed: MemoryError"


def test_a_loop_that_writes_nothing_stops_at_the_deadline(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.5)  # 10 s in the daemon: this test waits less
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    message, took = _refused(spin)
    assert message == "chat template took longer than 0.5 s" and 0.5 <= took < 2, (message, took)
    calls = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}"  # 2**60
    message, took = _refused(calls)
    assert message == "chat template took longer than 0.5 s" and 0.5 <= took < 2, (message, took)


@pytest.mark.parametrize("name", ["list_times", "center_constant", "big_power"])
def test_loading_a_hostile_template_is_quick(name):
    """Jinja folds constant expressions while it compiles (at the GGUF's load): not these ones."""
    t0 = time.perf_counter()
    ChatTemplate(HOSTILE[name])
    assert time.perf_counter() - t0 < 1


def test_values_within_the_limits_render():
    source = ("{{ 'ab' * 1000 }}|{{ 'x' | center(9) }}|{{ '%5s' % 'x' }}|{{ [1, 2] * 2 }}|{{ 'a\tb'.expandtabs(4) }}"
              "|{{ '{:>4}'.format('x') }}|{{ 'a\nb' | indent(2) }}|{{ [[1], [2]] | sum(start=[]) }}|{{ 2 ** 10 }}"
              "|{{ {'a': [1]} | tojson(indent=2) }}|{{ [1, 2, 3] | batch(2, 0) | list }}")
    text = ChatTemplate(source).render(CHAT)
    assert text == ("ab" * 1000 + "|    x    |    x|[1, 2, 1, 2]|a   b|   x|a\n  b|[1, 2]|1024|"
                    + json.dumps({"a": [1]}, indent=2) + "|[[1, 2], [3, 0]]")
    big = "y" * (MAX_CHARS // 2)
    assert len(ChatTemplate("{{ messages[0].content }}").render([{"role": "user", "content": big}])) == len(big)


# ------------------------------------------------------------------------------------------------ real templates

TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool number {i}: does its thing.\n" * 3,
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "description": "A file path"},
        "count": {"type": "integer", "minimum": 1}, "mode": {"type": "string", "enum": ["a", "b"]}},
        "required": ["path"]}}} for i in range(30)]


def _conversation(n: int, chars: int) -> list[dict]:
    """A coding agent's conversation: n turns of a request, a call and its result."""
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(n):
        messages += [
            {"role": "user", "content": f"Step {i}: fix the bug.\n" + "def f(x):\n    return x\n" * (chars // 24)},
            {"role": "assistant", "content": f"Calling tool {i % 30}.", "reasoning_content": "Look at it first.",
             "tool_calls": [{"id": f"c{i}", "type": "function",
                             "function": {"name": f"tool_{i % 30}", "arguments": {"path": f"src/{i}.py"}}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "ok\n" * (chars // 3)},
        ]
    return messages


@pytest.mark.parametrize("template", ["qwen3", "coder"])
def test_real_templates_render_long_conversations_as_transformers(template):
    """200 messages with 30 tools, as transformers renders them (what they rendered before the limits); the
    largest request the daemon takes (8 MiB of messages) renders well within them."""
    transformers = pytest.importorskip("transformers")
    tok = rv.qwen3(rv.QWEN3_TEMPLATE if template == "qwen3" else rv.CODER_TEMPLATE)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf, chat_template=tok.chat_template,
                                              eos_token="<|im_end|>", pad_token="<|endoftext|>")
    messages = _conversation(66, 1500)[:200]
    text = tok.apply_chat_template(copy.deepcopy(messages), tools=TOOLS)
    assert text == hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.count("<|im_start|>") > 150 and "tool_29" in text
    big = _conversation(70, 60_000)  # ~8.4 MB of text
    t0 = time.perf_counter()
    assert len(tok.apply_chat_template(big, tools=TOOLS)) > 8_000_000
    assert time.perf_counter() - t0 < 2


# ------------------------------------------------------------------------------------------------ the daemon

# A template whose one branch asks for an 80 GB list: all constants, which Jinja would have built while loading
SOMETIMES_HOSTILE = (
    "{% if messages[-1].content == 'boom' %}{{ [0] * 10**10 }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tiny_with_template(tmp_path_factory.mktemp("hostile") / "tiny-hostile-template.gguf", SOMETIMES_HOSTILE,
                              "stratad-tiny-hostile")
    port = free_port()
    d = Daemon(path, tmp_path_factory.mktemp("hostilert") / "run", http=f"127.0.0.1:{port}").start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    yield d, url, Tokenizer.from_file(path)
    d.stop()


def test_the_daemon_refuses_the_request_and_goes_on_serving(served):
    d, url, tok = served
    boom = [{"role": "user", "content": "boom"}]
    with d.client() as c:
        t0 = time.perf_counter()
        with pytest.raises(RequestError) as e:
            c.generate(messages=boom, max_tokens=4).result()
        assert time.perf_counter() - t0 < 5
        assert e.value.code == M.ErrorCode.BAD_REQUEST and "over the limit of 33554432" in e.value.message, e.value
        ok = c.generate(messages=CHAT, max_tokens=4)
        ok.result()
        assert ok.tokens and ok.stats.prompt_tokens == len(tok.encode_chat(CHAT))
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": boom, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400, r.text
    assert "chat template builds a value" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    assert d.proc.poll() is None
