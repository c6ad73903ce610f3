"""FixedStepsScheduler: bounded request queue -> FIFO waiting queue -> batches under budgets.

Bookkeeping only (no torch, no numpy). One loop thread builds each batch on the
current catalog and hands it to `launch` as a `ScheduledBatch`; the executor runs it
and returns a `BatchReport` through `finish()`, once per batch, whatever the outcome.
The scheduler answers every request exactly once: refused (submit), dropped (deadline
passed), shut down (close) or finished (its report); cancelled requests are dropped
without an answer.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from xrec.engine.requests import (BatchBuilder, BatchCatalog, BatchLimits, BatchReport,
                                  ScheduledBatch, ScheduledRequest, notify_cancelled)
from xrec.errors import DeadlineExceeded, Internal, ResourceExhausted, Unavailable, XrecError

__all__ = ["BatchLimits", "FixedStepsScheduler", "ScheduledBatch", "ScheduledRequest"]

logger = logging.getLogger(__name__)

MAX_IDLE_WAIT_S = 0.05  # the loop looks at the clock at least this often
_KEEP = object()        # _drop_reason: the request stays in the queue
Dropped = list[tuple[ScheduledRequest, "XrecError | None"]]  # None: drop without an answer


class FixedStepsScheduler:
    """Admits requests FIFO into batches that fit `limits`; at most `max_concurrency` in flight.

    `catalog()` is the catalog new batches run on (it may change between calls): a batch
    is built and admitted on one catalog's workspace estimate and runs on that catalog.
    `clock` is the time base of request deadlines (`time.monotonic` by default).
    `submit` never blocks.
    """

    def __init__(self, limits: BatchLimits,
                 launch: Callable[[ScheduledBatch], None],
                 catalog: Callable[[], BatchCatalog],
                 clock: Callable[[], float] = time.monotonic):
        self._limits, self._launch = limits, launch
        self._catalog, self._clock = catalog, clock
        # Shared state below is touched only under self._cond's plain lock, which is never
        # held while calling launch(), a catalog's batch_bytes() or any Future method (so no
        # other lock is ever taken inside it: no lock order to get wrong).
        self._cond = threading.Condition(threading.Lock())
        self._incoming: collections.deque[ScheduledRequest] = collections.deque()
        self._num_pending = 0      # submitted; not yet launched, dropped or refused
        self._num_running = 0      # launched batches without batch_done() yet
        self._num_events = 0       # bumped by every change the loop must look at
        self._is_sweep_needed = False  # a waiting request was cancelled
        self._is_closing = False   # submit() refuses; partial batches are not held
        self._is_stopping = False  # the loop fails what still waits and exits
        self._num_holds = 0        # hold_wakeups() not yet released
        self._thread: threading.Thread | None = None
        # Owned by the loop thread only.
        self._waiting: collections.deque[ScheduledRequest] = collections.deque()
        self._next_deadline = math.inf  # no waiting request expires before this

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet launched or answered."""
        with self._cond:
            return self._num_pending

    @property
    def num_running_batches(self) -> int:
        with self._cond:
            return self._num_running

    @property
    def is_running(self) -> bool:
        """The loop thread runs and takes requests (started, not closing, not failed)."""
        with self._cond:
            thread, is_closing = self._thread, self._is_closing
        return thread is not None and thread.is_alive() and not is_closing

    @property
    def thread(self) -> threading.Thread | None:
        """The loop thread (None before `start`)."""
        return self._thread

    def start(self) -> None:
        """Start the loop thread (a daemon). Requests submitted before wait for it."""
        with self._cond:
            if self._thread is not None or self._is_closing:
                raise RuntimeError("FixedStepsScheduler.start: already started or closed")
            self._thread = threading.Thread(target=self._run, name="xrec-scheduler", daemon=True)
            self._thread.start()

    def submit(self, request: ScheduledRequest) -> None:
        """Queue a request, or fail its future with the refusal and raise that error too."""
        error = self.submit_many([request])[0]
        if error is not None:
            raise error

    def submit_many(self, requests: Sequence[ScheduledRequest]) -> list[XrecError | None]:
        """Queue several requests at once (one wake-up, so they can share a batch).

        Returns, per request, None (queued) or the refusal its future was failed with.
        """
        with self._cond:
            for request in requests:
                self._check_not_submitted(request)
            is_closing = self._is_closing
        errors: list[XrecError | None] = []
        catalog = self._catalog()
        for request in requests:
            error: XrecError | None = Unavailable("server is shutting down") if is_closing else None
            if error is None:
                try:
                    reason = self._limits.why_too_big(request, catalog.batch_bytes([request]))
                    error = ResourceExhausted(reason) if reason else None
                except Exception as exc:  # an estimator bug fails this request only
                    error = Internal(f"workspace estimate failed: {exc!r}")
            errors.append(error)
        with self._cond:
            for index, request in enumerate(requests):
                if errors[index] is not None:
                    continue
                self._check_not_submitted(request)
                if self._is_closing:
                    errors[index] = Unavailable("server is shutting down")
                elif self._num_pending >= self._limits.request_queue_size:
                    errors[index] = ResourceExhausted(
                        f"request queue is full with {self._num_pending} requests; "
                        f"request_queue_size={self._limits.request_queue_size}")
                else:
                    request._is_submitted = True
                    request.enqueued_at = self._clock()
                    self._incoming.append(request)
                    self._num_pending += 1
            if not self._num_holds:
                self._notify_loop()   # else the last release_wakeups() does
        for request, error in zip(requests, errors):
            if error is None:  # runs at once if it was cancelled meanwhile
                request.future.add_done_callback(self._on_future_done)
            else:
                request.fail(error)
        return errors

    def hold_wakeups(self) -> None:
        """Until the matching `release_wakeups`, submissions queue without waking the loop,
        so requests accepted together (an HTTP burst) can start as one batch. Holds nest.
        The loop still looks at the queue at least every MAX_IDLE_WAIT_S and on any other
        event: a hold delays a launch, it never blocks one."""
        with self._cond:
            self._num_holds += 1

    def release_wakeups(self) -> None:
        with self._cond:
            if self._num_holds < 1:
                raise RuntimeError("release_wakeups() without hold_wakeups()")
            self._num_holds -= 1
            if not self._num_holds:
                self._notify_loop()

    def finish(self, batch: ScheduledBatch, report: BatchReport) -> None:
        """The executor finished `batch`: answer each request with its answer, or the batch's
        error, or DEADLINE_EXCEEDED when it finished past its deadline; free the batch's slot."""
        try:
            finished = report.finished_at
            for index, request in enumerate(batch.requests):
                answer = report.answers[index] if report.error is None else None
                if report.error is not None:
                    request.fail(type(report.error)(report.error.message))
                elif isinstance(answer, XrecError):   # this request alone failed
                    request.fail(answer)
                elif request.deadline is not None and finished > request.deadline:
                    late_ms = round(1000.0 * (finished - request.deadline), 3)
                    request.fail(DeadlineExceeded(f"request finished {late_ms} ms after its "
                                                  "deadline"))
                else:
                    request.answer(answer)
        finally:
            self.batch_done()

    def batch_done(self) -> None:
        """One launched batch is over (any outcome); frees its slot. `finish` calls this."""
        with self._cond:
            if self._num_running < 1:
                raise RuntimeError("batch_done() called more often than batches were launched")
            self._num_running -= 1
            self._notify_loop()

    def close(self, grace_s: float = 30.0) -> None:
        """Stop accepting; drain for up to `grace_s`; fail what still waits UNAVAILABLE.

        Batches in flight after the grace period stay with the executor. Idempotent.
        From the loop thread itself (a future callback) it only tells the loop to stop.
        """
        with self._cond:
            self._is_closing = True
            self._notify_loop()
            thread, leftover = self._thread, []
            is_loop_thread = threading.current_thread() is thread
            self._is_stopping |= thread is None or is_loop_thread
            if thread is None:  # never started: nobody else will answer these
                leftover = self._remove_all()
        if thread is None or is_loop_thread:
            _fail_all(leftover, Unavailable("server is shutting down"))
            return
        with self._cond:
            self._cond.wait_for(lambda: self._is_stopping or (
                self._num_pending == 0 and self._num_running == 0), timeout=max(0.0, grace_s))
            self._is_stopping = True
            self._notify_loop()
        thread.join(timeout=max(1.0, grace_s))
        if thread.is_alive():
            logger.error("scheduler loop did not stop; is launch() blocking?")

    @staticmethod
    def _check_not_submitted(request: ScheduledRequest) -> None:
        """Caller holds the lock. A second submit must not launch or answer it again."""
        if request._is_submitted:
            raise ValueError(f"request {request.request_id!r} was already submitted")

    def _notify_loop(self) -> None:
        """Caller holds the lock."""
        self._num_events += 1
        self._cond.notify_all()

    def _remove_all(self) -> list[ScheduledRequest]:
        """Caller holds the lock and is the loop thread, or there is no loop thread."""
        leftover = [*self._waiting, *self._incoming]
        self._waiting.clear()
        self._incoming.clear()
        self._num_pending -= len(leftover)
        self._cond.notify_all()
        return leftover

    def _on_future_done(self, future: Future) -> None:
        if future.cancelled():  # the client went away: the loop drops it and frees its slot
            notify_cancelled(future)   # so that wait() and as_completed() see it done
            with self._cond:
                self._is_sweep_needed = True
                self._notify_loop()

    # ---- loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as exc:  # a bug here must not leave futures unanswered
            logger.exception("scheduler loop failed; failing every waiting request")
            with self._cond:
                self._is_closing = self._is_stopping = True
                leftover = self._remove_all()
            _fail_all(leftover, Internal(f"scheduler loop failed: {exc!r}"))
            raise

    def _step(self) -> bool:
        """One pass: take new requests, drop dead ones, launch a batch or wait. False: stop."""
        with self._cond:
            for request in self._incoming:
                if request.deadline is not None:
                    self._next_deadline = min(self._next_deadline, request.deadline)
            self._waiting.extend(self._incoming)
            self._incoming.clear()
            is_stopping = self._is_stopping
            leftover = self._remove_all() if is_stopping else []
            num_events = self._num_events
            is_sweep_needed, self._is_sweep_needed = self._is_sweep_needed, False
            num_free = self._limits.max_concurrency - self._num_running
            is_closing = self._is_closing
        if is_stopping:
            _fail_all(leftover, Unavailable("server is shutting down"))
            return False
        now = self._clock()
        is_sweep_needed |= now >= self._next_deadline
        dropped: Dropped = self._sweep(now) if is_sweep_needed else []
        batch: ScheduledBatch | None = None
        hold_until = math.inf
        if num_free > 0 and self._waiting:
            builder, hold_until = self._take_batch(now, is_closing, dropped, num_free)
            if builder is not None:
                batch = _running_batch(builder, dropped)
        if dropped or batch:
            num_launched = 0 if batch is None else batch.num_requests
            with self._cond:
                self._num_pending -= len(dropped) + num_launched
                self._num_running += batch is not None
                self._cond.notify_all()
            for request, error in dropped:
                if error is not None:
                    request.fail(error)
            if batch is not None:
                self._launch_batch(batch)
            return True
        timeout = min(MAX_IDLE_WAIT_S, self._next_deadline - now, hold_until - now)
        with self._cond:
            self._cond.wait_for(lambda: self._num_events != num_events or self._is_stopping,
                                timeout=max(0.0, timeout))
        return True

    def _drop_reason(self, request: ScheduledRequest, now: float) -> object:
        """_KEEP, None (cancelled or answered elsewhere: drop silently) or the error."""
        if request.future.done():
            return None
        if request.deadline is not None and now >= request.deadline:
            return DeadlineExceeded(f"deadline passed {round(1000.0 * (now - request.deadline), 3)}"
                                    f" ms ago, after {now - request.enqueued_at:.3f} s in the "
                                    "waiting queue")
        return _KEEP

    def _sweep(self, now: float) -> Dropped:
        dropped, kept = [], collections.deque()
        self._next_deadline = math.inf
        for request in self._waiting:
            reason = self._drop_reason(request, now)
            if reason is not _KEEP:
                dropped.append((request, reason))
                continue
            kept.append(request)
            if request.deadline is not None:
                self._next_deadline = min(self._next_deadline, request.deadline)
        self._waiting = kept
        return dropped

    def _take_batch(self, now: float, is_closing: bool, dropped: Dropped, num_free: int,
                    ) -> tuple[BatchBuilder | None, float]:
        """Remove the next batch from the head of the waiting queue, built on the current
        catalog; return it (None: no batch) and hold_until.

        With `num_free` pipelines free, the batch takes at most its share of the queue
        (1/num_free of the requests), so a burst is spread over the idle pipelines instead
        of one running it all while the others wait.
        Returns no batch while now < hold_until (a partial batch may wait to fill).
        Dead requests met on the way are removed and appended to `dropped`.
        """
        builder = BatchBuilder(self._limits, self._catalog())
        share = -(-len(self._waiting) // num_free)
        skipped: list[tuple[int, ScheduledRequest]] = []
        num_dropped_before, last_admitted, is_blocked = len(dropped), -1, False
        for position, request in enumerate(self._waiting):
            reason = self._drop_reason(request, now)
            if reason is not _KEEP:
                dropped.append((request, reason))
                continue
            try:
                if builder.try_add(request):
                    last_admitted = position
                    if builder.is_full or len(builder.requests) >= share:
                        break
                    continue
                if not builder.requests:   # admitted on a catalog narrower than this one
                    reason = self._limits.why_too_big(request,
                                                      builder.catalog.batch_bytes([request]))
                    dropped.append((request, ResourceExhausted(
                        f"{reason} on the catalog loaded since it was queued")))
                    continue
            except Exception as exc:  # an estimator bug fails this request only
                dropped.append((request, Internal(f"workspace estimate failed: {exc!r}")))
                continue
            is_blocked = True
            if request._num_overtaken >= self._limits.max_overtakes:
                break  # FIFO: nothing passes this request
            skipped.append((position, request))
        batch, hold_until = builder.requests, math.inf
        if batch and self._limits.batch_wait_ms > 0 and not (
                builder.is_full or is_blocked or is_closing):
            hold_until = batch[0].enqueued_at + self._limits.batch_wait_ms / 1000.0
        is_holding = now < hold_until < math.inf
        removed = {id(request) for request, _ in dropped[num_dropped_before:]}
        if not is_holding:
            removed.update(id(request) for request in batch)
            for position, request in skipped:
                request._num_overtaken += position < last_admitted
        if skipped or is_holding:
            if removed:
                self._waiting = collections.deque(r for r in self._waiting if id(r) not in removed)
        else:  # without skips, what was taken or dropped is a prefix of the queue
            for _ in range(len(removed)):
                self._waiting.popleft()
        return (None if is_holding or not batch else builder), hold_until

    def _launch_batch(self, batch: ScheduledBatch) -> None:
        try:
            self._launch(batch)
        except Exception as exc:  # fail this batch and keep serving
            logger.exception("launch failed for a batch of %d requests", batch.num_requests)
            for request in batch.requests:
                request.fail(Internal(f"launching the batch failed: {exc!r}"))
            self.batch_done()


def _running_batch(builder: BatchBuilder, dropped: Dropped) -> ScheduledBatch | None:
    """The builder's batch without the requests cancelled just now (moved to `dropped`);
    from here the executor owns their answers. None when every request was cancelled."""
    running = []
    for request in builder.requests:
        if request.mark_running():
            running.append(request)
        else:
            dropped.append((request, None))
    if not running:
        return None
    # the workspace estimate stays the whole batch's: an upper bound of what runs
    return ScheduledBatch(tuple(running), builder.catalog, sum(r.num_tokens for r in running),
                          sum(r.beam_width for r in running), builder.workspace_bytes)


def _fail_all(requests: list[ScheduledRequest], error: XrecError) -> None:
    for request in requests:
        request.fail(type(error)(error.message))
