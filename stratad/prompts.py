"""A request's prompt as the daemon takes it: its token ids (the chat template rendered), and the bounds it is
refused by from its sizes alone, before anything is rendered or tokenised. The coordinator (and its intake worker)
and the HTTP gateway both use these, so their counts and refusals agree.
"""
from __future__ import annotations

from pydantic_core import to_json

from protos import messages as M
from stratad.model.chat_template import ChatTemplateError

HEAVY_BYTES = 32 << 10  # a client frame longer than this is decoded and prepared in the worker
# A token stands for at most the vocabulary's longest token's bytes, so a text longer than context x that cannot
# fit; x4 leaves room for normalisation (NFC) composing characters. A chat template writes at least one token for
# each message (its role's marker): a message counts as one token's share of the limit besides its text, and more
# messages than the context holds are refused by their count alone.
PROMPT_BYTES_SLACK = 4

class PromptError(ValueError):
    """A request's prompt that cannot be served as given (token ids outside the vocabulary): bad_request."""


INPUT_ERRORS = (ChatTemplateError, PromptError)  # the client's input, not a fault of ours: bad_request


def max_prompt_bytes(tokenizer, context_length: int) -> int:
    """The bytes of rendered text beyond which a prompt cannot fit context_length tokens: PROMPT_BYTES_SLACK x the
    vocabulary's longest token's bytes x context_length."""
    longest = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
    return PROMPT_BYTES_SLACK * longest * context_length


def _utf8(s: str | None) -> int:
    return len(s.encode("utf-8", "surrogatepass")) if s else 0


def _json(value) -> int:
    """Bytes of value as compact JSON (pydantic-core: no Python walk over a big structure)."""
    return len(to_json(value, fallback=str))


def input_bytes(g: M.Generate) -> int:
    """The UTF-8 bytes of every field of g that a chat template renders: the prompt; each message's role, content,
    name, tool call id, reasoning and tool calls (id, name, arguments); the tools; the prefill. JSON data (tools,
    arguments) counts as compact JSON: templates render it with tojson, which writes that and spaces. Token ids
    count 0 (they are counted as tokens); no per-message overhead (size_refusal adds it)."""
    if g.prompt is not None:
        return _utf8(g.prompt)
    n = _utf8(g.prefill)
    for t in g.tools or ():
        n += len(t.model_dump_json(exclude_none=True))
    for m in g.messages or ():
        n += _utf8(m.role) + _utf8(m.content) + _utf8(m.name) + _utf8(m.tool_call_id) + _utf8(m.reasoning_content)
        for c in m.tool_calls or ():
            n += _utf8(c.id) + _utf8(c.function.name) + _json(c.function.arguments)
    return n


def size_refusal(g: M.Generate, context_length: int, max_prompt_bytes: int) -> tuple[M.ErrorCode, str] | None:
    """Why g cannot fit the context, from its sizes alone (nothing rendered or tokenised); None if it may.
    max_prompt_bytes: PROMPT_BYTES_SLACK x the longest token's bytes x context_length."""
    n, ctx = g.sampling.max_tokens, context_length
    if n >= ctx:
        return M.ErrorCode.BAD_REQUEST, f"max_tokens {n} exceeds what the context length {ctx} can hold beside a " \
                                        f"prompt (at most {ctx - 1})"
    if g.tokens is not None:
        if len(g.tokens) + n > ctx:
            return M.ErrorCode.PROMPT_TOO_LONG, f"prompt of {len(g.tokens)} tokens + max_tokens {n} exceeds the " \
                                                f"context length {ctx}"
        return None
    n_msgs = len(g.messages or ())
    if n_msgs + n > ctx:
        return M.ErrorCode.PROMPT_TOO_LONG, f"{n_msgs} messages + max_tokens {n} exceed the context length {ctx} " \
                                            f"(a chat template writes at least one token a message)"
    per_token = max_prompt_bytes // ctx
    size = input_bytes(g) + per_token * n_msgs
    if size > max_prompt_bytes:
        return M.ErrorCode.PROMPT_TOO_LONG, f"prompt of {size} bytes exceeds the limit of {max_prompt_bytes} " \
            f"bytes (the context length {ctx} x {per_token} bytes, {PROMPT_BYTES_SLACK}x the longest token's; " \
            f"counted: the text of every field the template renders" + \
            (f", {per_token} bytes a message)" if n_msgs else ")")
    return None


def prompt_tokens(tokenizer, g: M.Generate) -> list[int]:
    """g's prompt as token ids (its template rendered); ChatTemplateError or PromptError (ValueErrors) for input
    that cannot be. A module-level function of the tokenizer alone: the intake worker runs it for a big request,
    the HTTP gateway counts prompts with it."""
    if g.tokens is not None:
        bad = [t for t in g.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} outside the vocabulary (0..{tokenizer.vocab_size - 1})")
        return list(g.tokens)
    if g.messages is not None:  # the messages' text never writes special tokens; the prefill may open a call
        return tokenizer.encode_chat([m.model_dump(exclude_none=True) for m in g.messages], **g.template_kwargs(),
                                     prefill=g.prefill)
    return tokenizer.encode(g.prompt)

