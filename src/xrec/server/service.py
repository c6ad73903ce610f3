"""What the HTTP routes share (`XrecService`): the engine, auth key, limits, metrics, drain, and
the path of one completion request: body -> parse -> engine -> answer JSON.

Decisions where docs/serving.md leaves a choice (the routes' own are in `app.py`):

- Every error is `{"error": {"code", "message", "request_id"}}`. 429 and 503 carry
  `Retry-After: 1`.
- The body limit is checked on `Content-Length` before reading, and on the bytes
  actually read (chunked bodies) before parsing: 413. By default it is the size of
  the largest valid request for the served model, and a body that holds more JSON
  values than that request is 413 before parsing (schemas.py). Connection-level limits
  (head size, read deadlines, connection cap) are in `limits.py`, below the app.
- `request_id`: the client's (1 to 256 visible ASCII characters, else 400 and the id
  is not repeated), else a fresh uuid4 hex (also for errors found before the body is
  parsed); it is the response's `id`, the `X-Request-Id` header and the error body's
  `request_id`.
- A native request may name `model` too (same check as xllm's: another name is 404
  NOT_FOUND; none goes to the served model).
- Bodies over 1 MiB are parsed and submitted on a worker thread, so a large embedding
  does not stall the event loop, one at a time (parsing holds the GIL: several at once
  are no faster, and each holds its parse memory). A handler cancelled meanwhile cannot
  stop that thread; the request the thread submits is cancelled (`_Submission`).
- Shutdown: requests whose answer is not ready when the drain's grace period ends are
  answered 503 UNAVAILABLE (`abandon_unfinished`), and so are those whose body is still
  arriving then; a handler that the server cancels answers 503 too, never uvicorn's
  plain-text 500.
- The client going away while its request waits or runs cancels it (a waiting request
  is dropped by the scheduler; a running batch finishes and the answer is dropped); it
  is counted as CANCELLED and answered 499 (which nobody reads). A client that goes
  away while sending its body: the same.
- `stream: true` (xllm and chat routes): the engine's answer is awaited as for any request,
  so every error keeps its JSON status, then written as server-sent events (stream.py).
- A `prompt` / `messages` that cannot fit `max_input_len` is refused before it is
  tokenized (the engine's validation, `api_types.check_prompt_bound`): BPE on a prompt near
  1 MiB takes most of a second, and under THREAD_PARSE_BYTES it would run on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from xrec.errors import (Cancelled, Internal, InvalidArgument, NotFound, PayloadTooLarge,
                         Unauthenticated, Unavailable, XrecError)
from xrec.server import chat, schemas, stream
from xrec.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from xrec.engine.frontend import EngineFrontend
    from xrec.engine.responses import ResponseData

logger = logging.getLogger(__name__)

THREAD_PARSE_BYTES = 1 << 20
# A burst's hold on the scheduler's wake-ups ends at the first event-loop iteration that
# accepts no request, or after this many iterations in all (a steady stream still launches).
MAX_HOLD_ITERATIONS = 16
COMPLETION_PATHS = {"/v1/rec/completions": "native", "/v1/completions": "xllm",
                    "/v1/chat/completions": "chat"}
ParsedBody = schemas.NativeRequest | schemas.XllmRequest | chat.ChatRequest
# api -> (body schema, body -> RecRequest)
REQUEST_SHAPES = {"native": (schemas.NativeRequest, schemas.native_request),
                  "xllm": (schemas.XllmRequest, schemas.xllm_request),
                  "chat": (chat.ChatRequest, chat.chat_request)}


class XrecService:
    """What the routes share: the engine (None while loading), name, auth, limits, metrics."""

    def __init__(self, engine: EngineFrontend | None, served_model_name: str | None, api_key: str | None,
                 max_body_bytes: int | None):
        """`max_body_bytes`: None derives it from the engine (schemas.max_body_bytes)."""
        checked_max_body_bytes(max_body_bytes)
        if engine is None and not served_model_name:
            raise ValueError("served_model_name is required when the engine is not loaded yet")
        self.engine: EngineFrontend | None = None
        self.model_name = served_model_name or engine.model_name
        self.api_key = checked_api_key(api_key)
        self._max_body_bytes = max_body_bytes
        self.max_body_bytes = max_body_bytes or 0   # set by attach() when derived
        self.max_json_values = 0                    # set by attach()
        self.metrics = ServerMetrics()
        self.is_draining = False
        self.is_abandoned = False   # the drain's grace period ended (event-loop thread only)
        self.num_in_flight = 0      # HTTP requests inside the app (event-loop thread only)
        self._is_holding = False    # the engine's wake-ups are held (event-loop thread only)
        self._num_accepted = 0      # requests accepted on the event loop (same thread)
        self._waiters: set[asyncio.Future] = set()   # answers awaited (event-loop thread only)
        self._big_parses = asyncio.Semaphore(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: EngineFrontend) -> None:
        """The engine is loaded: start serving it."""
        self.max_json_values = schemas.max_json_values(engine.limits)
        self.max_body_bytes = self._max_body_bytes or schemas.max_body_bytes(engine.limits)
        self.metrics.attach(engine)
        self.engine = engine

    def begin_drain(self) -> None:
        """Health turns 503 and new requests are refused UNAVAILABLE (queued ones finish)."""
        self.is_draining = True

    def abandon_unfinished(self) -> None:
        """From any thread, once the drain's grace period is over: every request still
        waiting for its answer is answered UNAVAILABLE now (its engine request is
        cancelled; a batch that runs it finishes and the answer is dropped)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._abandon)

    def _abandon(self) -> None:
        self.is_abandoned = True
        for waiter in list(self._waiters):
            waiter.cancel()

    async def read_body(self, request: Request, limit: int) -> bytes:
        """`read_body`, given up with UNAVAILABLE when the drain's grace period ends first
        (`abandon_unfinished`): a client still sending its body then (a slow or stalled
        upload) held the shutdown for the HTTP tail and uvicorn's graceful timeout, 20 s
        past the grace period, before its handler was cancelled."""
        self._loop = asyncio.get_running_loop()
        abandoned = Unavailable("server is shutting down; the request's body had not "
                                "arrived when the drain ended")
        if self.is_abandoned:
            raise abandoned
        reading = asyncio.ensure_future(read_body(request, limit))
        self._waiters.add(reading)
        try:
            return await reading
        except asyncio.CancelledError:
            if self.is_abandoned:
                raise abandoned from None
            raise
        finally:
            self._waiters.discard(reading)

    # ---- completions -----------------------------------------------------

    async def complete(self, request: Request, api: str) -> Response:
        started, request_id, code = time.perf_counter(), None, "INTERNAL"
        arrived = time.monotonic()   # the deadline (timeout_ms) counts from here
        self._loop = asyncio.get_running_loop()
        try:
            engine = self._engine_or_503()
            body = await self.read_body(request, self.max_body_bytes)
            if len(body) > THREAD_PARSE_BYTES:
                async with self._big_parses:
                    parsed, request_id, future, input_len = await self._accept_on_thread(
                        engine, body, api, arrived)
            else:
                self._hold_wakeups_this_iteration(engine)
                parsed, request_id, future, input_len = self._accept(engine, body, api, arrived)
            self.metrics.on_accepted(input_len)
            result = await self._await_answer(future, request)
            payload = self._payload(engine, api, parsed, result)
            headers = {"X-Request-Id": request_id}
            if result.catalog_version is not None:   # the catalog its batch ran on (admin.py)
                headers["X-Catalog-Version"] = result.catalog_version
            if getattr(parsed, "stream", None):   # the same answer as server-sent events
                include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
                response = stream.sse_response(payload, api, include_usage, headers)
            else:
                response = Response(_dumps(payload), media_type="application/json",
                                    headers=headers)
            code = "OK"
            return response
        except XrecError as e:
            code = e.code
            if e.code == "INTERNAL":
                logger.error("request %s failed: %s", request_id or e.request_id, e.message)
            return error_response(e, request_id)
        except asyncio.CancelledError:
            # uvicorn cancels handlers only when it shuts down; Ray Serve's proxy also when the
            # client goes away, which is the client's cancel, not an outage
            error = Unavailable("server is shutting down; the request was not finished") \
                if self.is_draining else Cancelled("the client went away; the request was "
                                                   "cancelled")
            code = error.code
            return error_response(error, request_id)
        except Exception as e:  # a server bug: answer it, keep serving
            logger.exception("request %s failed", request_id)
            return error_response(Internal(f"{type(e).__name__}: {e}"), request_id)
        finally:
            self.metrics.on_finished(api, code, time.perf_counter() - started)

    async def _await_answer(self, future: Future, request: Request) -> ResponseData:
        """The engine's answer; cancel the request if the client goes away first, or
        answer UNAVAILABLE if the drain abandons it."""
        waiter = asyncio.wrap_future(future)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        self._waiters.add(waiter)
        try:
            done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping this handler
            future.cancel()
            raise
        finally:
            watcher.cancel()
            self._waiters.discard(waiter)
        if waiter not in done:
            future.cancel()  # still waiting: the scheduler drops it; running: the answer is dropped
            waiter.cancel()
            raise Cancelled("client disconnected before the answer")
        if waiter.cancelled():
            if self.is_abandoned:
                raise Unavailable("server shut down before the answer was ready (the drain's "
                                  "grace period passed)")
            raise Cancelled("request was cancelled")
        return waiter.result()  # raises the engine's XrecError

    def _payload(self, engine: EngineFrontend, api: str, parsed: ParsedBody,
                 data: ResponseData) -> dict:
        """The answer's JSON object in the route's shape."""
        if api == "native":
            return schemas.native_response(data, self.model_name)
        result = data.to_response()
        tokenizer = engine.tokenizer
        token_string = tokenizer.id_to_token if tokenizer is not None else None
        if api == "xllm":
            items_on = data.catalog_version is not None and parsed.return_items  # a catalog
            return schemas.xllm_response(result, self.model_name, engine.options.rounds, items_on,
                                         token_string)
        return chat.chat_response(result, self.model_name, engine.options.rounds, parsed,
                                  token_string or (lambda i: None))

    def _hold_wakeups_this_iteration(self, engine: EngineFrontend) -> None:
        """Hold the scheduler's wake-ups while the event loop keeps accepting requests, so
        the requests of an HTTP burst start as one batch instead of the first running
        alone; no timer, a lone request waits two loop iterations (microseconds).

        A request whose bytes arrive in iteration j is accepted in j + 1 (its handler task
        starts there), behind a release scheduled in j; so the hold always lasts one more
        iteration, then ends at the first iteration that accepted nothing."""
        self._num_accepted += 1
        if not self._is_holding:
            self._is_holding = True
            engine.hold_wakeups()
            asyncio.get_running_loop().call_soon(self._release_when_quiet, engine,
                                                 MAX_HOLD_ITERATIONS, -1)

    def _release_when_quiet(self, engine: EngineFrontend, iterations_left: int,
                            num_seen: int) -> None:
        if iterations_left > 1 and self._num_accepted != num_seen:
            asyncio.get_running_loop().call_soon(self._release_when_quiet, engine,
                                                 iterations_left - 1, self._num_accepted)
            return
        self._is_holding = False
        engine.release_wakeups()

    def _engine_or_503(self) -> EngineFrontend:
        if self.is_draining:
            raise Unavailable("server is draining (shutting down); retry on another replica")
        if self.engine is None:
            raise Unavailable("model is loading; retry shortly")
        return self.engine

    def _accept(self, engine: EngineFrontend, body: bytes, api: str,
                arrived: float) -> tuple[ParsedBody, str, Future, int]:
        """Parse, check (prompts are tokenized here) and submit: (parsed body, request id,
        the engine's future, input length). `arrived`: when the request reached the server
        (`time.monotonic()`), where its deadline starts."""
        schema, convert = REQUEST_SHAPES[api]
        schemas.check_value_count(body, self.max_json_values)
        parsed = schemas.parse_body(body, schema)
        request_id = schemas.request_id_of(parsed)
        try:
            self._check_model(parsed.model)
            request = convert(parsed, request_id)
            valid = engine.validate(request)
            future = engine.submit_valid(valid, as_data=True, arrived_at=arrived)
        except XrecError as e:
            e.request_id = e.request_id or request_id
            raise
        return parsed, request_id, future, valid.input_len

    async def _accept_on_thread(self, engine: EngineFrontend, body: bytes, api: str,
                                arrived: float) -> tuple[ParsedBody, str, Future, int]:
        """`_accept` on a worker thread. A handler cancelled meanwhile (Ray Serve's proxy
        cancels it when the client goes away) cannot stop that thread, so the request the
        thread submits is cancelled as it is submitted; before, it ran with nobody awaiting it."""
        submission = _Submission()
        try:
            return await asyncio.to_thread(submission.run, self._accept, engine, body, api, arrived)
        except asyncio.CancelledError:
            submission.abandon()
            raise

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise NotFound(f"model: got {name!r}, this server serves {self.model_name!r}")


class _Submission:
    """A request submitted on a worker thread for a handler that may be cancelled meanwhile:
    whichever of the two comes second (the submission, the handler's cancellation) cancels
    the engine's future."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._future: Future | None = None
        self._is_abandoned = False

    def run(self, accept: Any, *args: Any) -> tuple[ParsedBody, str, Future, int]:
        """On the worker thread: `accept(*args)`, whose third value is the engine's future."""
        accepted = accept(*args)
        with self._lock:
            self._future = accepted[2]
            if self._is_abandoned:
                self._future.cancel()
        return accepted

    def abandon(self) -> None:
        """On the event loop: the handler was cancelled; its request is not wanted."""
        with self._lock:
            self._is_abandoned = True
            if self._future is not None:
                self._future.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (declared or actually sent)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidArgument(f"Content-Length: got {declared!r}, "
                                  "expected an integer") from None
        if size > limit:
            raise PayloadTooLarge(f"body of {size} bytes is over the limit of {limit} bytes")
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise Cancelled("client disconnected while sending the body") from None
    return b"".join(chunks)


def _dumps(payload: Any) -> bytes:
    """orjson: much faster than json (docs/decisions.md, HTTP server). Results are finite by
    construction (-inf candidates are dropped before a response is built)."""
    return orjson.dumps(payload)


def error_response(error: XrecError, request_id: str | None = None) -> Response:
    rid = request_id or error.request_id or uuid.uuid4().hex
    body = {"error": {"code": error.code, "message": error.message, "request_id": rid}}
    headers = {"X-Request-Id": rid}
    if error.http_status in (429, 503):
        headers["Retry-After"] = "1"
    if isinstance(error, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    return Response(json.dumps(body).encode(), status_code=error.http_status,
                    media_type="application/json", headers=headers)


def checked_max_body_bytes(max_body_bytes: int | None) -> None:
    """A body limit in bytes: an integer >= 1, or None (derived from the engine)."""
    if max_body_bytes is not None and (isinstance(max_body_bytes, bool)
                                       or not isinstance(max_body_bytes, int)
                                       or max_body_bytes < 1):
        raise ValueError(f"max_body_bytes: got {max_body_bytes!r}, expected an integer >= 1")


def checked_api_key(api_key: str | None) -> bytes | None:
    """The API key as bytes; an empty key (which would turn auth off) or one that cannot
    be sent in a header is refused."""
    if api_key is None:
        return None
    if not api_key:
        raise ValueError("api key: got an empty string; give a non-empty key, or none at all "
                         "to serve without auth")
    if not all("!" <= c <= "~" for c in api_key):
        raise ValueError("api key: expected visible ASCII characters (0x21-0x7E), the form a "
                         "Bearer token takes in a header")
    return api_key.encode()
