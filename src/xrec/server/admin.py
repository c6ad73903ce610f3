"""Catalog administration routes (hot reload; the engine side is `xrec.engine.catalogs`).

    GET  /v1/admin/catalog          {"current": VERSION | null, "previous": VERSION | null}
    POST /v1/admin/catalog          {"path": "/srv/catalogs/items-2026-12-01.bin",
                                     "extended": false}  -> the same shape, after the swap
    POST /v1/admin/catalog/restore  the previous version serves again -> the same shape

VERSION is `{"content_hash", "num_items", "loaded_at", "source", "is_extended"}`
(`xrec.api_types.CatalogVersion`). Every recommendation answer names the catalog its
batch ran on in the `X-Catalog-Version` header (its `content_hash`).

Decisions where the issue is silent:

- `path` is a file on the server's own file system, read as the engine reads catalogs
  (text for .txt/.csv, binary otherwise; `extended` defaults to the current catalog's
  form). The routes need the API key like every route but `/health`; a server
  without a key trusts its network for these routes too.
- The load runs on a worker thread; the event loop keeps answering. Loads and
  restores run one at a time (a second waits for the first).
- A file that fails a check is 400 INVALID_ARGUMENT naming the problem, and the
  current catalog keeps serving. A load lets go of the previous version before it
  reads the new file (two catalogs in memory at most), so after a refused load there
  is nothing to restore. Restore with nothing to restore: 404 NOT_FOUND.
- While the model loads or the server drains: 503, as the completion routes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from xrec.errors import Internal, XrecError
from xrec.server import schemas
from xrec.server.service import XrecService, error_response, read_body

if TYPE_CHECKING:
    from xrec.engine.frontend import EngineFrontend

logger = logging.getLogger(__name__)

MAX_ADMIN_BODY_BYTES = 64 << 10


class CatalogLoadRequest(BaseModel):
    model_config = schemas.STRICT
    path: str
    extended: bool | None = None


def add_catalog_routes(app: FastAPI, service: XrecService) -> None:
    """Register the catalog routes on `app` (create_app calls this)."""

    @app.get("/v1/admin/catalog")
    async def catalog_versions() -> Response:
        return await _change(service, None, None)

    @app.post("/v1/admin/catalog")
    async def load_catalog(request: Request) -> Response:
        async def load(engine: EngineFrontend) -> None:
            body = await read_body(request, MAX_ADMIN_BODY_BYTES)
            parsed = schemas.parse_body(body, CatalogLoadRequest)
            await asyncio.to_thread(engine.load_catalog, parsed.path, parsed.extended)
        return await _change(service, "load", load)

    @app.post("/v1/admin/catalog/restore")
    async def restore_catalog() -> Response:
        async def restore(engine: EngineFrontend) -> None:
            await asyncio.to_thread(engine.restore_catalog)
        return await _change(service, "restore", restore)


async def _change(service: XrecService, action: str | None,
                  change: Callable[[EngineFrontend], Awaitable[None]] | None) -> Response:
    """Run a load or restore (None: only read); answer both versions after it, or the
    error (a load or restore is counted by outcome)."""
    try:
        engine = service._engine_or_503()
        if change is not None:
            await change(engine)
        answer = _versions(engine)
    except XrecError as e:
        code, answer = e.code, error_response(e)
    except Exception as e:  # a server bug: answer it, keep serving
        logger.exception("catalog %s failed", action or "read")
        code, answer = Internal.code, error_response(Internal(f"{type(e).__name__}: {e}"))
    else:
        code = "OK"
    if action is not None:
        service.metrics.on_catalog_change(action, code)
    return answer


def _versions(engine: EngineFrontend) -> Response:
    current, previous = engine.catalog_version, engine.previous_catalog_version
    body = {"current": None if current is None else current.to_dict(),
            "previous": None if previous is None else previous.to_dict()}
    return Response(orjson.dumps(body), media_type="application/json")
