"""Model output -> text, reasoning and tool calls, incrementally, in the format the GGUF's chat template implies.

Tool-call formats of the Qwen3 family (both inside <tool_call>...</tool_call>):
* "json" (Qwen3):       {"name": NAME, "arguments": {...}}
* "xml"  (Qwen3-Coder): <function=NAME> <parameter=KEY>VALUE</parameter>... </function>
and <think>...</think> at the start of a reply (or a reply that starts inside it) as reasoning.

A call ends at the first </tool_call> after its opening, wherever that stands (inside unfinished arguments too: they
never swallow the close and what follows it), or at the end of the output. A call parses when its opening names
the function and its arguments are a complete JSON object (XML: the parameters it finished, always an object; a
call cut short by max_tokens is named with those, as the APIs give a call cut short, finish_reason saying so). A
<tool_call> that does not parse is text, as written: output that only looks like a call is never lost.

Two ways to give calls (`hold_calls`):
* held (whole answers; Anthropic's stream): a call is given once it has ended, only if it parsed, else as text.
* streamed (OpenAI's stream): the call's start once its opening names the function, then its arguments as JSON
  fragments as they are written, each checked (JsonPrefix), so what was sent is always the start of valid JSON. A
  call that breaks off (closed mid-object, a character no JSON could continue with, the output ending) cannot be
  taken back: it ends there, CallEnd(ok=False), its arguments the unfinished JSON sent so far (a client's
  json.loads refuses it rather than running a call cut short); nothing after the break up to </tool_call> is sent.
`feed` may be given the output split anywhere.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PARAM_CLOSE, FUNCTION_CLOSE = "</parameter>", "</function>"
_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
_XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>")
_XML_PARAM_OPENING = re.compile(r"<parameter=[^>\n]*")

ToolFormat = Literal["json", "xml"]


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    fragment: str  # the fragments of one call, joined, are its arguments as a JSON object


@dataclass(frozen=True)
class CallEnd:
    index: int
    ok: bool = True  # False: a streamed call whose arguments broke off (they do not parse)


Event = Text | Reasoning | CallStart | CallArgs | CallEnd


def tool_format(chat_template: str) -> ToolFormat:
    """Qwen3-Coder's templates write calls as <function=...> XML; Qwen3's (and our default) as JSON."""
    return "xml" if "<function=" in chat_template else "json"


def _partial(buf: str, marker: str) -> int:
    """Length of the longest end of buf that could be the start of marker (held back until it is decided)."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


def _xml_value(raw: str, typ) -> object:
    """A parameter's text as its schema's type says: strings stay text, other types are read as JSON if they can."""
    types = typ if isinstance(typ, list) else [typ]
    if typ is None or "string" in types:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class JsonPrefix:
    """JSON text checked a character at a time, as it arrives: `feed(c)` gives what to send for c (c itself; a raw
    control character inside a string escaped, as json.loads(strict=False) would read it) while the text so far is
    still the start of a valid JSON object, None at the first character that cannot continue one. `done` once
    the object has closed."""

    def __init__(self):
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.state = "start"  # start | value | value_or_close | key | key_or_close | colon | after | str | tok
        self.key = False  # the string being read is an object's key
        self.esc, self.hex = False, 0  # in a string: after a backslash; \\u digits still to come
        self.tok = ""  # a number or true / false / null being read
        self.done = False

    def feed(self, c: str) -> str | None:
        if self.done:
            return None
        st = self.state
        if st == "str":
            return self._str(c)
        if st == "tok":
            if c in _TOKEN_CHARS:
                t = self.tok + c
                if not (_NUM_PREFIX.fullmatch(t) or any(w.startswith(t) for w in _WORDS)):
                    return None
                self.tok = t
                return c
            if not (_NUMBER.fullmatch(self.tok) or self.tok in _WORDS):
                return None
            self.tok, self.state = "", "after"
            return self.feed(c)
        if c in " \t\n\r":
            return c
        if st == "start":
            return self._open(c) if c == "{" else None
        if st in ("value", "value_or_close"):
            if st == "value_or_close" and c == "]":
                return self._close(c)
            if c in "{[":
                return self._open(c)
            if c == '"':
                self.state, self.key = "str", False
                return c
            if c in "-0123456789tfn":
                self.state = "tok"
                return self.feed(c)
            return None
        if st in ("key", "key_or_close"):
            if st == "key_or_close" and c == "}":
                return self._close(c)
            if c == '"':
                self.state, self.key = "str", True
                return c
            return None
        if st == "colon":
            if c == ":":
                self.state = "value"
                return c
            return None
        # after a value: a comma or the close of the container it is in
        top = self.stack[-1]
        if c == ",":
            self.state = "key" if top == "{" else "value"
            return c
        if c == ("}" if top == "{" else "]"):
            return self._close(c)
        return None

    def _open(self, c: str) -> str:
        self.stack.append(c)
        self.state = "key_or_close" if c == "{" else "value_or_close"
        return c

    def _close(self, c: str) -> str:
        self.stack.pop()
        self.state = "after"
        self.done = not self.stack
        return c

    def _str(self, c: str) -> str | None:
        if self.hex:
            if c not in "0123456789abcdefABCDEF":
                return None
            self.hex -= 1
            return c
        if self.esc:
            self.esc = False
            if c == "u":
                self.hex = 4
            elif c not in '"\\/bfnrt':
                return None
            return c
        if c == "\\":
            self.esc = True
        elif c == '"':
            self.state = "colon" if self.key else "after"
        elif c < " ":
            return json.dumps(c)[1:-1]
        return c


_TOKEN_CHARS = frozenset("0123456789+-.eEtruefalsn")
_WORDS = ("true", "false", "null")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUM_PREFIX = re.compile(r"-?|-?(?:0|[1-9]\d*)(?:\.\d*)?|-?(?:0|[1-9]\d*)(?:\.\d+)?[eE][+-]?\d*")
_CALL_TAIL = re.compile(r"[\s}]*")  # between a JSON call's arguments and </tool_call>: the call object's close


class OutputParser:
    """feed(text) -> events; finish() -> the last events. `calls`: tool calls given (CallEnd sent) so far;
    `broken`: calls whose arguments did not parse (text when held, cut off in a stream).

    hold_calls: each call is held until it ends and given only if it parsed (its arguments a complete JSON
    object), else as the text it was: for whole answers, and streams that send a call at once. Without it a call
    streams as it is written (its start once its opening names the function, then argument fragments) and a call
    that breaks off is ended where it broke (CallEnd(ok=False)), its fragments so far a valid start of JSON."""

    def __init__(self, fmt: ToolFormat = "json", tools_on: bool = True, reasoning_open: bool = False,
                 param_types: dict[str, dict[str, object]] | None = None,
                 new_id: Callable[[], str] = lambda: "call", hold_calls: bool = False):
        self.fmt, self.tools_on, self.types, self.new_id = fmt, tools_on, param_types or {}, new_id
        self.hold = hold_calls
        self.state = "think" if reasoning_open else "start"
        self.buf = ""
        self.calls = self.broken = 0
        self.final = False  # finish(): nothing more comes, so nothing is held back as a tag's start
        self.ws = ""  # the text's trailing whitespace, held: dropped before a call, else sent with what follows
        self.rws = ""  # the same for reasoning (dropped at </think>)
        self.lead = reasoning_open  # drop leading whitespace (of reasoning, of text after </think> or a call)
        self.pre_ws = ""  # whitespace held before a <tool_call>, given back if the call turns out text
        self.raw = ""  # the current call as written, from its <tool_call> (given back as text if it does not parse)
        self.held: list[Event] = []  # hold_calls: the current call's events
        self.committed = False
        self.call_id = self.call_name = ""
        self.json: JsonPrefix | None = None
        self.args = "scan"  # json: scan (reading the arguments), tail (they closed), broken (they cannot parse)
        self.n_params, self.fn_closed, self.args_closed = 0, False, False  # XML

    # ---- public ---------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self.final = True
        while self._step(out):
            pass
        if self.state == "call":  # the output ended inside a call (max_tokens, a stop string)
            self._take(len(self.buf))
            if not self.committed:  # its opening never parsed: text
                self._give_back(out)
            else:
                if self.fmt == "xml":  # named, with the parameters it finished (an unfinished one is dropped)
                    self._close_xml_args(out)
                self._end_call(out, self.fmt == "xml" or self.args == "tail")
            while self._step(out):
                pass
        if self.state == "think":
            self._reasoning(self.buf, out, final=True)
        else:
            self._text(self.buf, out, final=True)
        self.buf = ""
        return out

    # ---- emitting -------------------------------------------------------------------------------------------
    def _text(self, s: str, out: list[Event], final: bool = False) -> None:
        s = self.ws + s
        keep = "" if final else s[len(s.rstrip()):]
        if final and self.calls:
            s = s.rstrip()  # whitespace around calls is the format's, not content
        self.ws = keep
        if s := s[:len(s) - len(keep)]:
            out.append(Text(s))

    def _reasoning(self, s: str, out: list[Event], final: bool = False) -> None:
        s = self.rws + s
        keep = s[len(s.rstrip()):]
        self.rws = "" if final else keep
        if s := s[:len(s) - len(keep)]:
            out.append(Reasoning(s))

    def _emit(self, ev: Event, out: list[Event]) -> None:
        (self.held if self.hold else out).append(ev)

    def _take(self, n: int) -> str:
        """The next n characters of a call, consumed (and kept in raw)."""
        s, self.buf = self.buf[:n], self.buf[n:]
        self.raw += s
        return s

    def _give_back(self, out: list[Event]) -> None:
        """The current call, as written, is text."""
        self.ws = self.pre_ws
        self._text(self.raw, out)
        self.raw, self.held, self.committed, self.state = "", [], False, "text"

    def _start_call(self, name: str, out: list[Event]) -> None:
        self.committed, self.call_id, self.call_name = True, self.new_id(), name
        self.json, self.args = JsonPrefix(), "scan"
        self.n_params, self.fn_closed, self.args_closed = 0, False, False
        self._emit(CallStart(self.calls, self.call_id, name), out)

    def _end_call(self, out: list[Event], ok: bool) -> None:
        self.broken += not ok
        if self.hold and not ok:
            self._give_back(out)
            return
        if self.hold:
            args = "".join(e.fragment for e in self.held if isinstance(e, CallArgs))
            out += [e for e in self.held if not isinstance(e, CallArgs)] + [CallArgs(self.calls, args)]
        out.append(CallEnd(self.calls, ok))
        self.calls += 1
        self.raw, self.held, self.committed = "", [], False
        self.state, self.lead = "text", True

    # ---- the state machine: one step; True when it made progress ---------------------------------------------
    def _step(self, out: list[Event]) -> bool:
        if self.lead and self.state in ("think", "text"):
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.lead = False
        return getattr(self, "_state_" + self.state)(out)

    def _state_start(self, out: list[Event]) -> bool:
        s = self.buf.lstrip()
        if s.startswith(THINK_OPEN):
            self.buf, self.state, self.lead = s[len(THINK_OPEN):], "think", True
            return True
        if THINK_OPEN.startswith(s) and not self.final:  # still undecided (whitespace and part of <think>)
            return False
        self.state = "text"
        return True

    def _state_think(self, out: list[Event]) -> bool:
        i = self.buf.find(THINK_CLOSE)
        if i >= 0:
            self._reasoning(self.buf[:i], out, final=True)
            self.buf, self.state, self.lead = self.buf[i + len(THINK_CLOSE):], "text", True
            return True
        n = len(self.buf) - (0 if self.final else _partial(self.buf, THINK_CLOSE))
        self._reasoning(self.buf[:n], out)
        self.buf = self.buf[n:]
        return False

    def _state_text(self, out: list[Event]) -> bool:
        keep = 0
        if self.tools_on:
            i = self.buf.find(CALL_OPEN)
            if i >= 0:
                self._text(self.buf[:i], out)
                self.pre_ws, self.ws = self.ws, ""
                self.buf, self.state = self.buf[i + len(CALL_OPEN):], "call"
                self.raw, self.held = CALL_OPEN, []
                return True
            keep = 0 if self.final else _partial(self.buf, CALL_OPEN)
        n = len(self.buf) - keep
        self._text(self.buf[:n], out)
        self.buf = self.buf[n:]
        return False

    def _state_call(self, out: list[Event]) -> bool:
        if self.committed:
            return self._json_args(out) if self.fmt == "json" else self._xml_args(out)
        m = (_JSON_HEAD if self.fmt == "json" else _XML_HEAD).match(self.buf)
        if m:
            name = json.loads(f'"{m.group(1)}"') if self.fmt == "json" else m.group(1).strip()
            self._take(m.end())
            self._start_call(name, out)
            return True
        i = self.buf.find(CALL_CLOSE)
        if i < 0:
            return False
        body = self._take(i + len(CALL_CLOSE))[:i]
        whole = self._whole_json_call(body) if self.fmt == "json" else None
        if whole is None:
            self._give_back(out)
        else:
            self._start_call(whole[0], out)
            self._emit(CallArgs(self.calls, whole[1]), out)
            self._end_call(out, True)
        return True

    @staticmethod
    def _whole_json_call(body: str) -> tuple[str, str] | None:
        """A JSON call whose opening was not the usual one (arguments first, arguments as a string)."""
        try:
            obj = json.loads(body)
            args = obj["arguments"]
            if isinstance(args, str):
                args = json.loads(args)
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(obj.get("name"), str) or not obj["name"] or not isinstance(args, dict):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False)

    def _json_args(self, out: list[Event]) -> bool:
        """A JSON call's arguments, checked as they come; the call ends at the first </tool_call> wherever it
        stands (inside an unfinished object or string too), or just after the arguments and the call object's
        closing brace when something else follows them."""
        close = self.buf.find(CALL_CLOSE)
        if self.args == "scan":
            limit = close if close >= 0 else len(self.buf) - (0 if self.final else _partial(self.buf, CALL_CLOSE))
            frag, n = [], 0
            while n < limit and self.args == "scan":
                o = self.json.feed(self.buf[n])
                if o is None:
                    self.args = "broken"
                    break
                frag.append(o)
                n += 1
                if self.json.done:
                    self.args = "tail"
            if frag:
                self._emit(CallArgs(self.calls, "".join(frag)), out)
            self._take(n)
            if self.args != "scan":
                return True
            if close < 0:
                return False
            self._take(len(CALL_CLOSE))  # closed with the arguments unfinished
            self._end_call(out, False)
            return True
        if self.args == "broken":  # the rest of the call, up to its close, is not sent
            if close < 0:
                self._take(len(self.buf) - (0 if self.final else _partial(self.buf, CALL_CLOSE)))
                return False
            self._take(close + len(CALL_CLOSE))
            self._end_call(out, False)
            return True
        self._take(_CALL_TAIL.match(self.buf).end())
        if self.buf.startswith(CALL_CLOSE):
            self._take(len(CALL_CLOSE))
        elif not self.buf or (CALL_CLOSE.startswith(self.buf) and not self.final):
            return False
        self._end_call(out, True)  # closed, or something else follows: the call ends here, the rest is text
        return True

    def _close_xml_args(self, out: list[Event]) -> None:
        if not self.args_closed:
            self._emit(CallArgs(self.calls, "}" if self.n_params else "{}"), out)
            self.args_closed = True

    def _xml_args(self, out: list[Event]) -> bool:
        """Qwen3-Coder's parameters, each sent whole once it ends: at its </parameter>, or (a close left out) at the
        next <parameter=, </function> or </tool_call>. After </function> only </tool_call> belongs to the call."""
        b = self.buf.lstrip()
        self._take(len(self.buf) - len(b))
        if self.fn_closed:
            if b.startswith(CALL_CLOSE):
                self._take(len(CALL_CLOSE))
            elif not b or (CALL_CLOSE.startswith(b) and not self.final):
                return False
            self._end_call(out, True)
            return True
        if b.startswith("<parameter="):
            m = _XML_PARAM.match(b)
            if m is None:
                if _XML_PARAM_OPENING.fullmatch(b) and not self.final:
                    return False  # the tag is still being written
                k = b.find("<", 1)  # not a tag: dropped up to the next one
                self._take(k if k > 0 else len(b))
                return k > 0
            ends = [(j, t) for t in (PARAM_CLOSE, "<parameter=", FUNCTION_CLOSE, CALL_CLOSE)
                    if (j := b.find(t, m.end())) >= 0]
            if not ends:
                return False  # the value is still being written
            j, tag = min(ends)
            raw = b[m.end():j]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            key = m.group(1).strip()
            value = _xml_value(raw, self.types.get(self.call_name, {}).get(key))
            sep = ", " if self.n_params else "{"
            self._emit(CallArgs(self.calls, f"{sep}{json.dumps(key, ensure_ascii=False)}: "
                                            f"{json.dumps(value, ensure_ascii=False)}"), out)
            self.n_params += 1
            self._take(j + (len(PARAM_CLOSE) if tag == PARAM_CLOSE else 0))
            return True
        if b.startswith(FUNCTION_CLOSE):
            self._close_xml_args(out)
            self._take(len(FUNCTION_CLOSE))
            self.fn_closed = True
            return True
        if b.startswith(CALL_CLOSE):  # </function> left out
            self._close_xml_args(out)
            self._take(len(CALL_CLOSE))
            self.fn_closed = True
            self._end_call(out, True)
            return True
        if not b or (any(tag.startswith(b) for tag in ("<parameter=", FUNCTION_CLOSE, CALL_CLOSE))
                     and not self.final):
            return False  # a tag still being written
        k = b.find("<", 1)  # anything else inside a call is dropped up to the next tag
        self._take(k if k > 0 else len(b))
        return k > 0
