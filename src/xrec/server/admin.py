"""Catalog administration routes (hot reload; the engine side is `xrec.engine.catalogs`).

    GET  /v1/admin/catalog          {"current": VERSION | null, "previous": VERSION | null}
    POST /v1/admin/catalog          {"path": "items-2026-12-01.bin", "extended": false}
                                    -> the same shape, after the swap (needs a catalog dir)
    POST /v1/admin/catalog/restore  the previous version serves again -> the same shape

VERSION is `{"content_hash", "num_items", "loaded_at", "source", "is_extended"}`
(`xrec.api_types.CatalogVersion`). Every recommendation answer names the catalog its
batch ran on in the `X-Catalog-Version` header (its `content_hash`).

Decisions where the issue is silent:

- Loads read the server's disk, so they are off unless the operator names a catalog
  directory (`create_app(catalog_dir=...)`, `xrec serve --catalog-dir DIR`); off, a load
  is 404 NOT_FOUND saying how to turn it on. `path` is relative to that directory (an
  absolute path inside it is accepted too); symlinks and `..` are resolved first and
  anything that lands outside is refused. The file must be a regular file of at most
  `max_catalog_bytes` (`--max-catalog-bytes`, default 4 GiB), checked before anything is
  read by the one check the catalog readers use (`xrec.utils.files`: stat, open without
  blocking, fstat): a FIFO, a device or a directory is refused, never read. It is then
  read as the engine reads catalogs (text for .txt/.csv, binary otherwise; `extended`
  defaults to the current catalog's form, and to false for a text file).
- Errors name the file relative to the catalog directory and the problem, never the
  file's text (a load names any file, not only catalogs). The routes need the API key
  like every route but `/health`; with a catalog directory and no key, the server logs a
  warning at start: it trusts its network for loads too.
- Loads and restores run on a thread of their own, one at a time (a second waits for the
  first); the event loop keeps answering. Not on asyncio's default pool: large request
  bodies are parsed there (service.py), and loads queued on it held its threads (a 1.1 MB
  request waited 29 s behind six loads).
- The answer's two versions are read at once (`catalog_versions()`, one round trip to a
  process-isolated engine's child, on a worker thread): read one after the other, they
  could straddle a restore and name one version as both. After a load or restore they
  are read on the catalog thread right after it, so the answer names the catalog that
  load swapped in, never one of a load queued behind it.
- A file that fails a check is 400 INVALID_ARGUMENT naming the problem, and the
  current catalog keeps serving. A load lets go of the previous version before it
  reads the new file (two catalogs in memory at most), so after a load refused by the
  catalog's own checks there is nothing to restore (one refused by the file checks
  above, before reading, keeps it). Restore with nothing to restore: 404 NOT_FOUND.
- While the model loads or the server drains: 503, as the completion routes. A load or
  restore still running when uvicorn's graceful shutdown times out and cancels its handler
  is answered 503 too (the change itself runs on to its end on the catalog thread).
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from xrec.api_types import CatalogVersion
from xrec.errors import Cancelled, Internal, InvalidArgument, NotFound, Unavailable, XrecError
from xrec.server import schemas
from xrec.server.service import XrecService, error_response
from xrec.utils.files import LONE_SURROGATE, FileRefused, check_regular_file

if TYPE_CHECKING:
    from xrec.engine.frontend import EngineFrontend

logger = logging.getLogger(__name__)

Versions = tuple[CatalogVersion | None, CatalogVersion | None]   # (current, previous)

MAX_ADMIN_BODY_BYTES = 64 << 10
DEFAULT_MAX_CATALOG_BYTES = 4 << 30


class CatalogLoadRequest(BaseModel):
    model_config = schemas.STRICT
    path: str
    extended: bool | None = None


@dataclass(frozen=True)
class CatalogFiles:
    """The files catalog loads may read: regular files under `directory` (resolved at
    start) of at most `max_bytes` each (module docstring)."""

    directory: Path
    max_bytes: int = DEFAULT_MAX_CATALOG_BYTES

    def __post_init__(self) -> None:
        if (not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool)
                or self.max_bytes < 1):
            raise ValueError(f"max_catalog_bytes: got {self.max_bytes!r}, expected an "
                             f"integer >= 1")
        directory = Path(os.path.realpath(self.directory))
        if not directory.is_dir():
            raise ValueError(f"catalog_dir: got {str(self.directory)!r}, expected an existing "
                             f"directory")
        object.__setattr__(self, "directory", directory)

    def resolve(self, path: str) -> tuple[Path, str]:
        """The real path of `path` (relative to the directory, or absolute inside it) and
        its name relative to the directory; `InvalidArgument` when it lands outside."""
        if "\0" in path:
            raise InvalidArgument("path: holds a NUL character")
        try:
            real = Path(os.path.realpath(self.directory / path))
        except UnicodeEncodeError:   # realpath encodes the name to ask the file system
            raise InvalidArgument(f"path: {LONE_SURROGATE}") from None
        if real != self.directory and self.directory not in real.parents:
            raise InvalidArgument(f"path: got {path[:200]!r}, which is outside the catalog "
                                  f"directory; name a file in it (relative to it)")
        return real, real.relative_to(self.directory).as_posix()

    def load(self, engine: EngineFrontend, path: str, extended: bool | None) -> None:
        """Check `path` and load it into `engine` (blocking: runs on the catalog thread)."""
        real, name = self.resolve(path)
        try:
            check_regular_file(real, self.max_bytes)
        except FileRefused as exc:
            raise InvalidArgument(f"catalog {name}: {exc}") from None
        try:
            engine.load_catalog(str(real), extended)
        except XrecError as exc:   # the engine names the file by its real path
            raise type(exc)(exc.message.replace(str(real), name)) from None


def add_catalog_routes(app: FastAPI, service: XrecService,
                       files: CatalogFiles | None = None) -> None:
    """Register the catalog routes on `app` (create_app calls this); loads read `files`
    (None: loads are off)."""
    if files is not None and service.api_key is None:
        logger.warning("catalog loads from %s are on without an API key: whoever reaches "
                       "the server may load any catalog file there", files.directory)
    changes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xrec-catalog")

    async def on_changes_thread(engine: EngineFrontend, change: Callable[..., Any],
                                *args: Any) -> Versions:
        """`change(*args)`, then both versions, read on the same thread: a load or restore
        queued behind it cannot swap in between (it answered with that one's catalog)."""
        def change_then_read() -> Versions:
            change(*args)
            return engine.catalog_versions()
        return await asyncio.get_running_loop().run_in_executor(changes, change_then_read)

    # one route for both methods: with a route each, the 405 for any other method named
    # only the first route's method in its Allow header
    @app.api_route("/v1/admin/catalog", methods=["GET", "POST"])
    async def catalog(request: Request) -> Response:
        async def load(engine: EngineFrontend) -> Versions:
            if files is None:
                raise NotFound("catalog loads are off on this server: start it with "
                               "--catalog-dir DIR to load catalog files from DIR")
            body = await service.read_body(request, MAX_ADMIN_BODY_BYTES)
            parsed = schemas.parse_body(body, CatalogLoadRequest)
            return await on_changes_thread(engine, files.load, engine, parsed.path,
                                           parsed.extended)
        if request.method == "GET":
            return await _change(service, None, None)
        return await _change(service, "load", load)

    @app.post("/v1/admin/catalog/restore")
    async def restore_catalog() -> Response:
        async def restore(engine: EngineFrontend) -> Versions:
            return await on_changes_thread(engine, engine.restore_catalog)
        return await _change(service, "restore", restore)


async def _change(service: XrecService, action: str | None,
                  change: Callable[[EngineFrontend], Awaitable[Versions]] | None) -> Response:
    """Run a load or restore (None: only read); answer both versions after it, or the
    error (a load or restore is counted by outcome)."""
    try:
        engine = service._engine_or_503()
        if change is None:
            answer = _versions(*await asyncio.to_thread(engine.catalog_versions))
        else:
            answer = _versions(*await change(engine))
    except XrecError as e:
        code, answer = e.code, error_response(e)
    except asyncio.CancelledError:
        # uvicorn cancels a handler still running when its graceful shutdown times out (a
        # load that outlasts the drain): an answer in the error shape, as service.complete's,
        # never uvicorn's plain-text 500. The catalog thread cannot be stopped.
        what = "the request" if action is None else \
            f"the catalog {action} was not waited for (it may still be applied)"
        error = Unavailable(f"server is shutting down; {what}") if service.is_draining else \
            Cancelled(f"the handler was cancelled; {what}")
        code, answer = error.code, error_response(error)
    except Exception as e:  # a server bug: answer it, keep serving
        logger.exception("catalog %s failed", action or "read")
        code, answer = Internal.code, error_response(Internal(f"{type(e).__name__}: {e}"))
    else:
        code = "OK"
    if action is not None:
        service.metrics.on_catalog_change(action, code)
    return answer


def _versions(current: CatalogVersion | None, previous: CatalogVersion | None) -> Response:
    body = {"current": None if current is None else current.to_dict(),
            "previous": None if previous is None else previous.to_dict()}
    return Response(orjson.dumps(body), media_type="application/json")
