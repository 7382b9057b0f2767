"""What the gateway knows of the daemon and its model: the client, the tokenizer (no weights), the output format."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from stratad.prompts import max_prompt_bytes, prompt_tokens, size_refusal  # the coordinator's: counts and refusals agree
from protos import messages as M
from protos.codec import encode
from stratad.client import AsyncClient, RequestError
from stratad.gateway import parsing
from stratad.gateway.errors import ApiError, pydantic_error
from stratad.model.tokenizer import ChatTemplateError, Tokenizer

_RENDERED = ("prompt", "messages", "tokens", "tools", "enable_thinking", "prefill")  # what becomes the prompt
_RENDERED_SET = frozenset(_RENDERED)


class Model:
    """The tokenizer's side of the backend: rendering, counting and bounding prompts. The event loop uses it for
    small requests; the intake worker (intake.py) has its own for big ones."""

    def __init__(self, model: str, context_length: int, tool_format: str | None = None,
                 served_name: str | None = None):
        self.model_path = str(model)
        self.tokenizer = Tokenizer.from_file(model)  # the vocabulary and template only: for counts and formats
        self.tool_format = tool_format or parsing.tool_format(self.tokenizer.chat_template)
        self.model_name = served_name or Path(model).stem
        self.context_length = context_length
        self.max_prompt_bytes = max_prompt_bytes(self.tokenizer, context_length)  # refused unrendered beyond
        self._open: dict[bool | None, bool] = {}
        # (a digest of the input rendered last, its tokens): room() then as_tokens() render a request once. Only the
        # digest: the input itself (a big body's messages, in the worker) would stay alive until the next request
        self._last: tuple[bytes, list[int]] | None = None

    def reasoning_open(self, enable_thinking: bool | None) -> bool:
        """Whether the template's generation prompt opens <think> itself (the reply then starts inside it)."""
        if enable_thinking not in self._open:
            kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
            try:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], **kw)
            except ChatTemplateError:
                text = ""
            self._open[enable_thinking] = text.rstrip().endswith(parsing.THINK_OPEN)
        return self._open[enable_thinking]

    def _message(self, chat: dict, max_tokens: int) -> M.Generate:
        """chat as the daemon's Generate, refused as the daemon refuses it unrendered: invalid, more bytes or
        messages than the context can hold (stratad.prompts.size_refusal), a frame over the daemon's limit."""
        try:
            g = M.Generate.model_validate({"req_id": "gateway", "sampling": {"max_tokens": max_tokens}}
                                          | {k: chat[k] for k in _RENDERED if chat.get(k) is not None})
        except ValidationError as e:
            raise pydantic_error(e) from None
        if (why := size_refusal(g, self.context_length, self.max_prompt_bytes)) is not None:
            raise ApiError.of(RequestError(*why))
        try:
            size = len(encode(g))
        except PydanticSerializationError:
            raise ApiError("invalid_request", "a string in the request is not valid Unicode (a lone surrogate)",
                           "messages") from None
        if size > M.MAX_FRAME_BYTES:
            raise ApiError("invalid_request", f"the request is {size} bytes as the daemon's message, over its limit "
                           f"of {M.MAX_FRAME_BYTES} bytes", "messages", M.ErrorCode.PROMPT_TOO_LONG.value)
        return g

    def prompt_tokens(self, chat: dict, max_tokens: int = 1) -> list[int]:
        """The prompt as the coordinator renders and encodes it (count_tokens, default max_tokens, as_tokens),
        bounded first as the daemon bounds it. chat: generate()'s prompt / messages / tokens, tools,
        enable_thinking, prefill; max_tokens: the reply's, for the bound (1: the least a reply takes)."""
        g = self._message(chat, max_tokens)
        key = hashlib.sha256(g.model_dump_json(include=_RENDERED_SET).encode()).digest()  # all that is rendered
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        try:
            tokens = prompt_tokens(self.tokenizer, g)
        except ValueError as e:  # the template's refusals, token ids outside the vocabulary
            raise ApiError("invalid_request", str(e), "messages") from None
        self._last = (key, tokens)
        return tokens

    def room(self, chat: dict) -> int:
        """max_tokens when the client gives none: what the context leaves after the prompt."""
        n = len(self.prompt_tokens(chat))
        if n >= self.context_length:
            raise ApiError("invalid_request", f"the prompt's {n} tokens fill the context length "
                           f"{self.context_length}", "messages", "prompt_too_long")
        return self.context_length - n

    def as_tokens(self, job):
        """job with its prompt as token ids (refused here if the daemon would refuse it): what the intake worker
        sends back, so that the event loop and the daemon's frame hold nothing bigger than the context."""
        gen = job.generate
        tokens = self.prompt_tokens(gen, gen["max_tokens"])
        if (why := size_refusal(M.Generate(req_id="gateway", tokens=tuple(tokens), sampling={
                "max_tokens": gen["max_tokens"]}), self.context_length, self.max_prompt_bytes)) is not None:
            raise ApiError.of(RequestError(*why))
        keep = {k: v for k, v in gen.items() if k not in _RENDERED}
        return dataclasses.replace(job, generate=keep | {"tokens": tokens}, template={
            k: gen[k] for k in ("enable_thinking", "prefill") if k in gen})


class Backend(Model):
    def __init__(self, runtime_dir: str, model: str, context_length: int, tool_format: str | None = None,
                 served_name: str | None = None):
        super().__init__(model, context_length, tool_format, served_name)
        self.client = AsyncClient(runtime_dir=runtime_dir)

    def close(self) -> None:
        self.client.close()
