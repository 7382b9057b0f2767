"""The gateway's output parser on fixed model outputs, fed whole and split at random points: the events, joined,
must be the same however the text arrives (as the daemon's chunks cut it anywhere)."""
from __future__ import annotations

import json
import random

import pytest

from stratad.gateway.parsing import (CallArgs, CallEnd, CallStart, OutputParser, Reasoning, Text, tool_format)


def parse(chunks, **kw):
    """The joined result: (text, reasoning, [(name, arguments dict or raw string)], event order kinds)."""
    ids = iter(range(1000))
    p = OutputParser(new_id=lambda: f"id{next(ids)}", **kw)
    events = [e for c in chunks for e in p.feed(c)] + p.finish()
    text = "".join(e.text for e in events if isinstance(e, Text))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls, args = [], {}
    for e in events:
        if isinstance(e, CallStart):
            calls.append([e.name, e.id])
            args[e.index] = ""
        elif isinstance(e, CallArgs):
            args[e.index] += e.fragment
    ends = [e.index for e in events if isinstance(e, CallEnd)]
    assert ends == list(range(len(calls))), "each call ends once, in order"
    out = []
    for i, (name, _id) in enumerate(calls):
        try:
            out.append((name, json.loads(args[i])))
        except ValueError:
            out.append((name, args[i]))
    return text, reasoning, out, p.calls


def splits(s: str, rng: random.Random, n: int = 25):
    yield [s]
    yield list(s)  # one character at a time
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(s)), min(len(s) - 1, rng.randint(1, 8))))
        yield [s[a:b] for a, b in zip([0] + cuts, cuts + [len(s)])]


QWEN3 = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
         '"arguments": {"city": "Paris", "unit": "C", "note": "a } and a \\" inside"}}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_time", "arguments": {"tz": ["Europe/Paris"]}}\n</tool_call>')
CODER = ('I will call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n'
         '<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{"metric": true}\n</parameter>\n<parameter=code>\n'
         'if a < b:\n    print("<x>")\n</parameter>\n</function>\n</tool_call>')
TYPES = {"get_weather": {"city": "string", "days": "integer", "opts": "object", "code": "string"}}

CASES = [
    # (output, parser options, expected (text, reasoning, calls))
    (QWEN3, {}, ("Let me check.", "The user wants the weather.",
                 [("get_weather", {"city": "Paris", "unit": "C", "note": 'a } and a " inside'}),
                  ("get_time", {"tz": ["Europe/Paris"]})])),
    (CODER, {"fmt": "xml", "param_types": TYPES},
     ("I will call it.", "", [("get_weather", {"city": "New York", "days": 3, "opts": {"metric": True},
                                              "code": 'if a < b:\n    print("<x>")'})])),
    # no reasoning, no calls: the text exactly, whitespace included
    ("  Hello, world!\n\nBye.\n", {}, ("  Hello, world!\n\nBye.\n", "", [])),
    # a template that opens <think> itself: the reply starts inside the reasoning
    ("Hmm, 2+2.\n</think>\n\n4", {"reasoning_open": True}, ("4", "Hmm, 2+2.", [])),
    # cut short while thinking (max_tokens): all of it is reasoning
    ("<think>\nstill going", {}, ("", "still going", [])),
    # looks like a call but does not parse: text, never lost
    ("Use <tool_call>not json at all</tool_call> like that", {},
     ("Use <tool_call>not json at all</tool_call> like that", "", [])),
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": [1, 2]}\n</tool_call>", {},
     ("<tool_call>\n{\"name\": \"f\", \"arguments\": [1, 2]}\n</tool_call>", "", [])),
    ("x <tool_call>{\"name\": \"f\"", {}, ("x <tool_call>{\"name\": \"f\"", "", [])),  # never closed
    ("<tool_call>\nno function here\n</tool_call>", {"fmt": "xml"},
     ("<tool_call>\nno function here\n</tool_call>", "", [])),
    # arguments first, or as a JSON string: parsed whole at the close
    ('<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', {}, ("", "", [("f", {"a": 1})])),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', {}, ("", "", [("f", {"a": 1})])),
    # tools off (tool_choice none, no tools): a call's text is text
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', {"tools_on": False},
     ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "", [])),
    # an XML call cut short: named, with the parameters it finished
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nunfinished", {"fmt": "xml"},
     ("", "", [("f", {"a": "1"})])),
    # <think> only counts at the start
    ("ok <think>not reasoning</think>", {}, ("ok <think>not reasoning</think>", "", [])),
]


@pytest.mark.parametrize("output,opts,expected", CASES, ids=range(len(CASES)))
def test_parser_any_split(output, opts, expected):
    rng = random.Random(hash(output) & 0xFFFF)
    for chunks in splits(output, rng):
        text, reasoning, calls, n = parse(chunks, **opts)
        assert (text, reasoning, calls) == expected, chunks
        assert n == len(expected[2])


def test_json_call_streams_arguments_before_it_closes():
    """First the name (a start event with the id), then argument fragments as they come, not all at the end."""
    p = OutputParser(new_id=lambda: "call_1")
    events = p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert events[0] == CallStart(0, "call_1", "get_weather")
    assert events[1:] == [CallArgs(0, '{"city": "Pa')]
    assert p.feed('ris"}') == [CallArgs(0, 'ris"}')]
    assert p.feed("}\n</tool_call>") == [CallEnd(0)]


def test_xml_call_streams_each_parameter():
    p = OutputParser(fmt="xml", new_id=lambda: "c")
    assert p.feed("<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n") == [
        CallStart(0, "c", "run"), CallArgs(0, '{"cmd": "ls"')]
    assert p.feed("</function>\n</tool_call>") == [CallArgs(0, "}"), CallEnd(0)]


def test_text_is_held_only_while_it_could_open_a_call():
    p = OutputParser()
    assert p.feed("Hello <tool") == [Text("Hello")]  # " <tool" might become <tool_call>
    assert p.feed("box> there") == [Text(" <toolbox> there")]


def test_tool_format_from_template():
    assert tool_format("... <tool_call>\n<function=name>\n<parameter=...") == "xml"
    assert tool_format('... <tool_call>\n{"name": <function-name>, ...') == "json"
    assert tool_format("{{ message['content'] }}") == "json"
