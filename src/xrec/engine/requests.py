"""What the scheduler and the executor say to each other, as data (no torch, no numpy):

    ScheduledRequest   one request: its sizes, deadline and future; the request itself for the executor
    ScheduledBatch     scheduler -> executor: requests, budgets used, the catalog the batch runs on
    BatchReport        executor -> scheduler: each request's answer (or the batch's error), times

The scheduler is bookkeeping and is tested on a CPU in milliseconds: it never reads a
request's content or a catalog's tables, only their sizes (`BatchCatalog.batch_bytes`).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, InvalidStateError
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

from xrec.errors import XrecError

RequestT = TypeVar("RequestT")    # what the executor runs (the engine's: a validated request)
AnswerT = TypeVar("AnswerT")      # what a request is answered with


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(eq=False)
class ScheduledRequest(Generic[RequestT]):
    """One request as the scheduler sees it: sizes, deadline, one future, and the request
    the executor runs (never read by the scheduler).

    `deadline` and `enqueued_at` are in the scheduler clock's seconds
    (`time.monotonic()` by default); `deadline=None` means no deadline.
    The future is answered exactly once: `answer` / `fail` return False (and
    never raise) when it was already answered or cancelled.
    """

    request_id: str
    num_tokens: int          # encoder + decoder-prefix tokens
    beam_width: int
    num_results: int         # N (num_return_sequences)
    request: RequestT
    deadline: float | None = None
    future: Future = field(default_factory=Future)
    enqueued_at: float = 0.0  # set by FixedStepsScheduler.submit()
    answer_as_data: bool = False  # the future gets the `ResponseData`, not a `RecResponse`
    # Owned by the scheduler: set under its lock on submit / by its loop thread only.
    _is_submitted: bool = field(default=False, init=False, repr=False)
    _num_overtaken: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, low in (("num_tokens", 0), ("beam_width", 1), ("num_results", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"ScheduledRequest.{name}: got {value!r}, "
                                 f"expected an integer >= {low}")

    def answer(self, result: Any) -> bool:
        """Set the result; False if the future was already answered or cancelled."""
        try:
            self.future.set_result(result)
        except InvalidStateError:
            return False
        return True

    def mark_running(self) -> bool:
        """Once running, cancel() fails and the executor owns the answer. False: drop it."""
        try:
            return self.future.set_running_or_notify_cancel()
        except RuntimeError:  # already answered elsewhere
            return False

    def fail(self, exc: BaseException) -> bool:
        """Set the exception (tagged with this request's id); False if already done."""
        if isinstance(exc, XrecError) and exc.request_id is None:
            exc.request_id = self.request_id
        try:
            self.future.set_exception(exc)
        except InvalidStateError:
            return False
        return True


def notify_cancelled(future: Future) -> None:
    """Move a cancelled `future` to CANCELLED_AND_NOTIFIED, as its owner must: until then
    `concurrent.futures.wait` and `as_completed` do not count it as done (they wait their
    whole timeout on it, or for ever), though `result()` raises `CancelledError` at once.
    Idempotent; does nothing to a future that is not cancelled."""
    if not future.cancelled():
        return
    try:
        future.set_running_or_notify_cancel()
    except RuntimeError:   # notified already
        pass


@dataclass(frozen=True)
class BatchLimits:
    """Per-batch budgets and queue limits of the FixedStepsScheduler.

    Every launched batch holds at most `max_seqs_per_batch` requests, whose
    `num_tokens` sum to at most `max_tokens_per_batch`, whose `beam_width` sum
    to at most `max_beams_per_batch`, and whose workspace estimate is at most
    `max_workspace_bytes` (one pipeline's workspace). At most `max_concurrency`
    batches are in flight; at most `request_queue_size` requests wait to be
    launched. `batch_wait_ms` lets a free pipeline wait that long (from the
    oldest waiting request) to fill a partial batch. `max_overtakes` > 0 lets
    smaller requests join a batch past one that does not fit; each request can
    be passed over by at most that many batches.
    """

    max_seqs_per_batch: int
    max_tokens_per_batch: int
    max_beams_per_batch: int
    max_workspace_bytes: int
    max_concurrency: int
    request_queue_size: int
    batch_wait_ms: float = 0.0
    max_overtakes: int = 0

    def __post_init__(self) -> None:
        for name in ("max_seqs_per_batch", "max_tokens_per_batch", "max_beams_per_batch",
                     "max_workspace_bytes", "max_concurrency", "request_queue_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"BatchLimits.{name}: got {value!r}, expected an integer >= 1")
        if not _is_int(self.max_overtakes) or self.max_overtakes < 0:
            raise ValueError(f"BatchLimits.max_overtakes: got {self.max_overtakes!r}, "
                             "expected an integer >= 0")
        wait = self.batch_wait_ms
        if (not isinstance(wait, (int, float)) or isinstance(wait, bool) or not math.isfinite(wait)
                or wait < 0):
            raise ValueError(f"BatchLimits.batch_wait_ms: got {wait!r}, "
                             "expected a finite number >= 0")

    def why_too_big(self, request: ScheduledRequest, num_bytes: int) -> str | None:
        """Why `request` (needing `num_bytes` of workspace) could not fit even an empty batch."""
        if request.num_tokens > self.max_tokens_per_batch:
            return (f"request needs {request.num_tokens} tokens; "
                    f"max_tokens_per_batch={self.max_tokens_per_batch}")
        if request.beam_width > self.max_beams_per_batch:
            return (f"request needs beam_width={request.beam_width}; "
                    f"max_beams_per_batch={self.max_beams_per_batch}")
        if num_bytes > self.max_workspace_bytes:
            return (f"request needs {num_bytes} workspace bytes; "
                    f"max_workspace_bytes={self.max_workspace_bytes}")
        return None


class BatchCatalog(Protocol):
    """What the scheduler asks of the catalog a batch will run on: the workspace its
    requests need there (bytes; never shrinks when a request is added)."""

    def batch_bytes(self, requests: Sequence[ScheduledRequest]) -> int: ...


CatalogT = TypeVar("CatalogT", bound=BatchCatalog)


@dataclass(frozen=True, eq=False)
class ScheduledBatch(Generic[RequestT, CatalogT]):
    """A batch the scheduler hands the executor: its requests in launch order, the budgets
    they use, and the catalog it runs on (the one its workspace estimate was made on)."""

    requests: tuple[ScheduledRequest[RequestT], ...]
    catalog: CatalogT
    num_tokens: int
    num_beams: int
    workspace_bytes: int

    @property
    def num_requests(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class BatchReport(Generic[AnswerT]):
    """What the executor returns for a finished batch: one answer per request in batch order
    (an `XrecError` answer fails that request alone), or the error that failed the whole
    batch; its sizes and times (seconds) for the metrics."""

    num_requests: int
    num_beams: int
    run_s: float
    queue_s: tuple[float, ...]
    finished_at: float       # when the answers were ready (the scheduler clock's seconds)
    answers: tuple[AnswerT, ...] = ()
    error: XrecError | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None

    def without_answers(self) -> BatchReport:
        """The sizes and times alone (what the metrics read)."""
        return replace(self, answers=())


@dataclass
class BatchBuilder:
    """A batch being built on one catalog: its requests so far and the budgets they use."""

    limits: BatchLimits
    catalog: BatchCatalog
    requests: list[ScheduledRequest] = field(default_factory=list)
    num_tokens: int = 0
    num_beams: int = 0
    workspace_bytes: int = 0

    @property
    def is_full(self) -> bool:
        return len(self.requests) >= self.limits.max_seqs_per_batch

    def try_add(self, request: ScheduledRequest) -> bool:
        """Add `request` if the batch stays within every budget; False (unchanged) if not."""
        limits = self.limits
        if (self.is_full or self.num_tokens + request.num_tokens > limits.max_tokens_per_batch
                or self.num_beams + request.beam_width > limits.max_beams_per_batch):
            return False
        self.requests.append(request)
        try:
            num_bytes = self.catalog.batch_bytes(self.requests)
        except BaseException:
            self.requests.pop()
            raise
        if num_bytes > limits.max_workspace_bytes:
            self.requests.pop()
            return False
        self.num_tokens += request.num_tokens
        self.num_beams += request.beam_width
        self.workspace_bytes = num_bytes
        return True

    def batch(self) -> ScheduledBatch:
        return ScheduledBatch(tuple(self.requests), self.catalog, self.num_tokens,
                              self.num_beams, self.workspace_bytes)
