"""One request to the daemon, as parsed events for an HTTP response; cancelled when the HTTP side goes away."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from stratad.gateway.metrics import Metrics
from stratad.gateway.parsing import CallEnd, Event, OutputParser, Reasoning, Text

if TYPE_CHECKING:
    from stratad.gateway.backend import Backend

log = logging.getLogger("stratad.gateway")
IDLE = object()  # nothing new within idle_s (a stream sends a keep-alive)
_END = object()
ABANDON_WAIT_S = 5.0  # after a cancel, how long the daemon's final Done is waited for


@dataclass
class Job:
    generate: dict  # AsyncClient.generate's keyword arguments (messages or prompt, sampling, tools, prefill)
    parse: bool = True  # chat: reasoning and tool calls parsed out; completions: the raw text
    tools_on: bool = False
    param_types: dict = field(default_factory=dict)  # tool -> parameter -> JSON Schema type (XML calls' values)
    parallel_tool_calls: bool = True
    id_prefix: str = "call_"
    hold_calls: bool = True  # a call given once it has ended and parsed, else as text (OutputParser's hold_calls)
    template: dict = field(default_factory=dict)  # enable_thinking, prefill: kept here when the prompt goes as ids

    def chat_arg(self, name: str, default=None):
        """enable_thinking or prefill: as sent, or as rendered into a prompt sent as token ids (Model.as_tokens)."""
        return self.template.get(name, self.generate.get(name, default))


class Generation:
    """`await begin()` (the daemon's refusals raise here, before an HTTP status is chosen), then `events()`."""

    def __init__(self, backend: "Backend", metrics: Metrics, job: Job):
        self.backend, self.metrics, self.job = backend, metrics, job
        self.stream = backend.client.generate(**job.generate)  # RequestError(bad_request) for invalid input
        self.parser = None
        self.pending: list[Event] = []
        if job.parse:
            self.parser = OutputParser(backend.tool_format, job.tools_on,
                                       backend.reasoning_open(job.chat_arg("enable_thinking")), job.param_types,
                                       new_id=lambda: job.id_prefix + uuid.uuid4().hex[:24],
                                       hold_calls=job.hold_calls)
            # the prefill is the reply's start: the client wrote it (not echoed) or the gateway did (a forced
            # call's opening: what it commits to is kept)
            self.pending = [e for e in self.parser.feed(job.chat_arg("prefill", ""))
                            if not isinstance(e, (Text, Reasoning))]
        self.it = self.stream.__aiter__()
        self.task: asyncio.Task | None = None
        self.first = None
        self.done = self.cut = self.recorded = False
        self.t0, self.t_first, self.t_end = time.monotonic(), 0.0, 0.0

    # ---- what the response needs --------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        st, acc = self.stream.stats, self.stream.accepted
        return st.prompt_tokens if st else (acc.prompt_tokens if acc else 0)

    @property
    def completion_tokens(self) -> int:
        return self.stream.stats.generated_tokens if self.stream.stats else len(self.stream.tokens)

    @property
    def cached_tokens(self) -> int:
        return self.stream.stats.prompt_cached_tokens if self.stream.stats else 0

    @property
    def calls(self) -> int:
        return self.parser.calls if self.parser else 0

    @property
    def finish_reason(self) -> str:
        """stop / length / tool_calls (OpenAI's words)."""
        if self.cut or (self.calls and self.stream.finish_reason == "stop"):
            return "tool_calls"
        return "length" if self.stream.finish_reason == "length" else "stop"

    def stop_sequence(self) -> str | None:
        """Which stop string ended the reply, if one did (the daemon holds it back from the text)."""
        stops = self.job.generate.get("stop") or ()
        if self.stream.finish_reason != "stop" or not stops:
            return None
        rest = self.backend.tokenizer.decode(self.stream.tokens, skip_special=True)[len(self.stream.text):]
        return next((s for s in stops if rest.startswith(s)), None)

    # ---- driving the daemon's stream ----------------------------------------------------------------------
    async def _pull(self, idle_s: float | None = None):
        if self.task is None:
            self.task = asyncio.ensure_future(anext(self.it, _END))
        try:
            done, _ = await asyncio.wait({self.task}, timeout=idle_s)  # never cancels the task itself
        except asyncio.CancelledError:  # the client went away: the request must not go on without it
            await self.abandon()
            raise
        if not done:
            return IDLE
        t, self.task = self.task, None
        try:
            item = t.result()
        except Exception:
            self.done = True
            raise
        if item is _END:
            self.done = True
        elif not self.t_first:
            self.t_first = time.monotonic()
        return item

    async def begin(self) -> None:
        self.first = await self._pull()

    async def events(self, idle_s: float | None = None):
        """Parsed events, the parser's last ones at the end; IDLE where nothing was given for idle_s (nothing came,
        or what came is held: a call being written)."""
        last = time.monotonic()
        try:
            for ev in self.pending:
                yield ev
            while True:
                item, self.first = (self.first, None) if self.first is not None else (await self._pull(idle_s), None)
                if item is IDLE:
                    yield IDLE
                    last = time.monotonic()
                    continue
                if item is _END:
                    break
                evs = self.parser.feed(item.text) if self.parser else [Text(item.text)] * bool(item.text)
                for ev in evs:
                    yield ev
                    if isinstance(ev, CallEnd) and not ev.ok:
                        log.warning("request %s: tool call %d's arguments broke off (they do not parse); the call "
                                    "was streamed as far as it went", self.stream.req_id, ev.index)
                    if isinstance(ev, CallEnd) and not self.job.parallel_tool_calls:
                        self.cut = True  # one call asked for: the rest of the reply is not wanted
                        await self.abandon()
                        return
                if evs:
                    last = time.monotonic()
                elif idle_s is not None and time.monotonic() - last >= idle_s:
                    yield IDLE
                    last = time.monotonic()
            for ev in self.parser.finish() if self.parser else []:
                yield ev
        finally:
            if not self.done:
                await self.abandon()
            if self.parser is not None and self.parser.broken and self.job.hold_calls:
                log.warning("request %s: %d tool call(s) did not parse; given back as text", self.stream.req_id,
                            self.parser.broken)
            self._record()

    async def abandon(self) -> None:
        """Cancel the request and wait (briefly, shielded from the caller's own cancellation) for its end."""
        if self.done:
            return
        self.done = True
        log.info("request %s cancelled (%s)", self.stream.req_id, "one tool call asked for" if self.cut
                 else "the client went away")
        with anyio.CancelScope(shield=True):
            try:
                await self.stream.cancel()
                with anyio.move_on_after(ABANDON_WAIT_S):
                    while True:
                        if self.task is None:
                            self.task = asyncio.ensure_future(anext(self.it, _END))
                        item, self.task = await self.task, None
                        if item is _END:
                            break
            except Exception:  # noqa: BLE001 - it ends either way; an error after a cancel tells nothing new
                pass
            finally:
                if self.task is not None:
                    self.task.cancel()
                    self.task = None

    def _record(self) -> None:
        if not self.recorded and self.stream.stats is not None:
            self.recorded = True
            self.t_end = time.monotonic()
            self.metrics.finished(self)
