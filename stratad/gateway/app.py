"""The ASGI application: routes, the front door, /health and /metrics."""
from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protos import messages as M
from stratad.client import DaemonUnavailable, RequestError
from stratad.gateway import anthropic_api, openai_api, responses_api
from stratad.gateway.backend import Backend
from stratad.gateway.errors import ApiError, anthropic_response, openai_response
from stratad.gateway.guard import ApiKey, BodyLimit
from stratad.gateway.intake import Intake
from stratad.gateway.metrics import Metrics

MAX_BODY_BYTES = 16 << 20  # an agent's whole conversation with its tool results fits; more is refused (413)


async def health(request: Request) -> Response:
    """200 once no lane is still starting and one serves; 503 while they start or the daemon does not answer."""
    try:
        st = await request.app.state.backend.client.status()
    except (DaemonUnavailable, RequestError) as e:
        return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
    roles = [ln.role for ln in st.lanes]
    ready = M.Role.STARTING not in roles and any(r != M.Role.DOWN for r in roles)
    return JSONResponse({"status": "ok" if ready else "starting", "lanes": [r.value for r in roles]},
                        status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    try:
        st = await request.app.state.backend.client.status()
    except (DaemonUnavailable, RequestError):
        st = None  # stratad:daemon_up 0, and the gateway's own series
    return Response(request.app.state.metrics.render(st), media_type="text/plain; version=0.0.4; charset=utf-8")


async def no_route(request: Request, exc: HTTPException) -> Response:
    """A path or method this gateway does not serve, as a JSON error the client's package can read, naming what is
    served, in the shape of the API its path suggests: a wrong base URL or an endpoint we lack (OpenAI's files or
    vector stores) is then a clear message in the agent's log, not a bare "Not Found"."""
    served = sorted({f"{m} {r.path}" for r in request.app.routes for m in (r.methods or ()) if m != "HEAD"})
    kind, what = ("not_found", "no such endpoint") if exc.status_code == 404 else ("method_not_allowed", "not allowed")
    e = ApiError(kind, f"{what}: {request.method} {request.url.path}; this server has {', '.join(served)}")
    response = anthropic_response(e) if request.url.path.startswith("/v1/messages") else openai_response(e)
    response.headers.update(exc.headers or {})  # 405: Allow
    return response


def build(backend: Backend, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    routes = [
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/responses", responses_api.responses, methods=["POST"]),
        Route("/v1/models", openai_api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", openai_api.model, methods=["GET"]),
        Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    middleware = [Middleware(BodyLimit, max_bytes=max_body_bytes)]
    if api_key is not None:
        middleware.append(Middleware(ApiKey, key=api_key))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={404: no_route, 405: no_route})
    app.state.backend, app.state.metrics, app.state.intake = backend, Metrics(), Intake(backend)
    return app
