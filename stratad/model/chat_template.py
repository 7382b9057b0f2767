"""Chat templates: a GGUF's Jinja template rendered as Hugging Face transformers renders it, and which characters of
the result the template wrote itself.

What is supported (what the Qwen3, Qwen3-Coder and our generated models' templates use):

* messages with role ``system``, ``user``, ``assistant`` or ``tool`` and a string ``content`` (an assistant message
  with ``tool_calls`` may leave it out or None); assistant ``tool_calls`` in the OpenAI shape
  ``{"type": "function", "function": {"name": ..., "arguments": dict or JSON string}}`` (passed as given: Qwen3's
  template writes a string as is, Qwen3-Coder's needs a dict); ``reasoning_content`` (or ``thinking`` /
  ``reasoning``, copied to both names as transformers does); ``tools`` (JSON schemas); ``enable_thinking`` and any
  other keyword the template reads.
* the rendering of transformers' ``apply_chat_template(..., tokenize=False)``, byte for byte: the same Jinja
  settings (sandboxed, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``), its ``tojson``, ``raise_exception``
  and ``strftime_now``, message keys whose value is None dropped, ``tools`` and ``documents`` always defined. Not
  supported: transformers' ``{% generation %}`` tag (a template using it is refused when loaded).
* errors: anything the template or the messages get wrong (an unknown role, a non-string content, a malformed tool
  call, the template's ``raise_exception``, a failing expression) is a ChatTemplateError saying what.
* limits: the template comes from a downloaded model file, and one render of it runs in the process that serves
  (the coordinator's and the gateway's loops take small requests). A render that would write or build more than
  MAX_CHARS characters or run longer than MAX_SECONDS is a ChatTemplateError: ``'x' * 10**10``, ``center(10**10)``,
  ``'%*s' % (10**10, 'x')`` or ``[l, l, l]`` nested are refused from their operands' sizes before anything is
  allocated; loops, calls, operators and output check the deadline. Not bounded (copies of values already within the
  limit, so each is at most MAX_CHARS): a template that keeps many copies (a namespace list grown with ``+`` in a
  loop) holds what it copies until the deadline; ``list`` / ``split`` of a long string, ``pprint`` of deeply nested
  data, and a single operation on a value within the limit (a sort, a search) run to their end. Jinja's ``lipsum``
  (lorem ipsum of any length) is not offered.

Which text the template wrote: every string literal of the template and the raw text between its tags renders as a
``Rendered`` string that carries the spans it covers; concatenation (``+``, ``~``, output, ``{% set %}`` blocks,
macros, ``join``, ``trim``, slicing) keeps the spans, any other operation drops them. The caller's strings (contents,
names, roles, tool calls and results, tools, keyword arguments) never carry spans. The tokenizer takes special tokens
only inside those spans, so a user cannot write ``<|im_end|>\\n<|im_start|>system``; a span lost to an unusual
operation errs the safe way (that literal's special tokens are encoded as text).
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import inspect
import itertools
import json
import re
import string
import time
import types
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes as nodes
import jinja2.sandbox
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

__all__ = ["ChatTemplateError", "ChatTemplate", "Rendered", "ROLES"]

ROLES = ("system", "user", "assistant", "tool")
# Names transformers reads a message's reasoning from, the first being the one templates use.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

Spans = tuple[tuple[int, int], ...]


class ChatTemplateError(ValueError):
    """The chat template refused the messages (raise_exception), failed while rendering, went past the limits, or the
    messages are malformed."""


# --------------------------------------------------------------------------------------------------------------
# What one render may make, and for how long. Real templates write each message about once: the largest request the
# daemon takes (protos.messages.MAX_FRAME_BYTES, 8 MiB; more than a 1M-token context holds) renders to ~8.4 MB in
# under 0.1 s with Qwen3's and Qwen3-Coder's templates. 4x that size and 100x that time refuse nothing real, and
# bound what a broken or hostile template can take from the process.
MAX_CHARS = 32 << 20
MAX_SECONDS = 10.0
_MAX_INT_BITS = 1 << 16  # a number a template computes (str() stops at 4,300 digits anyway)
_PIECE_CHARS = 128  # a piece of output's memory besides its text (its place in the buffer, its spans)
_SEQUENCES = (str, bytes, list, tuple)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d*)(?:\.(?:\*|\d*))?")


class _Limits:
    """One render's budget: the characters it has left to write and make, and its deadline."""

    def __init__(self):
        self.left = MAX_CHARS
        self.deadline = time.monotonic() + MAX_SECONDS


_limits: contextvars.ContextVar[_Limits | None] = contextvars.ContextVar("stratad_chat_limits", default=None)


def _tick() -> None:
    lim = _limits.get()
    if lim is not None and time.monotonic() > lim.deadline:
        raise ChatTemplateError(f"chat template took longer than {MAX_SECONDS:g} s")


def _fits(size: int) -> None:
    """A value of size characters may be built (asked before it is: a bigger one is never allocated)."""
    if size > MAX_CHARS:
        raise ChatTemplateError(f"chat template builds a value of {size} characters, over the limit of {MAX_CHARS}")
    _tick()


def _int_fits(bits: int) -> None:
    """A number of about `bits` bits may be computed."""
    if bits > _MAX_INT_BITS:
        raise ChatTemplateError(f"chat template computes a number of more than {_MAX_INT_BITS} bits")


def _spend(size: int) -> None:
    """size characters written or made (by an operation that can make more than it takes): counted against the
    render's budget. Outside a render (Jinja folding constants at compile time) only the value's own size is bound."""
    _fits(size)
    lim = _limits.get()
    if lim is not None:
        lim.left -= size
        if lim.left < 0:
            raise ChatTemplateError(f"chat template output exceeds {MAX_CHARS} characters")


def _size(value: Any, seen: dict[int, int] | None = None) -> int:
    """About the characters of value as text (str(), JSON): a string's length; a collection's items' sizes summed, an
    item held twice counted twice (so [s] * n is n times s); a few for anything else."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, Namespace):
        value = value._Namespace__attrs  # its text is its attributes'
    if not isinstance(value, Collection):
        return 4
    seen = {} if seen is None else seen
    if id(value) not in seen:
        items = itertools.chain.from_iterable(value.items()) if isinstance(value, Mapping) else value
        seen[id(value)] = 2 + sum(_size(v, seen) + 2 for v in items)
    return seen[id(value)]


def _count(n: Any) -> int:
    """n as a width or count (anything else 0: the operation raises its own error)."""
    return max(n, 0) if isinstance(n, int) else 0


def _widths(specs: Iterable[str], args: Any) -> int:
    """The widths and precisions of format specs; a * or a nested {} takes the largest integer argument."""
    values = args.values() if isinstance(args, Mapping) else args if isinstance(args, tuple) else (args,)
    biggest = max((abs(v) for v in values if isinstance(v, int)), default=0)
    return sum(int(n) if n.isdigit() else biggest for spec in specs for n in re.findall(r"\d+|\*|\{", spec))


def _percent_size(fmt: str | bytes, args: Any) -> int:
    """At most the characters of fmt % args."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    return len(fmt) + _size(args) + _widths((m[0] for m in _PERCENT_SPEC.finditer(text)), args)


def _brace_size(fmt: str, args: tuple, kwargs: dict) -> int:
    """At most the characters of fmt.format(*args, **kwargs)."""
    specs = [spec or "" for _, _, spec, _ in string.Formatter().parse(fmt)]
    return len(fmt) + _size(args) + _size(kwargs) + _widths(specs, args + tuple(kwargs.values()))


def _replace_size(s, old, new, count=-1) -> int:
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def _method_size(method: Any, args: tuple, kwargs: dict) -> int:
    """What a str or bytes method that can make more than it takes would make; 0 for any other callable."""
    s = getattr(method, "__self__", None)
    if type(method) is not types.BuiltinMethodType or not isinstance(s, (str, bytes)):
        return 0
    text = bytes if isinstance(s, bytes) else str
    name, arg = method.__name__, (args[0] if args else None)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(s), _count(arg))
    if name == "expandtabs":
        tabs = s.count(b"\t" if text is bytes else "\t")
        return len(s) + tabs * _count(kwargs.get("tabsize", 8 if arg is None else arg))
    if name == "replace" and len(args) >= 2 and isinstance(args[0], text) and isinstance(args[1], text):
        return _replace_size(s, *args[:2], *args[2:3], **kwargs)
    if name == "translate" and isinstance(arg, Mapping):
        return len(s) * max((len(v) for v in arg.values() if isinstance(v, str)), default=1)
    if name == "join" and isinstance(arg, list):
        return _size(arg) + len(s) * len(arg)
    if name == "format" and text is str:
        return _brace_size(s, args, kwargs)
    if name == "format_map" and isinstance(arg, Mapping):
        return _brace_size(s, (), arg)
    return 0


def _product_size(a: Any, b: Any) -> int:
    """What a * b would make, as _size counts it."""
    if isinstance(a, int) and isinstance(b, int):
        _int_fits(a.bit_length() + b.bit_length())
        return 0
    if isinstance(a, int):
        a, b = b, a
    return _size(a) * _count(b) if isinstance(a, _SEQUENCES) else 0


# --------------------------------------------------------------------------------------------------------------
# Text that knows which of its characters the template wrote


def _merged(spans: Iterable[tuple[int, int]]) -> Spans:
    out: list[tuple[int, int]] = []
    for s, e in spans:
        if e <= s:
            continue
        if out and s <= out[-1][1]:  # touching spans join: a special token may be written in two pieces
            out[-1] = (out[-1][0], max(e, out[-1][1]))
        else:
            out.append((s, e))
    return tuple(out)


class Rendered(str):
    """A string with the spans (start, end) that came from the template's own literals.

    Plain ``str`` (anything the caller passed, or the result of an operation not listed here) has none. The
    attribute is underscored so the sandbox hides it from templates.
    """

    _literal: Spans = ()

    @classmethod
    def make(cls, text: str, spans: Iterable[tuple[int, int]]) -> "Rendered":
        r = str.__new__(cls, text)
        r._literal = _merged(spans)
        return r

    @classmethod
    def literal(cls, text: str) -> "Rendered":
        return cls.make(text, ((0, len(text)),))

    @property
    def literal_spans(self) -> Spans:
        return self._literal

    def plain(self) -> str:
        return str.__str__(self)

    def __str__(self) -> "Rendered":  # Jinja's output does str(value): keep the spans
        return self

    def __add__(self, other):
        if not isinstance(other, str) or hasattr(other, "__html__"):
            return NotImplemented  # Markup escapes what is added to it; non-strings fail as for str
        return join_rendered((self, other))

    def __radd__(self, other):
        if not isinstance(other, str) or hasattr(other, "__html__"):
            return NotImplemented
        return join_rendered((other, self))

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(len(self))
            return self._cut(start, max(start, stop))
        return str.__getitem__(self, key)

    def _cut(self, start: int, stop: int) -> "Rendered":
        spans = ((max(s, start) - start, min(e, stop) - start) for s, e in self._literal)
        return Rendered.make(str.__getitem__(self, slice(start, stop)), spans)

    def strip(self, chars=None):
        return self.lstrip(chars).rstrip(chars)

    def lstrip(self, chars=None):
        return self._cut(len(self) - len(str.lstrip(self, chars)), len(self))

    def rstrip(self, chars=None):
        return self._cut(0, len(str.rstrip(self, chars)))

    def join(self, iterable):
        items = list(iterable)
        str.join("", items)  # the same TypeError as str.join for a non-string item
        pieces: list[str] = []
        for i, item in enumerate(items):
            if i:
                pieces.append(self)
            pieces.append(item)
        return join_rendered(pieces)


def join_rendered(pieces: Iterable[Any]) -> Rendered:
    """Concatenate strings, keeping the literal spans of the Rendered ones (Jinja's buffers are joined with this)."""
    texts: list[str] = []
    spans: list[tuple[int, int]] = []
    at = 0
    for p in pieces:
        if isinstance(p, Rendered):
            spans.extend((s + at, e + at) for s, e in p._literal)
        texts.append(p)
        at += len(p)
    _fits(at)
    return Rendered.make("".join(texts), spans)


# --------------------------------------------------------------------------------------------------------------
# The sandboxed environment


class _Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    # Jinja joins every buffer (the output, {% set %} blocks, macro bodies) with environment.concat.
    concat = staticmethod(join_rendered)
    # the operators that can make big values (intercepted ones are not folded at compile time either: a GGUF's load
    # would build them)
    intercepted_binops = frozenset(("+", "*", "%", "**"))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "+" and isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
            _fits(_size(left) + _size(right))  # a copy of what exists: bounded, not counted
        elif operator == "*":
            _spend(_product_size(left, right))
        elif operator == "%" and isinstance(left, (str, bytes)):
            _spend(_percent_size(left, right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            _int_fits((abs(left).bit_length() - 1) * right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # Jinja's names: no call's keyword clashes
        _tick()
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox hands str.format out wrapped
        if getattr(method, "__name__", None) == "join" and args and not isinstance(args[0], list):
            args = (list(args[0]),) + args[1:]  # sized, then joined
        named = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}  # Jinja's own, dropped
        _spend(_method_size(method, args, named))
        return super().call(__context, __obj, *args, **kwargs)


def _env_call(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None, lineno=lineno)


class _MarkLiterals(NodeTransformer):
    """Makes each string literal and each piece of raw template text a Rendered literal at run time, and ``~``
    keep spans (Jinja's own ``~`` builds a plain str)."""

    def visit_Const(self, node: nodes.Const) -> nodes.Expr:
        if isinstance(node.value, str):
            return _env_call("stratad_literal", [node], node.lineno)
        return node

    def visit_TemplateData(self, node: nodes.TemplateData) -> nodes.Expr:
        return _env_call("stratad_literal", [nodes.Const(node.data, lineno=node.lineno)], node.lineno)

    def visit_Concat(self, node: nodes.Concat) -> nodes.Expr:
        self.generic_visit(node)
        return _env_call("stratad_concat", list(node.nodes), node.lineno)


class _Bound(NodeTransformer):
    """Checks the deadline on each item of each loop (a loop that writes nothing passes no other check), and the
    size of each list, tuple and dict literal (``[l, l, l]`` nested grows as ``*`` does)."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = _env_call("stratad_loop", [node.iter], node.lineno)
        return node

    def _sized(self, node: nodes.Expr) -> nodes.Expr:
        self.generic_visit(node)
        return _env_call("stratad_sized", [node], node.lineno)

    visit_List = visit_Dict = _sized

    def visit_Tuple(self, node: nodes.Tuple) -> nodes.Expr:
        return self._sized(node) if node.ctx == "load" else node


def _loop(items: Iterable) -> Iterable:
    for item in items:
        _tick()
        yield item


def _sized(value: Any) -> Any:
    _fits(_size(value))
    return value


def _written(value: Any) -> Any:
    """Jinja's finalize: each piece of output (of the render, a {% set %} block, a macro body), counted."""
    _spend((len(value) if isinstance(value, str) else _size(value)) + _PIECE_CHARS)
    return value


def _concat(*values: Any) -> Rendered:
    _fits(sum(_size(v) for v in values))  # before str() writes out a big list
    return join_rendered(str(v) for v in values)  # str() as Jinja's ~ does: 1 ~ 'a' is '1a'


@jinja2.pass_eval_context
def _join_filter(eval_ctx, value, d: Any = "", attribute=None) -> str:
    # Jinja's join with its default separator "" (not a literal of the template) would build a plain str
    sep = d if isinstance(d, Rendered) else Rendered.make(str(d), ())
    return jinja2.filters.sync_do_join(eval_ctx, value, sep, attribute)


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # transformers' tojson (Jinja's own escapes HTML characters)
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    if indent is None:
        return encoder.encode(value)
    _fits(len(indent) if isinstance(indent, str) else _count(indent))
    pieces = []  # the indent is written on each line, deeper ones more times: counted as it comes
    for piece in encoder.iterencode(value):
        _spend(len(piece))
        pieces.append(piece)
    return "".join(pieces)


@jinja2.pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    items = list(iterable)
    if not isinstance(start, (int, float)):  # sum() of lists copies what it has so far for each item
        _spend(len(items) * (_size(start) + _size(items)))
    return jinja2.filters.sync_do_sum(environment, items, attribute, start)


def _checked(f, size):
    """Jinja's filter f, refused before it runs when what it would make, size(its arguments by name), is over the
    limits."""
    signature = inspect.signature(f)

    @functools.wraps(f)  # keeps Jinja's pass_environment / pass_eval_context mark
    def checked(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return f(*args, **kwargs)  # its own error
        bound.apply_defaults()
        _spend(size(**bound.arguments))
        return f(*args, **kwargs)

    return checked


def _indent_size(s, width, **_) -> int:
    s = str(s)
    return len(s) + (s.count("\n") + 1) * (len(width) if isinstance(width, str) else _count(width))


_F = jinja2.filters
# The filters that can make more than they take, with what they would make.
_GROWING_FILTERS = {
    "center": (_F.do_center, lambda value, width: max(_size(value), _count(width))),
    "indent": (_F.do_indent, _indent_size),
    "wordwrap": (_F.do_wordwrap, lambda environment, s, wrapstring, **_: _size(s) * (
        1 + _size(wrapstring or environment.newline_sequence))),
    "replace": (_F.do_replace, lambda s, old, new, count, **_: _replace_size(str(s), str(old), str(new), count)),
    "format": (_F.do_format, lambda value, args, kwargs: _percent_size(str(value), kwargs or args)),
    "batch": (_F.do_batch, lambda value, linecount, fill_with: _size(value) + _count(linecount) * (
        _size(fill_with) + 2)),
    "slice": (_F.sync_do_slice, lambda value, slices, fill_with: _size(value) + _count(slices) * (
        _size(fill_with) + 4)),
}


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


# --------------------------------------------------------------------------------------------------------------
# The caller's data


def _plain_data(value: Any, where: str) -> Any:
    """JSON-like data with exact str/int/float/bool types (a str subclass could carry spans, or methods the sandbox
    does not know), or a ChatTemplateError naming where the value is."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ChatTemplateError(f"{where} has a key {k!r} that is not a string")
            out[str.__str__(k)] = _plain_data(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        items = [_plain_data(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise ChatTemplateError(f"{where} is a {type(value).__name__}, not JSON data")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, (list, tuple)):
        raise ChatTemplateError(f"{where} must be a list of tool calls, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise ChatTemplateError(f"{at} must be an object, got {type(call).__name__}")
        if call.get("type", "function") != "function":
            raise ChatTemplateError(f"{at}.type is {call.get('type')!r}; only 'function' calls are supported")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise ChatTemplateError(f"{at}.function must be an object with a name and arguments")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatTemplateError(f"{at}.function.name must be a non-empty string")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError as e:
                raise ChatTemplateError(f"{at}.function.arguments is a string but not JSON: {e}") from None
        elif not isinstance(args, Mapping):
            raise ChatTemplateError(f"{at}.function.arguments must be an object or a JSON string")


def prepare_messages(messages: Any) -> list[dict]:
    """Check the messages and put them in the form transformers hands its templates."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("there are no messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"{where} must be an object with a role and a content, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}  # as transformers: a None means "not given"
        role = m.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"{where} has role {role!r}; the chat template takes {', '.join(ROLES)}")
        if "tool_calls" in m:
            if role != "assistant":
                raise ChatTemplateError(f"{where} is a {role} message with tool_calls; only assistant messages call")
            _check_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if "content" not in m:
            if role != "assistant":
                raise ChatTemplateError(f"{where}: a {role} message needs a string content")
            m["content"] = ""  # an assistant turn that only calls tools (OpenAI sends content null)
        elif not isinstance(m["content"], str):
            raise ChatTemplateError(
                f"{where}.content must be a string, got {type(m['content']).__name__} (content parts are not supported)"
            )
        reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ChatTemplateError(f"{where}: the reasoning must be a string, got {type(reasoning).__name__}")
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(_plain_data(m, where))
    return out


def _prepare_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, (list, tuple)):
        raise ChatTemplateError(f"tools must be a list of tool schemas, got {type(tools).__name__}")
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise ChatTemplateError(f"tools[{i}] must be an object (a JSON schema), got {type(t).__name__}")
    return _plain_data(list(tools), "tools")


# --------------------------------------------------------------------------------------------------------------


class ChatTemplate:
    """One compiled chat template. ``special`` (bos_token, eos_token, ...) are given to the template as its own
    text (they are the model's markers, not the caller's)."""

    def __init__(self, source: str, special: Mapping[str, str] | None = None):
        """Raises jinja2.TemplateError when the source does not compile."""
        self.source = source
        env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                           finalize=_written)
        env.filters.update({name: _checked(*f) for name, f in _GROWING_FILTERS.items()})
        env.filters["tojson"] = _tojson
        env.filters["join"] = _join_filter
        env.filters["sum"] = _sum
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        del env.globals["lipsum"]  # no chat template writes lorem ipsum
        # one Rendered for each literal of the template, however many times it is written
        env.extend(stratad_literal=functools.cache(Rendered.literal), stratad_concat=_concat, stratad_loop=_loop,
                   stratad_sized=_sized)
        tree = _Bound().visit(_MarkLiterals().visit(env.parse(source)))
        self._template = env.template_class.from_code(env, env.compile(tree), env.make_globals(None), None)
        self._special = {k: Rendered.literal(v) for k, v in (special or {}).items()}

    def render(
        self,
        messages: Any,
        tools: Any = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **kwargs: Any,
    ) -> Rendered:
        """The rendered chat with the template's literal spans. enable_thinking None: not passed (the template's
        default). Raises ChatTemplateError."""
        context: dict[str, Any] = dict(self._special)
        context.update(_plain_data(kwargs, "template arguments"))
        if enable_thinking is not None:
            context["enable_thinking"] = bool(enable_thinking)
        context.update(
            messages=prepare_messages(messages),
            tools=_prepare_tools(tools),
            documents=None,
            add_generation_prompt=bool(add_generation_prompt),
        )
        limits = _limits.set(_Limits())
        try:
            out = self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # an expression of the template failed on these messages (e.g. None + str)
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        finally:
            _limits.reset(limits)
        return out if isinstance(out, Rendered) else Rendered.make(out, ())
