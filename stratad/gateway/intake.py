"""Each request body made into what the handler needs (its request, and the daemon's Job or a count), with the work
that grows with the body kept off the event loop.

Parsing a body (json.loads, then pydantic: 500,000 empty messages in 16 MiB take ~4 s), rendering its chat
template and tokenising it (seconds a megabyte) all hold the GIL, so a thread would pause every other stream as
much. As in the coordinator (coordinator/intake.py; HEAVY_BYTES is stratad/prompts.py's), a body over HEAVY_BYTES goes
whole to a worker process (stratad/intake_worker.py: started with the gateway, with its own Model), which does all
of it there, bounded before any rendering by the daemon's own limits (Model._message), and sends back a Prepared
holding nothing bigger than the context: the request's few fields the response needs, and the Job with its prompt
as token ids (Model.as_tokens). A smaller body (milliseconds of work) is prepared in the loop, its prompt sent to the
daemon as the client wrote it. Big bodies wait for the one worker in turn, at most MAX_WAITING of them; more are
refused as overloaded.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request

from stratad.gateway.anthropic_schema import CountRequest, MessagesRequest
from stratad.gateway.backend import Model
from stratad.gateway.errors import ApiError
from stratad.gateway.generation import Job
from stratad.gateway.handling import parse_body
from stratad.gateway.openai_schema import ChatRequest, CompletionRequest, chat_job
from stratad.gateway.responses_schema import ResponsesRequest, responses_job
from stratad.intake_worker import MAX_WAITING, PrepareFailed, WorkerPool
from stratad.prompts import HEAVY_BYTES

log = logging.getLogger("stratad.gateway")

# endpoint -> (its body's schema, the Job of a request; None: a count)
_ENDPOINTS = {
    "chat": (ChatRequest, chat_job),
    "completions": (CompletionRequest, lambda req, _model: req.job()),
    "messages": (MessagesRequest, lambda req, model: req.job(model)),
    "responses": (ResponsesRequest, responses_job),
    "count_tokens": (CountRequest, None),
}
# all a handler reads of a request once it has the Job (a response echoes its settings: bounded by the context)
_RESPONSE_FIELDS = ("model", "stream", "stream_options", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                    "temperature", "top_p", "max_output_tokens")


@dataclass
class Prepared:
    req: BaseModel
    job: Job | None = None
    input_tokens: int = 0  # count_tokens


def prepare(model: Model, endpoint: str, body: bytes, compact: bool) -> Prepared:
    """compact: only what is bounded by the context comes back (the worker's answer); else the whole request."""
    schema, make_job = _ENDPOINTS[endpoint]
    req = parse_body(body, schema)
    if make_job is None:
        chat, _ = req.chat(model)
        return Prepared(_light(req), input_tokens=len(model.prompt_tokens(chat)))
    job = make_job(req, model)
    return Prepared(_light(req), model.as_tokens(job)) if compact else Prepared(req, job)


def _light(req: BaseModel) -> BaseModel:
    fields = type(req).model_fields
    return type(req).model_construct(**{k: getattr(req, k) for k in _RESPONSE_FIELDS if k in fields})


def _prepare_in_worker(model: Model, endpoint: str, body: bytes) -> Prepared:
    try:
        return prepare(model, endpoint, body, compact=True)
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - raised as text (a pydantic error, say, does not pickle), from e
        raise PrepareFailed(None, type(e).__name__) from e


class Intake:
    def __init__(self, model: Model):
        self.model = model
        self.workers = WorkerPool(Model, model.model_path, model.context_length, model.tool_format,
                                  model.model_name)  # the worker's own Model, the same as ours
        self.waiting = 0  # big bodies in or waiting for the worker

    def start(self) -> None:
        """Start the worker now (in the background), so that the first big body does not wait for it."""
        self.workers.start()

    async def prepare(self, request: Request, endpoint: str) -> Prepared:
        body = await request.body()
        if len(body) <= HEAVY_BYTES:
            return prepare(self.model, endpoint, body, compact=False)
        if self.waiting >= MAX_WAITING:
            raise ApiError("overloaded", f"{self.waiting} large requests (over {HEAVY_BYTES} bytes) are being "
                           "prepared; send it again later")
        self.waiting += 1
        fut = self.workers.submit(_prepare_in_worker, endpoint, body)
        try:
            return await asyncio.wrap_future(fut)
        except PrepareFailed as e:
            log.error("preparing a %s request failed in the intake worker", endpoint, exc_info=e)
            raise ApiError("internal", f"the gateway failed preparing this request ({e.cause}; see its log)") \
                from None
        except Exception:
            if self.workers.broken(fut):  # killed, out of memory: a new worker is started
                raise ApiError("internal", "the process preparing this request died; send it again") from None
            raise
        finally:
            self.waiting -= 1

    def close(self) -> None:
        self.workers.close()
