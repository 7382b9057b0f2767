"""Model output -> text, reasoning and tool calls, incrementally, in the format the GGUF's chat template implies.

Tool-call formats of the Qwen3 family (both inside <tool_call>...</tool_call>):
* "json" (Qwen3):       {"name": NAME, "arguments": {...}}
* "xml"  (Qwen3-Coder): <function=NAME> <parameter=KEY>VALUE</parameter>... </function>
and <think>...</think> at the start of a reply (or a reply that starts inside it) as reasoning.

A call is committed, its start event sent, once its opening names the function; its arguments then stream as JSON
fragments whose concatenation is the arguments object. A <tool_call> block whose opening does not parse is held
until it closes and parsed whole, else given back as text: output that only looks like a call is never lost.
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


class OutputParser:
    """feed(text) -> events; finish() -> the last events. `calls`: tool calls seen (committed) so far."""

    def __init__(self, fmt: ToolFormat = "json", tools_on: bool = True, reasoning_open: bool = False,
                 param_types: dict[str, dict[str, object]] | None = None,
                 new_id: Callable[[], str] = lambda: "call"):
        self.fmt, self.tools_on, self.types, self.new_id = fmt, tools_on, param_types or {}, new_id
        self.state = "think" if reasoning_open else "start"
        self.buf = ""
        self.calls = 0
        self.ws = ""  # the text's trailing whitespace, held: dropped before a call, else sent with what follows
        self.rws = ""  # the same for reasoning (dropped at </think>)
        self.lead = reasoning_open  # drop leading whitespace (of reasoning, of text after </think> or a call)
        self.pre_ws = ""  # whitespace held before an uncommitted <tool_call>, given back if it turns out text
        self.committed = False
        self.call_id = self.call_name = ""
        self.depth, self.in_str, self.esc, self.args_done = 0, False, False, False  # JSON arguments scanner
        self.n_params = 0  # XML

    # ---- public ---------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out):
            pass
        if self.state == "start":
            self._text(self.buf, out, final=True)
        elif self.state == "think":
            self._reasoning(self.buf, out, final=True)
        elif self.state == "text":
            self._text(self.buf, out, final=True)
        elif not self.committed:  # a <tool_call> never closed: what it held is text
            self.ws = self.pre_ws
            self._text(CALL_OPEN + self.buf, out, final=True)
        else:  # cut short inside a call (max_tokens): end it with what it has
            if self.fmt == "xml":
                self._close_xml_args(out)
            self._end_call(out)
            self._text("", out, final=True)
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

    def _start_call(self, name: str, out: list[Event]) -> None:
        self.committed, self.call_id, self.call_name = True, self.new_id(), name
        self.depth, self.in_str, self.esc, self.args_done, self.n_params = 0, False, False, False, 0
        out.append(CallStart(self.calls, self.call_id, name))

    def _end_call(self, out: list[Event]) -> None:
        out.append(CallEnd(self.calls))
        self.calls += 1
        self.committed = False
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
        if THINK_OPEN.startswith(s):  # still undecided (nothing but whitespace and part of <think>)
            return False
        self.state = "text"
        return True

    def _state_think(self, out: list[Event]) -> bool:
        i = self.buf.find(THINK_CLOSE)
        if i >= 0:
            self._reasoning(self.buf[:i], out, final=True)
            self.buf, self.state, self.lead = self.buf[i + len(THINK_CLOSE):], "text", True
            return True
        n = len(self.buf) - _partial(self.buf, THINK_CLOSE)
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
                return True
            keep = _partial(self.buf, CALL_OPEN)
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
            self.buf = self.buf[m.end():]
            self._start_call(name, out)
            return True
        i = self.buf.find(CALL_CLOSE)
        if i < 0:
            return False
        body, self.buf = self.buf[:i], self.buf[i + len(CALL_CLOSE):]
        whole = self._whole_json_call(body) if self.fmt == "json" else None
        if whole is None:
            self.ws = self.pre_ws
            self._text(CALL_OPEN + body + CALL_CLOSE, out)
            self.state = "text"
        else:
            self._start_call(whole[0], out)
            out.append(CallArgs(self.calls, whole[1]))
            self._end_call(out)
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
        if not self.args_done:
            n = 0
            for n, c in enumerate(self.buf, 1):
                if self.in_str:
                    if self.esc:
                        self.esc = False
                    elif c == "\\":
                        self.esc = True
                    elif c == '"':
                        self.in_str = False
                elif c == '"':
                    self.in_str = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    self.depth -= 1
                    if self.depth == 0:
                        self.args_done = True
                        break
            if n:
                out.append(CallArgs(self.calls, self.buf[:n]))
                self.buf = self.buf[n:]
            if not self.args_done:
                return False
        i = self.buf.find(CALL_CLOSE)  # what stands between the arguments and the close ("}\n") is the format's
        if i < 0:
            return False
        self.buf = self.buf[i + len(CALL_CLOSE):]
        self._end_call(out)
        return True

    def _close_xml_args(self, out: list[Event]) -> None:
        if not self.args_done:
            out.append(CallArgs(self.calls, "}" if self.n_params else "{}"))
            self.args_done = True

    def _xml_args(self, out: list[Event]) -> bool:
        b = self.buf.lstrip()
        self.buf = b
        if b.startswith("<parameter="):
            m = _XML_PARAM.match(b)
            j = b.find(PARAM_CLOSE, m.end()) if m else -1
            if j < 0:
                return False  # the parameter is still being written
            raw = b[m.end():j]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            key = m.group(1).strip()
            value = _xml_value(raw, self.types.get(self.call_name, {}).get(key))
            sep = ", " if self.n_params else "{"
            out.append(CallArgs(self.calls, f"{sep}{json.dumps(key, ensure_ascii=False)}: "
                                            f"{json.dumps(value, ensure_ascii=False)}"))
            self.n_params += 1
            self.buf = b[j + len(PARAM_CLOSE):]
            return True
        if b.startswith(FUNCTION_CLOSE):
            self._close_xml_args(out)
            self.buf = b[len(FUNCTION_CLOSE):]
            return True
        if b.startswith(CALL_CLOSE):
            self._close_xml_args(out)
            self.buf = b[len(CALL_CLOSE):]
            self._end_call(out)
            return True
        if not b or any(tag.startswith(b) for tag in ("<parameter=", FUNCTION_CLOSE, CALL_CLOSE)):
            return False  # a tag still being written
        k = b.find("<", 1)  # anything else inside a call is dropped up to the next tag
        self.buf = b[k:] if k > 0 else ""
        return bool(self.buf)
