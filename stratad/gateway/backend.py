"""What the gateway knows of the daemon and its model: the client, the tokenizer (no weights), the output format."""
from __future__ import annotations

from pathlib import Path

from coordinator.daemon import prompt_tokens  # the coordinator's own rendering: counts agree
from protos import messages as M
from stratad.client import AsyncClient
from stratad.gateway import parsing
from stratad.gateway.errors import ApiError
from stratad.model.tokenizer import ChatTemplateError, Tokenizer


class Backend:
    def __init__(self, runtime_dir: str, model: str, context_length: int, tool_format: str | None = None,
                 served_name: str | None = None):
        self.client = AsyncClient(runtime_dir=runtime_dir)
        self.tokenizer = Tokenizer.from_file(model)  # the vocabulary and template only: for counts and formats
        self.tool_format = tool_format or parsing.tool_format(self.tokenizer.chat_template)
        self.model_name = served_name or Path(model).stem
        self.context_length = context_length
        self._open: dict[bool | None, bool] = {}

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

    def prompt_tokens(self, chat: dict) -> int:
        """The prompt's length as the coordinator renders and encodes it (count_tokens, default max_tokens).
        chat: generate()'s messages, tools, enable_thinking, prefill."""
        try:
            g = M.Generate(req_id="count", messages=tuple(M.ChatMessage(**m) for m in chat["messages"]),
                           tools=None if chat.get("tools") is None else tuple(chat["tools"]),
                           enable_thinking=chat.get("enable_thinking"), prefill=chat.get("prefill", ""))
            return len(prompt_tokens(self.tokenizer, g))
        except ValueError as e:  # pydantic's and the template's refusals
            raise ApiError("invalid_request", str(e), "messages") from None

    def room(self, chat: dict) -> int:
        """max_tokens when the client gives none: what the context leaves after the prompt."""
        n = self.prompt_tokens(chat)
        if n >= self.context_length:
            raise ApiError("invalid_request", f"the prompt's {n} tokens fill the context length "
                           f"{self.context_length}", "messages", "prompt_too_long")
        return self.context_length - n

    def close(self) -> None:
        self.client.close()
