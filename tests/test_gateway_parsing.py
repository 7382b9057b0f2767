"""The gateway's output parser on fixed model outputs, fed whole and split at random points: the events, joined,
must be the same however the text arrives (as the daemon's chunks cut it anywhere). Each output is read both ways
the gateway gives calls: streamed (OpenAI's stream) and held (whole answers, Anthropic's stream)."""
from __future__ import annotations

import json
import random

import jiter
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratad.gateway.parsing import (CallArgs, CallEnd, CallStart, OutputParser, Reasoning, Text, tool_format)


def parse(chunks, **kw):
    """The joined result: (text, reasoning, [(name, arguments dict or raw string)], calls given). Streamed, each
    call's arguments as sent are the start of valid JSON (what a client's partial parser reads) and a call's ok
    says whether they parse whole; held, every call given parses."""
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
    ends = [e for e in events if isinstance(e, CallEnd)]
    assert [e.index for e in ends] == list(range(len(calls))), "each call ends once, in order"
    out = []
    for i, (name, _id) in enumerate(calls):
        jiter.from_json(args[i].encode(), partial_mode="trailing-strings")  # never invalid JSON, even unfinished
        try:
            out.append((name, json.loads(args[i])))
            assert isinstance(out[-1][1], dict) and ends[i].ok
        except ValueError:
            assert not ends[i].ok and not kw.get("hold_calls"), args[i]
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
    # <think> only counts at the start
    ("ok <think>not reasoning</think>", {}, ("ok <think>not reasoning</think>", "", [])),
]


# Calls that break off, in both formats: (output, parser options, streamed, held). Streamed, a call already begun
# ends where it broke, its arguments the valid start of JSON sent so far, and what follows its </tool_call> is text
# again; held, the call is text as written. Neither lets unfinished arguments swallow the close or what follows.
BROKEN = [
    # an argument object never closed before </tool_call>
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1\n</tool_call>\nAfter.', {},
     ("After.", "", [("f", '{"a": 1\n')]),
     ('<tool_call>\n{"name": "f", "arguments": {"a": 1\n</tool_call>\nAfter.', "", [])),
    # ... nor a string inside it: the first </tool_call> ends the call wherever it stands
    ('<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call> and more', {},
     ("and more", "", [("f", '{"a": "x')]),
     ('<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call> and more', "", [])),
    # a character no JSON could continue with: nothing after it is sent, up to the close
    ('Run: <tool_call>\n{"name": "f", "arguments": {"a": 1, b: 2}}\n</tool_call> done', {},
     ("Run:done", "", [("f", '{"a": 1, ')]),
     ('Run: <tool_call>\n{"name": "f", "arguments": {"a": 1, b: 2}}\n</tool_call> done', "", [])),
    ('<tool_call>{"name": "f", "arguments": {"n": 012}}</tool_call>', {},
     ("", "", [("f", '{"n": 0')]), ('<tool_call>{"name": "f", "arguments": {"n": 012}}</tool_call>', "", [])),
    # cut short inside the arguments (max_tokens)
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', {},
     ("", "", [("f", '{"a": [1, 2')]), ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', "", [])),
    # a broken call, then a good one: the good one is given either way
    ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
     '</tool_call>', {},
     ("", "", [("f", '{"a": '), ("g", {})]),
     ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', "", [("g", {})])),
    # XML: a parameter never closed ends at the next tag; a call without </function> at </tool_call>
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>\nok",
     {"fmt": "xml"}, ("ok", "", [("f", {"a": "1", "b": "2"})]), ("ok", "", [("f", {"a": "1", "b": "2"})])),
    ("<tool_call>\n<function=f>\n<parameter=a>\nx\n</tool_call>\nmore text", {"fmt": "xml"},
     ("more text", "", [("f", {"a": "x"})]), ("more text", "", [("f", {"a": "x"})])),
]

# Calls that parse however they are given, with what a model gets slightly wrong around them
LENIENT = [
    # arguments complete, the output ends before </tool_call> (a stop string, max_tokens)
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', {}, ("", "", [("f", {"a": 1})])),
    # a brace too many before the close
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}}\n</tool_call>\nok', {}, ("ok", "", [("f", {"a": 1})])),
    # raw control characters inside a string: sent escaped
    ('<tool_call>\n{"name": "f", "arguments": {"code": "a\n\tb", "e": "\\u00e9\\n"}}\n</tool_call>', {},
     ("", "", [("f", {"code": "a\n\tb", "e": "\u00e9\n"})])),
    # numbers, literals, nesting, escapes
    ('<tool_call>{"name": "f", "arguments": {"n": -1.5e3, "z": 0, "t": true, "x": null, "l": [[], {}, [false]], '
     '"q": "\\"}\\\\"}}</tool_call>', {},
     ("", "", [("f", {"n": -1500.0, "z": 0, "t": True, "x": None, "l": [[], {}, [False]], "q": '"}\\'})])),
    # an XML call cut short (max_tokens): named, with the parameters it finished
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nunfinished", {"fmt": "xml"},
     ("", "", [("f", {"a": "1"})])),
    # something other than the close after the arguments: the call ends there, the rest is text
    ('<tool_call>\n{"name": "f", "arguments": {}} and then words', {}, ("and then words", "", [("f", {})])),
]


@pytest.mark.parametrize("hold", [False, True], ids=["streamed", "held"])
@pytest.mark.parametrize("output,opts,expected", CASES + LENIENT, ids=range(len(CASES + LENIENT)))
def test_parser_any_split(output, opts, expected, hold):
    rng = random.Random(hash(output) & 0xFFFF)
    for chunks in splits(output, rng):
        text, reasoning, calls, n = parse(chunks, hold_calls=hold, **opts)
        assert (text, reasoning, calls) == expected, chunks
        assert n == len(expected[2])


@pytest.mark.parametrize("hold", [False, True], ids=["streamed", "held"])
@pytest.mark.parametrize("output,opts,streamed,held", BROKEN, ids=range(len(BROKEN)))
def test_calls_that_break_off(output, opts, streamed, held, hold):
    rng = random.Random(hash(output) & 0xFFFF)
    for chunks in splits(output, rng):
        text, reasoning, calls, n = parse(chunks, hold_calls=hold, **opts)
        assert (text, reasoning, calls) == (held if hold else streamed), chunks
        assert n == len(calls)


def test_held_call_is_one_event_run_at_its_close():
    p = OutputParser(new_id=lambda: "c", hold_calls=True)
    assert p.feed('Hi <tool_call>\n{"name": "f", "arguments": {"a": ') == [Text("Hi")]
    assert p.feed('[1, 2]}}\n</tool') == []
    assert p.feed("_call> bye") == [CallStart(0, "c", "f"), CallArgs(0, '{"a": [1, 2]}'), CallEnd(0), Text("bye")]
    assert p.finish() == []


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


# Outputs made of the formats' pieces in any order (tags whole and cut, call openings, JSON and XML bodies, text
# and whitespace), as a model that writes a call wrong might: whatever the pieces, the parser raises nothing, its
# invariants hold (parse() above) and the result is the same fed whole, a character at a time or cut anywhere.
PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "\n\n", "text", "<", ">", "{", "}",
          '"', "\\", ",", ":", "[", "]", "1", "-", ".5e", "true", "nul", '{"name": "f", "arguments": ',
          '{"name": "g", "arguments": {"a": 1}}', '"a": "x}y"', '{"name": ', "<function=f>", "<function=",
          "</function>", "<parameter=a>", "<parameter=b", "</parameter>", "</param", "<tool_", "</think", "é",
          "\u2028"]


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=24), cuts=st.lists(st.integers(1, 400), max_size=8),
       fmt=st.sampled_from(["json", "xml"]), hold=st.booleans(), reasoning_open=st.booleans(),
       tools_on=st.booleans())
def test_parser_any_output_any_split(pieces, cuts, fmt, hold, reasoning_open, tools_on):
    s = "".join(pieces)
    opts = dict(fmt=fmt, hold_calls=hold, reasoning_open=reasoning_open, tools_on=tools_on,
                param_types={"f": {"a": "integer", "b": "string"}})
    whole = parse([s], **opts)
    at = sorted({c for c in cuts if c < len(s)})
    assert parse([s[a:b] for a, b in zip([0] + at, at + [len(s)])], **opts) == whole
    assert parse(list(s), **opts) == whole
