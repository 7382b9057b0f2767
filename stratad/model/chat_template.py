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

Which text the template wrote: every string literal of the template and the raw text between its tags renders as a
``Rendered`` string that carries the spans it covers; concatenation (``+``, ``~``, output, ``{% set %}`` blocks,
macros, ``join``, ``trim``, slicing) keeps the spans, any other operation drops them. The caller's strings (contents,
names, roles, tool calls and results, tools, keyword arguments) never carry spans. The tokenizer takes special tokens
only inside those spans, so a user cannot write ``<|im_end|>\\n<|im_start|>system``; a span lost to an unusual
operation errs the safe way (that literal's special tokens are encoded as text).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes as nodes
import jinja2.sandbox
from jinja2.visitor import NodeTransformer

__all__ = ["ChatTemplateError", "ChatTemplate", "Rendered", "ROLES"]

ROLES = ("system", "user", "assistant", "tool")
# Names transformers reads a message's reasoning from, the first being the one templates use.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

Spans = tuple[tuple[int, int], ...]


class ChatTemplateError(ValueError):
    """The chat template refused the messages (raise_exception), failed while rendering, or the messages are
    malformed."""


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
    return Rendered.make("".join(texts), spans)


# --------------------------------------------------------------------------------------------------------------
# The sandboxed environment


class _Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    # Jinja joins every buffer (the output, {% set %} blocks, macro bodies) with environment.concat.
    concat = staticmethod(join_rendered)


class _MarkLiterals(NodeTransformer):
    """Makes each string literal and each piece of raw template text a Rendered literal at run time, and ``~``
    keep spans (Jinja's own ``~`` builds a plain str)."""

    @staticmethod
    def _call(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
        return nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None, lineno=lineno)

    def visit_Const(self, node: nodes.Const) -> nodes.Expr:
        if isinstance(node.value, str):
            return self._call("stratad_literal", [node], node.lineno)
        return node

    def visit_TemplateData(self, node: nodes.TemplateData) -> nodes.Expr:
        return self._call("stratad_literal", [nodes.Const(node.data, lineno=node.lineno)], node.lineno)

    def visit_Concat(self, node: nodes.Concat) -> nodes.Expr:
        self.generic_visit(node)
        return self._call("stratad_concat", list(node.nodes), node.lineno)


def _concat(*values: Any) -> Rendered:
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
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
        env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.filters["join"] = _join_filter
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.extend(stratad_literal=Rendered.literal, stratad_concat=_concat)
        tree = _MarkLiterals().visit(env.parse(source))
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
        try:
            out = self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # an expression of the template failed on these messages (e.g. None + str)
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        return out if isinstance(out, Rendered) else Rendered.make(out, ())
