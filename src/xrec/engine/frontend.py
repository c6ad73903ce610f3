"""What every engine offers its callers, whichever way it isolates its pipelines.

`EngineFrontend` is the type the server, `xrec batch` and Ray hold: the edge (validation
against the engine's `limits`, prompt tokenization), the request API built on two
primitives each engine implements (`submit_valid`, `submit_valid_many`), the catalog's
hot reload, and `stats()`, a snapshot of the engine's load (`EngineStats`; once an engine
is closed, or its process is gone, no load and `is_serving=False`).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from xrec.api_types import (CatalogVersion, RecRequest, RecResponse, SearchLimits, ValidRequest,
                            validate)
from xrec.config import EngineOptions
from xrec.errors import InvalidArgument

if TYPE_CHECKING:
    from xrec.catalog import ItemCatalog
    from xrec.engine.requests import BatchReport
    from xrec.tokenizer import PromptTokenizer


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load (what `/metrics` reads), the same for both engine kinds."""

    num_pipelines: int
    num_pipelines_busy: int
    num_requests_waiting: int          # submitted, not yet launched or answered
    num_batches_running: int
    workspace_bytes_total: int         # the budget of all pipelines
    workspace_bytes_in_use: int        # the estimate of the batches running now
    catalog_version: CatalogVersion | None   # the catalog new batches run on
    is_serving: bool = True            # takes new work: not closed, its scheduler running
    cpu_threads: int = 0               # CPU intra-op threads of all pipelines now (0: GPU)
    graph_captures: int = 0            # decode rounds captured (option cuda_graphs), all pipelines
    graph_replays: int = 0             # batches whose decode rounds were replayed


class EngineFrontend:
    """The request API (`submit`, `submit_many`, `recommend`, `recommend_async`) and what
    every engine offers besides: catalog reload, stats, report hooks, close."""

    limits: SearchLimits
    options: EngineOptions
    model_name: str
    dtype: str        # the dtype serving, resolved ("float32", "bfloat16"; option dtype "auto")
    family: str       # the model family ("onerec", "qwen")
    fused_kernels: bool   # its element-wise chains run compiled (option fused_kernels)
    tokenizer: PromptTokenizer | None
    num_pipelines: int
    workspace_per_pipeline: int

    def submit_valid(self, valid: ValidRequest, as_data: bool = False,
                     arrived_at: float | None = None) -> Future:
        """Queue a request that `validate` returned. `as_data`: the future resolves to the
        answer's arrays (`xrec.engine.responses.ResponseData`, what the HTTP server writes
        JSON from) instead of a `RecResponse` (thousands of small objects to build).
        `arrived_at`: when the request reached the edge, in `time.monotonic()` seconds
        (None: now); its `timeout_ms` counts from there."""
        raise NotImplementedError

    def submit_valid_many(self, valids: Sequence[ValidRequest], as_data: bool = False,
                          arrived_at: float | None = None) -> list[Future]:
        """Queue validated requests at once (so they can share a batch); `arrived_at` as in
        `submit_valid`."""
        raise NotImplementedError

    def close(self, grace_s: float = 30.0) -> None:
        """Stop accepting, finish what is queued and running (up to `grace_s`), stop."""
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    @property
    def is_serving(self) -> bool:
        """Takes new work (`stats().is_serving`), known without waiting on anything: `/health`
        reads it on the server's event loop."""
        return self.stats().is_serving

    def hold_wakeups(self) -> None:
        """Requests submitted until `release_wakeups()` queue without waking the scheduler,
        so requests accepted one by one but together (an HTTP burst) can share a batch.
        Holds nest; a hold delays a launch by at most ~50 ms, it never blocks one."""
        raise NotImplementedError

    def release_wakeups(self) -> None:
        raise NotImplementedError

    def add_report_hook(self, hook: Callable[[BatchReport], None]) -> None:
        """Call `hook(report)` after every batch with its sizes and times (metrics)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """What start-up logs show: limits, options, model, device, sizes (plain values)."""
        raise NotImplementedError

    # ---- the catalog (hot reload: engine/catalogs.py) ----------------------------

    @property
    def catalog_version(self) -> CatalogVersion | None:
        """The current catalog's version (content hash, item count, loaded at), or None."""
        raise NotImplementedError

    @property
    def previous_catalog_version(self) -> CatalogVersion | None:
        """The version `restore_catalog()` would bring back, or None."""
        raise NotImplementedError

    def catalog_versions(self) -> tuple[CatalogVersion | None, CatalogVersion | None]:
        """(`catalog_version`, `previous_catalog_version`) read at once: the two properties
        read one after the other may straddle a restore and name one version as both."""
        raise NotImplementedError

    def load_catalog(self, catalog: str | os.PathLike | ItemCatalog,
                     extended: bool | None = None) -> CatalogVersion:
        """Load a catalog file (or an `ItemCatalog`), check it against the model and swap it
        in; batches already launched finish on the one they started with."""
        raise NotImplementedError

    def restore_catalog(self) -> CatalogVersion | None:
        """Make the previous catalog current again; `NotFound` when there is none."""
        raise NotImplementedError

    # ---- the request API, built on submit_valid / submit_valid_many ---------------

    def submit(self, request: RecRequest) -> Future:
        """Validate and queue one request; its future resolves to a `RecResponse` or an
        `XrecError`. Raises `InvalidArgument` at once for a bad request."""
        return self.submit_valid(self.validate(request))

    def validate(self, request: RecRequest) -> ValidRequest:
        """The request checked and its prompt tokenized (the edge), not queued."""
        if not isinstance(request, RecRequest):
            raise InvalidArgument(f"expected a RecRequest, got {type(request).__name__}")
        return validate(request, self.limits, self.tokenizer)

    def submit_many(self, requests: Sequence[RecRequest]) -> list[Future]:
        """Validate every request, then queue them all at once (so they can share a batch).
        Raises `InvalidArgument` before queueing anything if one is bad; a request refused
        at admission (queue full, too big) has its future failed."""
        if not isinstance(requests, Sequence) or isinstance(requests, str):
            raise InvalidArgument(f"requests: expected a sequence of RecRequest, got "
                                  f"{type(requests).__name__}")
        for index, request in enumerate(requests):
            if not isinstance(request, RecRequest):
                raise InvalidArgument(f"requests[{index}]: expected a RecRequest, got "
                                      f"{type(request).__name__}")
        return self.submit_valid_many([self.validate(request) for request in requests])

    def recommend(self, requests: RecRequest | Sequence[RecRequest]) -> list[RecResponse]:
        """Run requests to completion (`submit_many`); responses in request order; the
        first failure is raised."""
        if isinstance(requests, RecRequest):
            requests = [requests]
        return [future.result() for future in self.submit_many(requests)]

    async def recommend_async(self, request: RecRequest) -> RecResponse:
        """Await one request; cancelling the awaiting task cancels a still-waiting request."""
        return await asyncio.wrap_future(self.submit(request))

    def __enter__(self) -> "EngineFrontend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def arrival_time(arrived_at: float | None) -> float:
    """When a request arrived, in `time.monotonic()` seconds (system-wide on Linux, so one
    process may pass it to another): `arrived_at` checked, or now when it is None."""
    if arrived_at is None:
        return time.monotonic()
    if (not isinstance(arrived_at, (int, float)) or isinstance(arrived_at, bool)
            or not math.isfinite(arrived_at)):
        raise InvalidArgument(f"arrived_at: got {arrived_at!r}, expected time.monotonic() seconds")
    return float(arrived_at)


def close_once(finalizer: weakref.finalize, own_threads: tuple[threading.Thread, ...],
               ended: threading.Event, grace_s: float) -> None:
    """The `close` of either engine kind. Its `finalizer` (the close at collection, grace 0)
    holds the close function, which takes the grace as its last argument and sets `ended`
    once done: the first call detaches and runs it with `grace_s`; a later call waits until
    that close has ended (bounded by its grace), except on one of the engine's `own_threads`,
    where it would wait for itself."""
    detached = finalizer.detach()
    if detached is not None:
        _, close, args, _ = detached
        close(*args, grace_s)
    elif threading.current_thread() not in own_threads:
        ended.wait()


def off_own_threads(threads: tuple[threading.Thread, ...], close: Callable[..., None],
                    *args: Any) -> None:
    """`close(*args)` here, or on a new thread when here is one of the engine's `threads`:
    a pipeline cannot wait for the batch it is still finishing, a receiver must go on
    reading the answers of what is drained, and a cyclic collection runs wherever it is
    triggered, maybe while that thread holds one of the engine's locks. That thread is no
    daemon: the close has taken the engine's exit hook, so the interpreter's exit waits for
    it (bounded by its grace) instead of finalizing with a batch still running (an abort)."""
    if threading.current_thread() in threads:
        threading.Thread(target=close, args=args, name="xrec-engine-close", daemon=False).start()
    else:
        close(*args)
