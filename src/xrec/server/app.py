"""The HTTP app: `create_app(engine, ...)` builds a transport-free FastAPI app over an
`XrecService` (service.py); uvicorn serves it in `run.py`, tests may drive it through
`httpx.ASGITransport`. Routes:

    POST /v1/rec/completions   native JSON (schemas.NativeRequest)
    POST /v1/completions       xllm-compatible (schemas.XllmRequest)
    POST /v1/chat/completions  OpenAI / xllm chat (chat.ChatRequest), models with a chat template
    GET  /v1/models            OpenAI list shape; GET /v1/models/{name}
    GET  /health               200 serving; 503 loading, draining, or the engine cannot serve
    GET  /metrics              Prometheus text (rendered on a worker thread)
    GET  /openapi.json         OpenAPI 3.1 document (openapi.py)
    GET  /v1/admin/catalog     catalog versions; POST loads one, POST .../restore (admin.py)

Decisions where docs/serving.md leaves a choice:

- Auth: with an API key, every route except `/health` needs `Authorization: Bearer
  KEY` (probes carry no secrets and health reveals nothing); `/metrics` is protected
  too. Auth is checked before routing, so an unknown path without a key is 401, with
  a key 404. Keys are compared in constant time.
- The event loop never waits on the engine: `/health` reads `engine.is_serving` (no round
  trip to a process-isolated engine's child) and `/metrics` renders on a worker thread,
  where `stats()` may wait on that child (bounded); one scrape of a stopped child froze
  every route before.
- 404 for unknown paths and 405 (code INVALID_ARGUMENT) for a wrong method answer in
  the error shape of every other error.
- Bodies are parsed by hand for exact error statuses, so FastAPI's own schema would be
  empty: `GET /openapi.json` serves `openapi.document`, written from the request models
  (behind the API key like every route but /health); the interactive /docs page is off
  (it loads assets from a CDN).
"""

from __future__ import annotations

import asyncio
import hmac
import os
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from xrec.engine.frontend import EngineFrontend
from xrec.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable
from xrec.server import openapi
from xrec.server.admin import DEFAULT_MAX_CATALOG_BYTES, CatalogFiles, add_catalog_routes
from xrec.server.service import COMPLETION_PATHS, XrecService, error_response

# the read-only routes answer HEAD as GET, without the body (RFC 9110 9.3.2; FastAPI adds no
# HEAD to a GET route, and probes that send HEAD /health got 405)
READ_METHODS = ["GET", "HEAD"]


class _Gate:
    """ASGI middleware: counts requests in flight (for the drain), checks the API key, and
    closes the connection after an answer given before the request's body was read (a 401,
    a 413 on the declared size): on a kept-alive connection uvicorn went on reading and
    dropping that body, however large, until the body timeout; closed, the drop is bounded
    (limits.py, the lingering close). Answers given while the server drains close their
    connection too: a client that sent its next request on it as the drain ended had it
    dropped unanswered (uvicorn closes idle kept-alive connections when it stops)."""

    def __init__(self, app: Any, service: XrecService):
        self.app, self.service = app, service

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        service = self.service
        receive, send = _closing_if_unread_or_draining(receive, send,
                                                       _has_body(scope["headers"]), service)
        service.num_in_flight += 1
        try:
            key = service.api_key
            if key is not None and scope["path"] != "/health" and not _is_authorized(scope, key):
                api = COMPLETION_PATHS.get(scope["path"])
                if api is not None:
                    service.metrics.on_finished(api, Unauthenticated.code)
                error = Unauthenticated("missing or wrong API key; send Authorization: Bearer KEY")
                return await error_response(error)(scope, receive, send)
            await self.app(scope, receive, send)
        finally:
            service.num_in_flight -= 1


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if (name == b"content-length" and value.strip() not in (b"0", b"")) or \
                name == b"transfer-encoding":
            return True
    return False


def _closing_if_unread_or_draining(receive: Any, send: Any, has_body: bool,
                                   service: XrecService) -> tuple[Any, Any]:
    """`receive` and `send` such that a response carries `Connection: close` when it starts
    before the last body chunk was received (`has_body`), or while `service` drains."""
    is_read = not has_body

    async def reading() -> dict:
        nonlocal is_read
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            is_read = True
        return message

    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start" and (not is_read or service.is_draining):
            message = {**message, "headers": [*message.get("headers", ()),
                                              (b"connection", b"close")]}
        await send(message)

    return (reading if has_body else receive), sending


def _is_authorized(scope: dict, key: bytes) -> bool:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
    return False


def create_app(engine: EngineFrontend | None, *, served_model_name: str | None = None,
               api_key: str | None = None, max_body_bytes: int | None = None,
               catalog_dir: str | os.PathLike | None = None,
               max_catalog_bytes: int = DEFAULT_MAX_CATALOG_BYTES) -> FastAPI:
    """The HTTP app for `engine` (None: loading until `app.state.xrec.attach(engine)`).
    `max_body_bytes`: None derives the limit from the engine (the largest valid request).
    `catalog_dir`: catalog loads (`POST /v1/admin/catalog`) read files of at most
    `max_catalog_bytes` there; None turns loads off (admin.py)."""
    files = None if catalog_dir is None else CatalogFiles(Path(catalog_dir), max_catalog_bytes)
    service = XrecService(engine, served_model_name, api_key, max_body_bytes)
    app = FastAPI(title="xrec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.xrec = service

    @app.post("/v1/rec/completions")
    async def rec_completions(request: Request) -> Response:
        return await service.complete(request, "native")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.complete(request, "xllm")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await service.complete(request, "chat")

    @app.api_route("/v1/models", methods=READ_METHODS)
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(service)]}

    @app.api_route("/v1/models/{name:path}", methods=READ_METHODS)
    async def model(name: str) -> Any:
        if name != service.model_name:
            return error_response(NotFound(f"model: got {name!r}, this server serves "
                                           f"{service.model_name!r}"))
        return _model_card(service)

    @app.api_route("/health", methods=READ_METHODS)
    async def health() -> Any:
        if service.is_draining or service.engine is None:
            state = "draining" if service.is_draining else "loading"
            return error_response(Unavailable(f"server is {state}"))
        if not service.engine.is_serving:
            return error_response(Unavailable("the engine takes no new work (closed, its "
                                              "scheduler stopped, or its process exited)"))
        return {"status": "ok", "model": service.model_name}

    @app.api_route("/metrics", methods=READ_METHODS)
    async def metrics() -> Response:
        body = await asyncio.to_thread(service.metrics.render)
        return Response(body, media_type=service.metrics.content_type)

    @app.api_route("/openapi.json", methods=READ_METHODS)
    async def openapi_document() -> dict:
        return openapi.document(service.api_key is not None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {request.method} {request.url.path}"))
        error = InvalidArgument(f"{request.method} {request.url.path}: {exc.detail}")
        error.http_status = exc.status_code
        response = error_response(error)
        response.headers.update(exc.headers or {})   # 405: Allow (RFC 9110)
        return response

    add_catalog_routes(app, service, files)
    app.add_middleware(_Gate, service=service)
    return app


def _model_card(service: XrecService) -> dict:
    """OpenAI's model object, plus `xrec`: the family, the dtype serving and whether its
    element-wise chains run fused (once loaded)."""
    card = {"id": service.model_name, "object": "model", "created": service.created,
            "owned_by": "xrec"}
    engine = service.engine
    if engine is not None:
        card["xrec"] = {"family": engine.family, "dtype": engine.dtype,
                        "fused_kernels": engine.fused_kernels}
    return card
