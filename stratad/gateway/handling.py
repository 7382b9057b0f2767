"""What every API handler does: read a JSON body into its model, and wait on the daemon only while the client
is still there."""
from __future__ import annotations

import json
import logging
from typing import Awaitable, Callable, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from stratad.gateway.errors import ApiError, pydantic_error

log = logging.getLogger("stratad.gateway")
CLIENT_CLOSED = 499  # nginx's code for a client that left first: nobody reads it, the access log does
T = TypeVar("T", bound=BaseModel)
R = TypeVar("R")


def parse_body(body: bytes, model: type[T]) -> T:
    """A request body as its model; ApiError naming what is wrong. Its cost grows with the body: a big one is
    parsed in the intake worker (intake.py)."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise ApiError("invalid_request", "the body is not JSON: nested deeper than the parser goes") from None
    except ValueError as e:
        raise ApiError("invalid_request", f"the body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError("invalid_request", "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise pydantic_error(e) from None


class Disconnected(Exception):
    """The client went away before the answer (its request was cancelled)."""


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[R]]) -> R:
    """work(), cancelled if the client disconnects first (then Disconnected)."""
    result, error, gone = None, None, False

    async def watch():
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        tg.cancel_scope.cancel()

    async def run():
        nonlocal result, error
        try:
            result = await work()
        except Exception as e:  # noqa: BLE001 - re-raised below, outside the task group
            error = e
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        tg.start_soon(run)
    if error is not None:
        raise error
    if gone:
        raise Disconnected()
    return result


def failed(request: Request, e: Exception) -> ApiError:
    """Any error of a request, counted, as an ApiError (an unexpected one logged with its traceback)."""
    err = ApiError.of(e)
    if err.kind == "internal":
        log.error("internal error on %s", request.url.path, exc_info=e)
    request.app.state.metrics.failed(err)
    return err
