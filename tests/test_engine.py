"""Engine through the real scheduler and executor: concurrent pipelines, faults, deadlines,
cancellation, shutdown. Instrumented with the executor's fault hook, never timed."""

from __future__ import annotations

import gc
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import as_completed, wait

import pytest
import torch

from bounded import waits_in_close
from xrec import (DeadlineExceeded, Engine, Internal, InvalidArgument, RecRequest,
                  ResourceExhausted, Unavailable)
from xrec.demo import write_random_model

# bound on every wait: a broken engine fails the test instead of hanging it (`make mutate`
# sets 2 s: a mutant that loses a request fails in seconds, not at mutmut's timeout)
WAIT_S = float(os.environ.get("XREC_TEST_WAIT_S", 60.0))


@pytest.fixture(autouse=True)
def close_within_wait(monkeypatch):
    """`with Engine(...)` closes with a grace of WAIT_S, not the default 30 s: an engine that
    lost a request (a mutant under `make mutate`) fails the test in WAIT_S, and a correct
    one has nothing left to wait for either way."""
    monkeypatch.setattr(Engine, "__exit__", lambda self, *exc: self.close(grace_s=WAIT_S))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=3, num_items=300)


def _requests(num: int, width: int = 8) -> list[RecRequest]:
    return [RecRequest(token_ids=[(7 * i + j) % 60 for j in range(3 + i % 5)], beam_width=width,
                       request_id=f"r{i}") for i in range(num)]


def in_thread(fn):
    """fn() in a new thread (its own OpenMP state); its result."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    return out[0]


def _answers(engine, requests):
    """engine.recommend(requests), each answer awaited at most WAIT_S."""
    return [future.result(WAIT_S) for future in engine.submit_many(requests)]


def _summary(responses):
    """Tokens exactly; scores to 1e-4 (batch padding changes float rounding, not results)."""
    return [[(c.tokens, pytest.approx(c.score, abs=1e-4)) for c in r.results] for r in responses]


class Gate:
    """Fault hook that holds every batch until `release`, counting batches inside at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.inside = 0
        self.max_inside = 0
        self.both_inside = threading.Event()
        self.release = threading.Event()

    def __call__(self, batch):
        with self.lock:
            self.inside += 1
            self.max_inside = max(self.max_inside, self.inside)
            if self.inside >= 2:
                self.both_inside.set()
        try:
            assert self.release.wait(WAIT_S)
        finally:
            with self.lock:
                self.inside -= 1


def test_two_pipelines_run_two_batches_at_once_with_equal_results(model_dir):
    requests = _requests(6)
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cpu", max_concurrency=1) as engine:
        serial = _summary(_answers(engine, requests))
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu", max_concurrency=2,
                                max_seqs_per_batch=1) as engine:
        gate = Gate()
        engine.executor.fault = gate
        futures = [engine.submit(r) for r in requests]
        assert gate.both_inside.wait(WAIT_S), "two batches never ran at the same time"
        gate.release.set()
        done, _ = wait(futures, timeout=WAIT_S)
        assert len(done) == len(futures)
        assert gate.max_inside == 2  # never more than max_concurrency
        assert _summary([f.result() for f in futures]) == serial


def test_pipeline_threads_leave_other_threads_thread_counts_alone(model_dir):
    """Each of two pipelines runs on half the threads; nothing else in the process does
    (torch.set_num_threads would have made every new thread single-threaded)."""
    seen: list[int] = []
    default = torch.get_num_threads()
    torch.set_num_threads(3)     # not 1 (a worker's count in `make test`): a change shows
    try:
        before = in_thread(torch.get_num_threads)
        with Engine.from_pretrained(model_dir, isolation="thread",
                                    device="cpu", max_concurrency=2, num_threads=2) \
                as engine:
            engine.executor.fault = lambda batch: seen.append(torch.get_num_threads())
            _answers(engine, _requests(2))
            elsewhere = in_thread(torch.get_num_threads)
            fresh_op = in_thread(lambda: (torch.ones(4).add_(1), torch.get_num_threads())[1])
    finally:
        torch.set_num_threads(default)
    assert seen and set(seen) == {1}
    assert elsewhere == fresh_op == before == 3


_PAGES_GIVEN_BACK = """
import sys, torch
from xrec import Engine

def resident() -> int:                # pages
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1])

def given_back() -> int:              # a step's activation over glibc's ceiling, then freed
    block = torch.ones(12 << 20)         # 48 MB
    before = resident()
    del block
    return before - resident()

engine = Engine.from_pretrained(sys.argv[1], isolation="thread",
                                device="cpu", retain_host_memory=sys.argv[2] == "1")
for _ in range(4):
    given_back()
print(*(given_back() for _ in range(5)))
engine.close()
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_cpu_engine_keeps_freed_host_memory_mapped_for_reuse(model_dir):
    """Without it glibc unmaps a freed 48 MB block (it is over its 32 MiB mmap ceiling)
    and the next allocation faults it in afresh, page by page; after a CPU engine starts,
    the freed block stays resident for the next one. Each case in a fresh process:
    malloc's state is process-wide. The measure is the resident pages a free gives back
    (median of five cycles), not the page faults of a cycle: faults also count what the
    kernel does to pages that stay mapped (NUMA balancing marks resident pages to fault
    once more), and on two CI machines a cycle read as many faults as its block's pages
    with the thresholds raised (3,072 for a 12 MB block; 12,288 for this one, as the
    maximum of three cycles), which none of the sessions' machines reproduced."""
    def pages_given_back(retain: bool) -> list[int]:
        out = subprocess.run([sys.executable, "-c", _PAGES_GIVEN_BACK, str(model_dir),
                              "1" if retain else "0"], capture_output=True, text=True,
                             timeout=WAIT_S, check=True)
        return [int(n) for n in out.stdout.split()[-5:]]

    unmapped, retained = pages_given_back(retain=False), pages_given_back(retain=True)
    assert statistics.median(unmapped) > 10_000, unmapped   # 12,288 pages a cycle
    assert statistics.median(retained) < 1000, retained


_IMPORTS_AFTER_A_REQUEST = """
import sys
from xrec import Engine, RecRequest
with Engine.from_pretrained(sys.argv[1], isolation="thread") as engine:
    engine.recommend(RecRequest(token_ids=[1, 2, 3], beam_width=8))
print(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor"))))
"""


@pytest.mark.parametrize("size", ["tiny", "qwen3-sid-tiny"])
def test_an_engine_starts_and_serves_without_the_compiler_stack(tmp_path, size):
    """Loading and serving import neither dynamo nor Inductor: the model is built on the
    `meta` device, and `normal_` there (nn.Embedding's init) imported torch._dynamo, over a
    second of every engine's start (a process-isolated child, a Ray replica, `xrec serve`).
    In a fresh process: this one has imported them already."""
    directory = write_random_model(tmp_path / size, size, seed=0, num_items=50)
    out = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER_A_REQUEST, str(directory)],
                         capture_output=True, text=True, timeout=WAIT_S, check=True)
    assert out.stdout.split("\n")[-2] == "[]", out.stdout


def test_failure_in_one_batch_fails_only_that_batch(model_dir):
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cpu", max_seqs_per_batch=1) as engine:
        def fault(batch):
            if any(r.request_id == "bad" for r in batch.requests):
                raise RuntimeError("injected")
        engine.executor.fault = fault
        bad = engine.submit(RecRequest(token_ids=[1, 2], beam_width=4, request_id="bad"))
        good = engine.submit(RecRequest(token_ids=[1, 2], beam_width=4, request_id="good"))
        with pytest.raises(Internal, match="injected"):
            bad.result(WAIT_S)
        assert good.result(WAIT_S).results
        assert _answers(engine, _requests(2))[1].results  # the pipeline keeps serving


def test_deadline_passes_while_waiting(model_dir):
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cpu", max_seqs_per_batch=1) as engine:
        gate = Gate()
        engine.executor.fault = gate
        blocker = engine.submit(RecRequest(token_ids=[1], beam_width=4))
        late = engine.submit(RecRequest(token_ids=[2], beam_width=4, timeout_ms=1))
        with pytest.raises(DeadlineExceeded) as info:
            late.result(WAIT_S)
        assert info.value.code == "DEADLINE_EXCEEDED"
        gate.release.set()
        assert blocker.result(WAIT_S).results


def test_batch_that_finishes_after_the_deadline_fails_it(model_dir):
    """The executor checks each deadline when the batch is done: a batch that ran past it
    answers DEADLINE_EXCEEDED (on time is up to and including the deadline). The fault hook
    freezes the executor's clock an hour ahead and sets the deadlines around that instant."""
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        frozen: list[float] = []
        engine.executor.clock = lambda: frozen[0] if frozen else time.monotonic()
        offsets = {"late": -0.001, "exact": 0.0}

        def fault(batch):
            if not frozen:
                frozen.append(time.monotonic() + 3600.0)
            for request in batch.requests:
                if request.request_id in offsets:
                    request.deadline = frozen[0] + offsets[request.request_id]
        engine.executor.fault = fault
        futures = {name: engine.submit(RecRequest(token_ids=[1, 2], beam_width=4, request_id=name,
                                                  timeout_ms=None if name == "none" else 60_000))
                   for name in ("late", "exact", "none")}
        with pytest.raises(DeadlineExceeded, match="1.0 ms after its deadline") as info:
            futures["late"].result(WAIT_S)
        assert info.value.request_id == "late"
        assert futures["exact"].result(WAIT_S).results
        assert futures["none"].result(WAIT_S).results


def test_failed_batch_has_failed_its_requests_by_the_time_it_reports(model_dir):
    """Answers come before the batch report: no client waits on a batch that is over."""
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        reports: queue.SimpleQueue = queue.SimpleQueue()
        engine.add_report_hook(reports.put)

        def fault(batch):
            raise RuntimeError("injected")
        engine.executor.fault = fault
        future = engine.submit(RecRequest(token_ids=[1, 2], beam_width=4, request_id="bad"))
        report = reports.get(timeout=WAIT_S)
        assert not report.is_ok and report.num_requests == 1
        assert future.done(), "the batch reported while its request was still unanswered"
        assert isinstance(future.exception(0), Internal)
        assert future.exception(0).request_id == "bad"


def test_a_report_hook_that_raises_stops_neither_the_other_hooks_nor_the_pipeline(model_dir):
    """A raising hook is logged; before, it ended the pipeline's thread and every later
    request waited forever."""
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        reports: queue.SimpleQueue = queue.SimpleQueue()

        def broken(report):
            raise RuntimeError("metrics backend down")
        engine.add_report_hook(broken)
        engine.add_report_hook(reports.put)
        for request in _requests(3):   # one after another: each batch's hooks ran before
            assert engine.submit(request).result(WAIT_S).results
            assert reports.get(timeout=WAIT_S).is_ok
        assert all(thread.is_alive() for thread in engine.executor.threads)


def test_a_pipeline_that_cannot_set_up_fails_its_batches_and_keeps_serving(model_dir):
    """A failure before the batch runs (here the CUDA graphs' pool, made at a pipeline's
    first batch) fails that batch's requests; before, it ended the pipeline's thread with
    the batch it had taken, unanswered."""
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        def no_pool():
            raise RuntimeError("injected: no memory for the graphs' pool")
        engine.executor.make_graphs = no_pool
        futures = engine.submit_many(_requests(2))
        for future in futures:
            with pytest.raises(Internal, match="no memory for the graphs' pool"):
                future.result(WAIT_S)
        engine.executor.make_graphs = None
        assert _answers(engine, _requests(1))[0].results
        assert engine.stats().num_batches_running == 0


def test_close_from_a_done_callback_returns_and_the_engine_closes(model_dir):
    """A done-callback runs on the pipeline that answered; `close` there cannot wait for
    that pipeline's batch to end. Before, it waited its whole grace (here 10 x WAIT_S)."""
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    returned = threading.Event()

    def close_now(future):
        engine.close(grace_s=10 * WAIT_S)
        returned.set()
    future = engine.submit(_requests(1)[0])
    future.add_done_callback(close_now)
    assert future.result(WAIT_S).results
    assert returned.wait(WAIT_S), "close() on the pipeline waited for its own batch"
    for thread in (engine.scheduler.thread, *engine.executor.threads):
        thread.join(WAIT_S)
        assert not thread.is_alive(), thread.name
    with pytest.raises(Unavailable):
        engine.submit(_requests(1)[0])


def close_while_another_close_drains(engine, gate_release: threading.Event, future) -> bool:
    """Close `engine` on two threads: the first drains `future`'s batch, held until
    `gate_release`; the second starts once the first has begun. Whether `future` was
    answered when the second close returned."""
    first = threading.Thread(target=engine.close, args=(WAIT_S,), daemon=True)
    first.start()
    answered_at_return = []
    second = threading.Thread(target=lambda: (engine.close(WAIT_S),
                                              answered_at_return.append(future.done())),
                              daemon=True)
    deadline = time.monotonic() + WAIT_S
    while not waits_in_close(first) and time.monotonic() < deadline:
        time.sleep(0.01)        # the first close waits for the held batch
    second.start()
    while second.is_alive() and not waits_in_close(second) and time.monotonic() < deadline:
        time.sleep(0.01)        # the second returns (before) or waits for the first (now)
    gate_release.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive()
    return answered_at_return[0]


def test_close_while_another_close_drains_returns_once_that_one_has(model_dir):
    """`close()` is idempotent; a second caller's returned at once while the first was
    still draining, with requests unanswered and the threads running (a server's signal
    drain and its exit path both close). It now returns once the first close has ended."""
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    gate = Gate()
    engine.executor.fault = gate
    future = engine.submit(_requests(1)[0])
    assert close_while_another_close_drains(engine, gate.release, future), \
        "the second close() returned before the first had drained"
    assert future.result(0).results
    for thread in (engine.scheduler.thread, *engine.executor.threads):
        assert not thread.is_alive(), thread.name


def test_a_served_batch_reports_its_sizes_and_frees_its_pipeline(model_dir):
    """While a batch runs its pipeline is busy with its workspace estimate; after it, both
    are back to 0 and the report carries its sizes and times (the metrics read these)."""
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        reports: queue.SimpleQueue = queue.SimpleQueue()
        engine.add_report_hook(reports.put)
        gate = Gate()
        engine.executor.fault = gate
        future = engine.submit(RecRequest(token_ids=[1, 2, 3], beam_width=4, request_id="a"))
        give_up = time.monotonic() + WAIT_S
        while gate.inside == 0:
            assert time.monotonic() < give_up, "the batch never started"
            time.sleep(0.001)
        stats = engine.stats()
        assert stats.num_pipelines_busy == 1 and stats.num_batches_running == 1
        assert stats.workspace_bytes_in_use > 0
        gate.release.set()
        assert future.result(WAIT_S).results
        report = reports.get(timeout=WAIT_S)
        assert report.is_ok and (report.num_requests, report.num_beams) == (1, 4)
        assert 0.0 <= report.run_s < WAIT_S
        assert len(report.queue_s) == 1 and 0.0 <= report.queue_s[0] < WAIT_S
        give_up = time.monotonic() + WAIT_S   # the pipeline counts itself free after the report
        while ((stats := engine.stats()).num_pipelines_busy,
               stats.workspace_bytes_in_use) != (0, 0):
            assert time.monotonic() < give_up, stats
            time.sleep(0.001)


def test_recommend_takes_one_request_or_a_sequence(model_dir):
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        one = RecRequest(token_ids=[1, 2, 3], beam_width=4)
        [response] = in_thread(lambda: engine.recommend(one))   # bounded by WAIT_S
        assert _summary([response]) == _summary(in_thread(lambda: engine.recommend([one])))
        with pytest.raises(InvalidArgument, match="sequence of RecRequest, got str"):
            engine.submit_many("not requests")


def test_cancelled_waiting_request_is_dropped(model_dir):
    """A request cancelled while it waits is dropped, and its future notified: `wait` and
    `as_completed` count a cancelled future as done only once its owner calls
    `set_running_or_notify_cancel`. Before, `wait` on it waited its whole timeout and
    `as_completed` for ever, though its `result()` raised CancelledError at once."""
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cpu", max_seqs_per_batch=1) as engine:
        gate = Gate()
        engine.executor.fault = gate
        blocker = engine.submit(RecRequest(token_ids=[1], beam_width=4))
        waiting = engine.submit(RecRequest(token_ids=[2], beam_width=4))
        assert waiting.cancel()
        done, _ = wait([waiting], WAIT_S)
        assert done == {waiting}, "wait() does not see the cancelled request as done"
        assert next(as_completed([waiting], WAIT_S)) is waiting
        gate.release.set()
        assert blocker.result(WAIT_S).results
        assert _answers(engine, _requests(1))[0].results
        assert engine.scheduler.num_waiting == 0


def test_too_big_fails_at_once_while_others_are_served(model_dir):
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cpu", max_tokens_per_batch=16) as engine:
        with pytest.raises(ResourceExhausted, match="max_tokens_per_batch"):
            engine.submit(RecRequest(token_ids=list(range(20)), beam_width=4))
        assert _answers(engine, _requests(3))[2].results


def test_close_drains_queued_requests_then_refuses(model_dir):
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu", max_seqs_per_batch=1)
    futures = [engine.submit(r) for r in _requests(4)]
    engine.close(grace_s=WAIT_S)
    assert all(f.result(0).results for f in futures)
    with pytest.raises(Unavailable):
        engine.submit(RecRequest(token_ids=[1]))


def test_an_engine_in_a_hosts_process_changes_nothing_process_wide(model_dir):
    """Embedded with isolation="thread", the constructor leaves the host's garbage collector
    as it was; `own_process()` (xrec serve, xrec batch, the isolated child) freezes it."""
    before = gc.get_freeze_count()
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        assert gc.get_freeze_count() == before
        try:
            engine.own_process()
            assert gc.get_freeze_count() > before
        finally:
            gc.unfreeze()


def _use_and_drop(model_dir) -> tuple[set[threading.Thread], list]:
    """An in-thread engine that served requests, dropped: (the threads it started, the
    futures of its requests, which the caller keeps)."""
    before = set(threading.enumerate())
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    futures = engine.submit_many(_requests(3))
    wait(futures, timeout=WAIT_S)
    return set(threading.enumerate()) - before, futures


def test_a_used_engine_dropped_ends_its_threads(model_dir):
    """The scheduler's and pipelines' threads and callbacks hold the parts, never the
    engine: dropping it stops them (as close(0) does)."""
    threads, futures = _use_and_drop(model_dir)
    assert all(f.result(0).results for f in futures)
    assert {t.name for t in threads} >= {"xrec-scheduler", "xrec-pipeline-0"}
    gc.collect()
    for thread in threads:
        thread.join(WAIT_S)
    assert not [t.name for t in threads if t.is_alive()]


def test_close_stops_a_running_batch_between_rounds(model_dir):
    """close(grace_s=0) with a batch running: it stops at its next round, its request fails
    UNAVAILABLE, and the pipeline thread has ended when close returns."""
    before = set(threading.enumerate())
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    threads = set(threading.enumerate()) - before
    entered, release = threading.Event(), threading.Event()

    def fault(batch):
        entered.set()
        release.wait(WAIT_S)
    engine.executor.fault = fault
    running = engine.submit(RecRequest(token_ids=[1, 2], beam_width=4))
    assert entered.wait(WAIT_S)
    closer = threading.Thread(target=engine.close, args=(0.0,), daemon=True)
    closer.start()
    deadline = time.monotonic() + WAIT_S
    while not engine.executor.is_stopping and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    closer.join(WAIT_S)
    assert not closer.is_alive() and not [t.name for t in threads if t.is_alive()]
    with pytest.raises(Unavailable, match="stopped before round 1 of 3"):
        running.result(0)
    assert engine.executor.num_rounds_run == 0


def test_stats_say_whether_the_engine_takes_work(model_dir):
    """`stats().is_serving` (a Ray replica's health check reads it): true while open,
    false once closed."""
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    try:
        stats = engine.stats()
        assert stats.is_serving and stats.num_pipelines == 1 and stats.num_requests_waiting == 0
    finally:
        engine.close(WAIT_S)
    assert not engine.stats().is_serving


def test_a_batch_launched_after_close_ended_the_pipelines_is_answered(model_dir):
    """A user's done-callback held up the scheduler's loop (here a request dropped past its
    deadline, failed on the loop, in the step that also launched a batch) past `close(0)`'s
    wait for the loop: `close` ended the pipelines, and the batch launched after that waited
    in a queue no pipeline read, its requests never answered. Now a batch launched once the
    pipelines are ending is answered UNAVAILABLE at once."""
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    late = engine._schedule(engine.validate(RecRequest(token_ids=[1, 2], beam_width=1,
                                                       timeout_ms=1)),
                            False, time.monotonic() - WAIT_S)      # its deadline long passed
    fresh = engine._schedule(engine.validate(RecRequest(token_ids=[3, 4], beam_width=1)), False,
                             time.monotonic())
    on_loop, closed = threading.Event(), threading.Event()

    def held_up(future):       # on the loop, between the drop and the launch
        on_loop.set()
        closed.wait(WAIT_S)
    late.future.add_done_callback(held_up)
    engine.scheduler.submit_many([late, fresh])
    assert on_loop.wait(WAIT_S)
    engine.close(0.0)
    closed.set()
    assert isinstance(late.future.exception(WAIT_S), DeadlineExceeded)
    assert isinstance(fresh.future.exception(WAIT_S), Unavailable)
    engine.scheduler.thread.join(WAIT_S)
    assert engine.stats().num_batches_running == 0
