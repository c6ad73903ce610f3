"""FixedStepsScheduler: budgets, FIFO, in-flight limit, deadlines, cancellation, shutdown.

The executor here is a fake that runs batches on real worker threads. Tests hold
batches with an Event and use a fake clock for deadlines; none asserts wall time.
"""

from __future__ import annotations

import queue
import random
import os
import re
import threading
import time
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xrec.engine.scheduler import BatchLimits, FixedStepsScheduler, ScheduledRequest
from xrec.engine.requests import BatchBuilder, BatchReport
from xrec.errors import (DeadlineExceeded, Internal, ResourceExhausted, Unavailable,
                         XrecError)

# upper bound on any wait; a correct scheduler finishes long before (`make mutate` sets 2 s:
# a mutant that loses a request or hangs close() fails in seconds, not at mutmut's timeout)
WAIT_S = float(os.environ.get("XREC_TEST_WAIT_S", 5.0))


def workspace_bytes(batch):
    """Fake workspace estimate: grows with every request, like a catalog's."""
    return sum(request.num_tokens * request.beam_width for request in batch)


class FakeCatalog:
    """The catalog batches run on, as the scheduler sees it: a workspace estimate."""

    def batch_bytes(self, batch):
        return workspace_bytes(batch)


CATALOG = FakeCatalog()


def make_limits(**overrides) -> BatchLimits:
    values = dict(max_seqs_per_batch=4, max_tokens_per_batch=100, max_beams_per_batch=16,
                  max_workspace_bytes=10_000, max_concurrency=1, request_queue_size=64)
    values.update(overrides)
    return BatchLimits(**values)


def make_request(request_id, num_tokens=1, beam_width=1, deadline=None, future=None):
    extra = {"future": future} if future is not None else {}
    return ScheduledRequest(request_id, num_tokens, beam_width, num_results=beam_width,
                            request=None, deadline=deadline, **extra)


def eventually(predicate) -> None:
    """Wait for state that only the scheduler's own thread changes (bounded)."""
    give_up = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < give_up, "condition not reached"
        time.sleep(0.001)


def close_within(scheduler, grace_s: float | None = None) -> None:
    """scheduler.close(grace_s), bounded: a close() that never returns fails the test
    after WAIT_S more than its grace instead of hanging it."""
    kwargs = {} if grace_s is None else {"grace_s": grace_s}
    closer = threading.Thread(target=scheduler.close, kwargs=kwargs, daemon=True)
    closer.start()
    closer.join((grace_s or 0.0) + WAIT_S)
    assert not closer.is_alive(), "close() did not return"


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingFuture(Future):
    """A Future that counts the answers that took effect (result, exception, cancel)."""

    def __init__(self):
        super().__init__()
        self._count_lock = threading.Lock()
        self.num_answers = 0

    def _count(self):
        with self._count_lock:
            self.num_answers += 1

    def set_result(self, result):
        super().set_result(result)  # raises InvalidStateError when already done
        self._count()

    def set_exception(self, exception):
        super().set_exception(exception)
        self._count()

    def cancel(self):
        was_done = self.done()
        is_cancelled = super().cancel()
        if is_cancelled and not was_done:
            self._count()
        return is_cancelled


class FakeExecutor:
    """Runs launched batches on a pool of worker threads and reports each through finish().

    A request is answered with its request_id, or the whole batch fails with Internal
    when one of its ids starts with "fail". While `gate` is clear, batches are held.
    """

    def __init__(self, num_workers: int = 4, clock=time.monotonic):
        self.scheduler: FixedStepsScheduler | None = None
        self.clock = clock   # the scheduler's: a batch finishes "now" on its time base
        self.gate = threading.Event()
        self.gate.set()
        self.cond = threading.Condition()
        self.batches: list[list[ScheduledRequest]] = []  # in launch order
        self.num_in_flight = 0
        self.max_in_flight = 0
        self._batch_queue: queue.Queue = queue.Queue()
        self._workers = [threading.Thread(target=self._work, daemon=True)
                         for _ in range(num_workers)]
        for worker in self._workers:
            worker.start()

    def launch(self, batch):
        """The fake computes a batch in no time: its answers are ready at launch (the
        scheduler's clock then); `gate` only holds their delivery."""
        with self.cond:
            self.batches.append(list(batch.requests))
            self.num_in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
            self.cond.notify_all()
        self._batch_queue.put((batch, self.clock()))

    def _work(self):
        while (item := self._batch_queue.get()) is not None:
            batch, finished_at = item
            self.gate.wait()
            ids = tuple(request.request_id for request in batch.requests)
            is_failed = any(request_id.startswith("fail") for request_id in ids)
            report = BatchReport(len(ids), batch.num_beams, 0.0, (0.0,) * len(ids),
                                 finished_at, () if is_failed else ids,
                                 Internal("injected executor failure") if is_failed else None)
            with self.cond:  # before finish(): the scheduler may launch at once
                self.num_in_flight -= 1
                self.cond.notify_all()
            self.scheduler.finish(batch, report)

    def wait_until(self, predicate) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout=WAIT_S)

    def launched_ids(self) -> list[str]:
        with self.cond:
            return [request.request_id for batch in self.batches for request in batch]

    def shutdown(self) -> None:
        self.gate.set()
        for _ in self._workers:
            self._batch_queue.put(None)
        for worker in self._workers:
            worker.join(WAIT_S)


@pytest.fixture
def make_scheduler():
    made = []

    def make(limits, *, launch=None, clock=time.monotonic, is_started=True):
        executor = FakeExecutor(clock=clock)
        scheduler = FixedStepsScheduler(limits, launch or executor.launch, lambda: CATALOG, clock)
        executor.scheduler = scheduler
        made.append((scheduler, executor))
        if is_started:
            scheduler.start()
        return scheduler, executor

    yield make
    for scheduler, executor in made:
        executor.gate.set()
        try:
            close_within(scheduler, WAIT_S)
        finally:
            executor.shutdown()


def assert_within_budgets(batch, limits):
    assert 1 <= len(batch) <= limits.max_seqs_per_batch
    assert sum(r.num_tokens for r in batch) <= limits.max_tokens_per_batch
    assert sum(r.beam_width for r in batch) <= limits.max_beams_per_batch
    assert workspace_bytes(batch) <= limits.max_workspace_bytes


@pytest.mark.parametrize("name, value", [
    ("max_seqs_per_batch", 0), ("max_tokens_per_batch", True), ("max_concurrency", -1),
    ("request_queue_size", 1.5), ("max_overtakes", -1), ("batch_wait_ms", float("nan")),
    ("batch_wait_ms", True)])
def test_limits_are_validated(name, value):
    with pytest.raises(ValueError, match=f"{name}: got {re.escape(repr(value))}"):
        make_limits(**{name: value})


def test_request_sizes_are_validated():
    with pytest.raises(ValueError, match="num_tokens: got -1"):
        make_request("r", num_tokens=-1)
    with pytest.raises(ValueError, match="beam_width: got 0"):
        make_request("r", beam_width=0)


def test_batches_respect_every_budget_and_fifo_order(make_scheduler):
    limits = make_limits(max_seqs_per_batch=3, max_tokens_per_batch=20, max_beams_per_batch=8,
                         max_workspace_bytes=60, max_concurrency=2)
    scheduler, executor = make_scheduler(limits, is_started=False)
    rng = random.Random(0)
    requests = [make_request(f"r{i}", rng.randint(0, 10), rng.randint(1, 6)) for i in range(60)]
    for request in requests:
        scheduler.submit(request)
    scheduler.start()
    assert [r.future.result(WAIT_S) for r in requests] == [r.request_id for r in requests]
    for batch in executor.batches:
        assert_within_budgets(batch, limits)
    assert executor.launched_ids() == [r.request_id for r in requests]
    assert max(len(batch) for batch in executor.batches) > 1


def test_launch_order_is_fifo_with_concurrent_pipelines(make_scheduler):
    scheduler, executor = make_scheduler(make_limits(max_seqs_per_batch=2, max_concurrency=3))
    requests = [make_request(f"r{i}", num_tokens=i % 7) for i in range(40)]
    for request in requests:
        scheduler.submit(request)
    for request in requests:
        assert request.future.result(WAIT_S) == request.request_id
    assert executor.launched_ids() == [r.request_id for r in requests]


@pytest.mark.parametrize("max_overtakes, expected", [
    (0, [["X"], ["W"], ["Y", "Z"], ["V", "U"]]),
    (1, [["X", "Z", "V"], ["W"], ["Y", "U"]]),
    (2, [["X", "Z", "V"], ["W", "U"], ["Y"]]),
])
def test_overtaking_is_bounded(make_scheduler, max_overtakes, expected):
    limits = make_limits(max_seqs_per_batch=3, max_tokens_per_batch=10,
                         max_overtakes=max_overtakes)
    scheduler, executor = make_scheduler(limits, is_started=False)
    sizes = {"X": 4, "W": 8, "Y": 8, "Z": 2, "V": 2, "U": 2}
    requests = [make_request(name, num_tokens) for name, num_tokens in sizes.items()]
    for request in requests:
        scheduler.submit(request)
    scheduler.start()
    for request in requests:
        assert request.future.result(WAIT_S) == request.request_id
    assert [[r.request_id for r in batch] for batch in executor.batches] == expected


@pytest.mark.parametrize("num_tokens, beam_width, message", [
    (101, 1, "needs 101 tokens; max_tokens_per_batch=100"),
    (1, 17, "needs beam_width=17; max_beams_per_batch=16"),
    (50, 16, "needs 800 workspace bytes; max_workspace_bytes=500"),
])
def test_request_too_big_for_an_empty_pipeline_fails_at_once(
        make_scheduler, num_tokens, beam_width, message):
    scheduler, executor = make_scheduler(make_limits(max_workspace_bytes=500))
    before, after = make_request("before", 10), make_request("after", 10)
    too_big = make_request("too-big", num_tokens, beam_width)
    scheduler.submit(before)
    with pytest.raises(ResourceExhausted, match=re.escape(message)):
        scheduler.submit(too_big)
    assert isinstance(too_big.future.exception(0), ResourceExhausted)
    assert too_big.future.exception(0).request_id == "too-big"
    scheduler.submit(after)
    assert before.future.result(WAIT_S) == "before"
    assert after.future.result(WAIT_S) == "after"
    assert "too-big" not in executor.launched_ids()


class ScaledCatalog:
    """A catalog whose workspace estimate is `scale` times FakeCatalog's (a wider one)."""

    def __init__(self, scale: int):
        self.scale = scale

    def batch_bytes(self, batch):
        return self.scale * workspace_bytes(batch)


def test_request_a_newer_catalog_makes_too_big_fails_instead_of_blocking_the_queue():
    """A request admitted on one catalog that no longer fits an empty batch on the catalog
    loaded while it waited fails with the reason; the requests behind it run (before the
    fix it stayed at the head of the queue and nothing behind it ever launched)."""
    current = [ScaledCatalog(1)]
    executor = FakeExecutor()
    scheduler = FixedStepsScheduler(make_limits(max_workspace_bytes=500), executor.launch,
                                    lambda: current[0])
    executor.scheduler = scheduler
    scheduler.start()
    try:
        executor.gate.clear()
        first = make_request("first", 10)
        scheduler.submit(first)
        executor.wait_until(lambda: executor.num_in_flight == 1)
        wide = make_request("wide", 20, 16)      # 320 bytes here, 960 on the wider catalog
        scheduler.submit(wide)
        current[0] = ScaledCatalog(3)            # a catalog load while `wide` waits
        small = make_request("small", 1)
        scheduler.submit(small)
        executor.gate.set()
        with pytest.raises(ResourceExhausted, match=re.escape(
                "needs 960 workspace bytes; max_workspace_bytes=500 on the catalog loaded")):
            wide.future.result(WAIT_S)
        assert first.future.result(WAIT_S) == "first"
        assert small.future.result(WAIT_S) == "small"
        assert "wide" not in executor.launched_ids()
    finally:
        executor.gate.set()
        close_within(scheduler, WAIT_S)
        executor.shutdown()


def test_request_that_only_has_to_wait_is_never_failed(make_scheduler):
    scheduler, executor = make_scheduler(make_limits(max_tokens_per_batch=10))
    executor.gate.clear()
    first = make_request("first", num_tokens=10)  # holds the whole token budget
    scheduler.submit(first)
    executor.wait_until(lambda: executor.num_in_flight == 1)
    waiting = [make_request(f"w{i}", num_tokens=10) for i in range(3)]
    for request in waiting:
        scheduler.submit(request)
    assert scheduler.num_waiting == 3
    assert not any(request.future.done() for request in waiting)
    executor.gate.set()
    for request in [first, *waiting]:
        assert request.future.result(WAIT_S) == request.request_id


def test_a_burst_is_spread_over_the_free_pipelines(make_scheduler):
    limits = make_limits(max_seqs_per_batch=8, max_concurrency=3)
    scheduler, executor = make_scheduler(limits, is_started=False)
    executor.gate.clear()                       # launched batches stay in flight
    requests = [make_request(f"r{i}") for i in range(7)]
    scheduler.submit_many(requests)
    scheduler.start()
    executor.wait_until(lambda: len(executor.batches) == 3)
    executor.gate.set()
    for request in requests:
        assert request.future.result(WAIT_S) == request.request_id
    assert [len(batch) for batch in executor.batches] == [3, 2, 2]   # 7/3, then 4/2, 2/1
    assert executor.launched_ids() == [r.request_id for r in requests]


def test_at_most_max_concurrency_batches_in_flight(make_scheduler):
    scheduler, executor = make_scheduler(make_limits(max_seqs_per_batch=1, max_concurrency=2))
    executor.gate.clear()
    requests = [make_request(f"r{i}") for i in range(10)]
    for request in requests:
        scheduler.submit(request)
    executor.wait_until(lambda: executor.num_in_flight == 2)
    assert scheduler.num_running_batches == 2
    assert scheduler.num_waiting == 8
    executor.gate.set()
    for request in requests:
        assert request.future.result(WAIT_S) == request.request_id
    assert executor.max_in_flight == 2
    eventually(lambda: scheduler.num_running_batches == 0)


def test_deadline_passing_while_waiting_fails_with_deadline_exceeded(make_scheduler):
    clock = FakeClock()
    scheduler, executor = make_scheduler(make_limits(max_seqs_per_batch=1), clock=clock)
    executor.gate.clear()
    running = make_request("running", deadline=10.0)
    scheduler.submit(running)
    executor.wait_until(lambda: executor.num_in_flight == 1)
    expiring = make_request("expiring", deadline=10.0)
    patient = make_request("patient", deadline=None)
    scheduler.submit(expiring)
    scheduler.submit(patient)
    clock.now = 11.0  # the loop notices within its bounded wait
    error = expiring.future.exception(WAIT_S)
    assert isinstance(error, DeadlineExceeded) and error.request_id == "expiring"
    assert scheduler.num_waiting == 1 and not patient.future.done()
    executor.gate.set()
    assert running.future.result(WAIT_S) == "running"  # the executor owns launched ones
    assert patient.future.result(WAIT_S) == "patient"
    assert "expiring" not in executor.launched_ids()


def launched_batch(make_scheduler, requests):
    """Submit `requests` (one batch's worth) and return the scheduler and the batch it
    launched; nothing runs it: the test reports it through finish()."""
    launched: queue.SimpleQueue = queue.SimpleQueue()
    scheduler, _ = make_scheduler(make_limits(), launch=launched.put, clock=FakeClock(),
                                  is_started=False)
    scheduler.submit_many(requests)
    scheduler.start()
    return scheduler, launched.get(timeout=WAIT_S)


@pytest.mark.parametrize("finished_at, is_late", [(10.0, False), (10.001, True)],
                         ids=["at-the-deadline", "past-it"])
def test_a_batch_that_finished_past_a_deadline_answers_deadline_exceeded(make_scheduler,
                                                                         finished_at, is_late):
    """finish() answers from the batch's report: on time is up to and including the
    deadline; the slot is freed whatever the answers."""
    request, other = make_request("timed", deadline=10.0), make_request("untimed")
    scheduler, batch = launched_batch(make_scheduler, [request, other])
    assert batch.requests == (request, other)
    scheduler.finish(batch, BatchReport(2, 2, 0.5, (0.0, 0.0), finished_at, ("a", "b")))
    if is_late:
        error = request.future.exception(0)
        assert isinstance(error, DeadlineExceeded) and "1.0 ms after its deadline" in str(error)
        assert error.request_id == "timed"
    else:
        assert request.future.result(0) == "a"
    assert other.future.result(0) == "b"
    assert scheduler.num_running_batches == 0


def test_a_failed_batch_fails_each_request_with_its_own_error(make_scheduler):
    requests = [make_request("x"), make_request("y")]
    scheduler, batch = launched_batch(make_scheduler, requests)
    scheduler.finish(batch, BatchReport(2, 2, 0.1, (0.0, 0.0), 0.0,
                                        error=Internal("batch failed: boom")))
    errors = [r.future.exception(0) for r in requests]
    assert [type(e) for e in errors] == [Internal, Internal] and errors[0] is not errors[1]
    assert [e.request_id for e in errors] == ["x", "y"]
    assert all("boom" in str(e) for e in errors)
    assert scheduler.num_running_batches == 0


@pytest.mark.parametrize("deadline, alive_deadline", [(1.0, 9.0), (5.0, 5.5)],
                         ids=["already-expired", "deadline-is-now"])
def test_request_at_or_past_its_deadline_is_never_launched(make_scheduler, deadline,
                                                            alive_deadline):
    clock = FakeClock(now=5.0)
    scheduler, executor = make_scheduler(make_limits(), clock=clock, is_started=False)
    expired = make_request("expired", deadline=deadline)
    alive = make_request("alive", deadline=alive_deadline)
    scheduler.submit(expired)
    scheduler.submit(alive)
    scheduler.start()
    assert isinstance(expired.future.exception(WAIT_S), DeadlineExceeded)
    assert alive.future.result(WAIT_S) == "alive"
    assert executor.launched_ids() == ["alive"]


def test_deadline_reached_exactly_while_waiting_fails_it(make_scheduler):
    """A waiting request is dead AT its deadline (it cannot be answered by then): the loop
    wakes for the earliest deadline and drops it at now == deadline, not later."""
    clock = FakeClock()
    scheduler, executor = make_scheduler(make_limits(max_seqs_per_batch=1), clock=clock)
    executor.gate.clear()
    running = make_request("running")
    scheduler.submit(running)
    executor.wait_until(lambda: executor.num_in_flight == 1)
    expiring = make_request("expiring", deadline=10.0)
    scheduler.submit(expiring)
    eventually(lambda: scheduler.num_waiting == 1)
    clock.now = 10.0
    assert isinstance(expiring.future.exception(WAIT_S), DeadlineExceeded)
    executor.gate.set()
    assert running.future.result(WAIT_S) == "running"
    assert executor.launched_ids() == ["running"]


def test_after_a_drop_the_next_deadline_is_the_earliest_left(make_scheduler):
    """A sweep that drops one request recomputes the next deadline from those it keeps."""
    clock = FakeClock()
    scheduler, executor = make_scheduler(make_limits(max_seqs_per_batch=1), clock=clock)
    executor.gate.clear()
    running = make_request("running")
    scheduler.submit(running)
    executor.wait_until(lambda: executor.num_in_flight == 1)
    first, second = make_request("first", deadline=10.0), make_request("second", deadline=20.0)
    scheduler.submit(first)
    scheduler.submit(second)
    eventually(lambda: scheduler.num_waiting == 2)
    clock.now = 10.0
    assert isinstance(first.future.exception(WAIT_S), DeadlineExceeded)
    assert not second.future.done()
    clock.now = 20.0
    assert isinstance(second.future.exception(WAIT_S), DeadlineExceeded)
    executor.gate.set()
    assert running.future.result(WAIT_S) == "running"


def test_a_request_is_answered_once_and_says_whether_it_was():
    request = make_request("r")
    assert request.fail(Internal("first")) is True
    assert request.fail(Internal("second")) is False
    assert request.answer("late") is False
    assert "first" in str(request.future.exception(0))
    assert request.future.exception(0).request_id == "r"
    other = make_request("o")
    assert other.fail(RuntimeError("not an XrecError")) is True   # no request_id to set
    assert isinstance(other.future.exception(0), RuntimeError)
    tagged = Internal("already tagged")
    tagged.request_id = "elsewhere"
    third = make_request("t")
    assert third.fail(tagged) and third.future.exception(0).request_id == "elsewhere"
    answered = make_request("a")
    assert answered.answer(1) is True and answered.answer(2) is False
    assert answered.fail(Internal("x")) is False and answered.future.result(0) == 1



@pytest.mark.parametrize("num_tokens, beam_width, num_bytes", [
    (100, 1, 100), (1, 16, 16), (10, 10, 100)])
def test_a_request_that_fills_a_budget_exactly_fits_an_empty_batch(num_tokens, beam_width,
                                                                     num_bytes):
    """Budgets are inclusive: max_tokens_per_batch=100 admits a 100-token request."""
    limits = make_limits(max_tokens_per_batch=100, max_beams_per_batch=16, max_workspace_bytes=100)
    request = make_request("exact", num_tokens, beam_width)
    assert workspace_bytes([request]) == num_bytes
    assert limits.why_too_big(request, num_bytes) is None
    builder = BatchBuilder(limits, CATALOG)
    assert builder.try_add(request)
    assert (builder.num_tokens, builder.num_beams) == (num_tokens, beam_width)
    one_more = make_request("one-more", num_tokens + 1, beam_width + 1)
    assert limits.why_too_big(one_more, num_bytes + 1) is not None


@pytest.mark.parametrize("budget", ["tokens", "beams", "bytes", "seqs"])
def test_requests_that_sum_to_a_budget_exactly_share_a_batch(budget):
    limits = make_limits(max_seqs_per_batch=4, max_tokens_per_batch=100, max_beams_per_batch=16,
                         max_workspace_bytes=10_000)
    sizes = {"tokens": [(60, 1), (40, 1), (1, 1)], "beams": [(1, 10), (1, 6), (1, 1)],
             "bytes": [(10, 3), (10, 3), (1, 1)], "seqs": [(1, 1)] * 5}[budget]
    if budget == "bytes":  # 30 + 30 workspace bytes: exactly the budget
        limits = make_limits(max_workspace_bytes=60)
    builder = BatchBuilder(limits, CATALOG)
    requests = [make_request(f"r{i}", *size) for i, size in enumerate(sizes)]
    added = [builder.try_add(request) for request in requests]
    assert added == [True] * (len(sizes) - 1) + [False]
    assert builder.requests == requests[:-1]
    assert (builder.num_tokens, builder.num_beams) == (
        sum(r.num_tokens for r in requests[:-1]), sum(r.beam_width for r in requests[:-1]))


def test_a_batch_that_fills_the_beam_budget_exactly_is_launched_whole(make_scheduler):
    limits = make_limits(max_beams_per_batch=8)
    scheduler, executor = make_scheduler(limits, is_started=False)
    requests = [make_request("a", beam_width=8), make_request("b", beam_width=5),
                make_request("c", beam_width=3)]
    for request in requests:
        scheduler.submit(request)
    scheduler.start()
    assert [r.future.result(WAIT_S) for r in requests] == ["a", "b", "c"]
    assert [[r.request_id for r in batch] for batch in executor.batches] == [["a"], ["b", "c"]]


def test_cancelled_waiting_request_is_dropped_and_never_launched(make_scheduler):
    scheduler, executor = make_scheduler(make_limits(max_seqs_per_batch=1))
    executor.gate.clear()
    running, cancelled, later = (make_request(name) for name in ("running", "cancelled", "later"))
    scheduler.submit(running)
    executor.wait_until(lambda: executor.num_in_flight == 1)
    scheduler.submit(cancelled)
    assert cancelled.future.cancel()
    assert not running.future.cancel()  # launched: the executor owns its answer
    eventually(lambda: scheduler.num_waiting == 0)  # its queue slot is freed
    scheduler.submit(later)
    executor.gate.set()
    assert running.future.result(WAIT_S) == "running"
    assert later.future.result(WAIT_S) == "later"
    assert executor.launched_ids() == ["running", "later"]


def test_launch_raising_fails_that_batch_and_the_next_batch_runs(make_scheduler):
    calls = []

    def launch(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("boom")
        executor.launch(batch)

    limits = make_limits(max_seqs_per_batch=2)
    scheduler, executor = make_scheduler(limits, launch=launch, is_started=False)
    requests = [make_request(name) for name in "ABCD"]
    for request in requests:
        scheduler.submit(request)
    scheduler.start()
    for request in requests[:2]:
        error = request.future.exception(WAIT_S)
        assert isinstance(error, Internal) and "boom" in str(error)
    for request in requests[2:]:
        assert request.future.result(WAIT_S) == request.request_id
    eventually(lambda: scheduler.num_running_batches == 0)


def test_full_request_queue_raises_resource_exhausted(make_scheduler):
    scheduler, executor = make_scheduler(make_limits(request_queue_size=2), is_started=False)
    queued = [make_request("a"), make_request("b")]
    for request in queued:
        scheduler.submit(request)
    refused = make_request("c")
    with pytest.raises(ResourceExhausted, match="request_queue_size=2"):
        scheduler.submit(refused)
    assert isinstance(refused.future.exception(0), ResourceExhausted)
    scheduler.start()
    for request in queued:
        assert request.future.result(WAIT_S) == request.request_id
    again = make_request("again")
    scheduler.submit(again)
    assert again.future.result(WAIT_S) == "again"


def test_submitting_the_same_request_twice_is_refused(make_scheduler):
    scheduler, _ = make_scheduler(make_limits(), is_started=False)
    request = make_request("r")
    scheduler.submit(request)
    with pytest.raises(ValueError, match="already submitted"):
        scheduler.submit(request)


def test_batch_wait_holds_a_partial_batch_until_it_fills_or_times_out(make_scheduler):
    clock = FakeClock()
    limits = make_limits(max_seqs_per_batch=3, batch_wait_ms=1000.0)
    scheduler, executor = make_scheduler(limits, clock=clock)
    first = [make_request("a"), make_request("b")]
    for request in first:
        scheduler.submit(request)
    assert executor.launched_ids() == []
    clock.now = 1.0  # exactly the oldest request's wait: the partial batch goes
    for request in first:
        assert request.future.result(WAIT_S) == request.request_id
    full = [make_request(name) for name in "cde"]
    for request in full:
        scheduler.submit(request)
    for request in full:  # a full batch goes at once, without the clock moving
        assert request.future.result(WAIT_S) == request.request_id
    assert [[r.request_id for r in batch] for batch in executor.batches] == [
        ["a", "b"], ["c", "d", "e"]]


def test_submissions_while_wakeups_are_held_wake_the_loop_once_at_release(make_scheduler):
    """An HTTP burst accepted one request at a time wakes the loop once, so it is not
    split into a first request alone and the rest (white-box: the loop's event count)."""
    scheduler, executor = make_scheduler(make_limits(max_seqs_per_batch=8), is_started=False)
    scheduler.hold_wakeups()
    scheduler.hold_wakeups()                 # holds nest
    events = scheduler._num_events
    requests = [make_request(name) for name in "abc"]
    for request in requests:                 # one at a time, as HTTP handlers submit
        scheduler.submit(request)
    scheduler.release_wakeups()
    assert scheduler._num_events == events   # still held: no wake-up yet
    scheduler.release_wakeups()
    assert scheduler._num_events == events + 1
    scheduler.start()
    for request in requests:
        assert request.future.result(WAIT_S) == request.request_id
    assert [[r.request_id for r in batch] for batch in executor.batches] == [["a", "b", "c"]]
    with pytest.raises(RuntimeError, match="without hold_wakeups"):
        scheduler.release_wakeups()


def test_close_drains_queued_and_running_requests(make_scheduler):
    scheduler, executor = make_scheduler(make_limits(max_seqs_per_batch=1))
    executor.gate.clear()
    requests = [make_request(f"r{i}") for i in range(4)]
    for request in requests:
        scheduler.submit(request)
    executor.wait_until(lambda: executor.num_in_flight == 1)
    closer = threading.Thread(target=scheduler.close, kwargs={"grace_s": WAIT_S})
    closer.start()
    executor.gate.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert [r.future.result(0) for r in requests] == [r.request_id for r in requests]
    assert scheduler.num_waiting == 0 and scheduler.num_running_batches == 0


def test_close_answers_what_is_left_after_the_grace_period_unavailable(make_scheduler):
    scheduler, executor = make_scheduler(make_limits(max_seqs_per_batch=1))
    executor.gate.clear()
    running, left = make_request("running"), [make_request("x"), make_request("y")]
    scheduler.submit(running)
    executor.wait_until(lambda: executor.num_in_flight == 1)
    for request in left:
        scheduler.submit(request)
    close_within(scheduler, grace_s=0.05)
    for request in left:
        error = request.future.exception(0)
        assert isinstance(error, Unavailable) and "shutting down" in str(error)
    assert not running.future.done()  # still the executor's to answer
    late = make_request("late")
    with pytest.raises(Unavailable):
        scheduler.submit(late)
    assert isinstance(late.future.exception(0), Unavailable)
    close_within(scheduler)  # idempotent
    executor.gate.set()
    assert running.future.result(WAIT_S) == "running"
    assert executor.launched_ids() == ["running"]


def test_close_with_nothing_left_does_not_wait_out_its_grace(make_scheduler):
    """close() returns as soon as nothing is queued or running, not after grace_s."""
    scheduler, executor = make_scheduler(make_limits())
    request = make_request("done")
    scheduler.submit(request)
    assert request.future.result(WAIT_S) == "done"
    eventually(lambda: scheduler.num_running_batches == 0)
    closer = threading.Thread(target=scheduler.close, kwargs={"grace_s": 100 * WAIT_S}, daemon=True)
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive(), "close() waited for a batch that had already finished"
    assert not scheduler._thread.is_alive(), "the loop thread outlived close()"


def test_close_before_start_answers_queued_requests(make_scheduler):
    scheduler, _ = make_scheduler(make_limits(), is_started=False)
    request = make_request("r")
    scheduler.submit(request)
    close_within(scheduler)
    assert isinstance(request.future.exception(0), Unavailable)
    assert str(request.future.exception(0)) == "server is shutting down"
    with pytest.raises(RuntimeError):
        scheduler.start()


KINDS = ("ok", "ok", "ok", "cancel", "fail", "launchfail")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.sampled_from(KINDS)),
                      min_size=1, max_size=40),
       max_concurrency=st.integers(1, 3), max_seqs=st.integers(1, 4),
       max_overtakes=st.integers(0, 2), queue_size=st.integers(4, 40),
       num_threads=st.integers(1, 4), is_closed_early=st.booleans(),
       grace_s=st.sampled_from([0.0, WAIT_S]))
def test_every_request_is_answered_exactly_once(specs, max_concurrency, max_seqs, max_overtakes,
                                                queue_size, num_threads, is_closed_early,
                                                grace_s):
    limits = BatchLimits(max_seqs_per_batch=max_seqs, max_tokens_per_batch=30,
                         max_beams_per_batch=10, max_workspace_bytes=200,
                         max_concurrency=max_concurrency, request_queue_size=queue_size,
                         max_overtakes=max_overtakes)
    executor = FakeExecutor(num_workers=4)
    attempted: list[str] = []  # every request handed to launch(), raising or not

    def launch(batch):
        attempted.extend(request.request_id for request in batch.requests)  # only the loop
        if any(request.request_id.startswith("launchfail") for request in batch.requests):
            raise RuntimeError("injected launch failure")
        executor.launch(batch)

    scheduler = FixedStepsScheduler(limits, launch, lambda: CATALOG)
    executor.scheduler = scheduler
    requests = [make_request(f"{kind}-{i}", num_tokens, beam_width, future=CountingFuture())
                for i, (num_tokens, beam_width, kind) in enumerate(specs)]
    refused: dict[str, XrecError] = {}
    barrier = threading.Barrier(num_threads + 1)

    def submit_share(share):
        barrier.wait()
        for request in share:
            try:
                scheduler.submit(request)
            except XrecError as exc:
                refused[request.request_id] = exc
        for request in reversed(share):
            if request.request_id.startswith("cancel"):
                request.future.cancel()

    submitters = [threading.Thread(target=submit_share, args=(requests[k::num_threads],))
                  for k in range(num_threads)]
    for thread in submitters:
        thread.start()
    scheduler.start()
    barrier.wait()
    if is_closed_early:
        close_within(scheduler, grace_s)
    for thread in submitters:
        thread.join(WAIT_S)
    close_within(scheduler, grace_s)
    executor.shutdown()  # runs what was launched to the end

    launched = executor.launched_ids()
    assert len(attempted) == len(set(attempted)) and set(launched) <= set(attempted)
    assert executor.max_in_flight <= max_concurrency
    for batch in executor.batches:
        assert_within_budgets(batch, limits)
    for request in requests:
        future = request.future
        assert future.done() and future.num_answers == 1, request
        is_too_big = (request.num_tokens > 30 or request.beam_width > 10
                      or workspace_bytes([request]) > 200)
        if is_too_big:  # refused at once; after close() began, Unavailable comes first
            assert isinstance(refused[request.request_id], (ResourceExhausted, Unavailable))
        if request.request_id in refused:
            assert future.exception(0) is refused[request.request_id]
            assert request.request_id not in attempted
        elif request.request_id in attempted:  # running: cancel() could not win any more
            if future.exception(0) is not None:
                assert isinstance(future.exception(0), Internal)
            else:
                assert future.result(0) == request.request_id
        elif not future.cancelled():
            assert isinstance(future.exception(0), Unavailable)
            assert grace_s == 0.0
    assert scheduler.num_waiting == 0 and scheduler.num_running_batches == 0


def test_is_running_from_start_to_close(make_scheduler):
    scheduler, _ = make_scheduler(make_limits(), is_started=False)
    assert not scheduler.is_running
    scheduler.start()
    assert scheduler.is_running
    close_within(scheduler)
    assert not scheduler.is_running
