"""Executor: `max_concurrency` pipelines, each a worker thread (+ a CUDA stream on a GPU).

A launched `ScheduledBatch` runs start to finish on one pipeline: host preparation,
the whole R-round `RecStep` on the pipeline's stream, one copy back, item
conversion; its `BatchReport` (each request's answer, or the error that failed
the batch) goes back through one call, `on_done(batch, report)`. Pipelines share one
model and take no lock from each other; a batch runs on the catalog
(`ServedCatalog`: tables and items, read-only) it was scheduled on, even when the
engine swaps catalogs meanwhile. A failure inside a batch fails that batch only;
the pipeline goes on serving.

Between rounds (never inside one) a batch stops when every request in it has passed
its deadline (DEADLINE_EXCEEDED) or when `close` stops the pipelines (UNAVAILABLE):
a request's answer is then an error at once instead of a result nobody can use.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xrec.engine.catalogs import ServedCatalog
from xrec.engine.requests import BatchReport, ScheduledBatch
from xrec.engine.responses import ResponseData, ms, response_data
from xrec.engine.threads import FollowFreeCores
from xrec.errors import DeadlineExceeded, Internal, Unavailable, XrecError
from xrec.model.family import RecModel
from xrec.search.batch import prepare_batch
from xrec.search.filters import SearchFilter
from xrec.search.graphs import DecodeGraphs
from xrec.search.workspace_buffers import Workspace

logger = logging.getLogger(__name__)

EngineBatch = ScheduledBatch["ValidRequest", ServedCatalog]   # noqa: F821 (a type alias only)

STOP_WAIT_S = 60.0  # close(): how long a stopped pipeline may take to end its round


class _Stopped(Exception):
    """Raised between rounds to stop a batch; `error` is what its requests are answered."""

    def __init__(self, error: XrecError):
        super().__init__(error.message)
        self.error = error


@dataclass
class _Pipeline:
    """What one pipeline thread owns: its CUDA stream (None on a CPU), its workspace, its
    CPU cores policy and its captured decode rounds (made before its first batch)."""

    stream: torch.cuda.Stream | None
    workspace: Workspace
    cores: FollowFreeCores | None
    graphs: DecodeGraphs | None = None


def _on(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class AnswerSettings:
    """How a batch's answers are built: item conversion thresholds (spec: each / total
    conversion threshold) and the text of a result's tokens (None: no text)."""

    each_conversion_threshold: int
    total_conversion_threshold: int
    token_text: Callable[[list[int]], str] | None = None


class Executor:
    """Runs launched batches on `num_pipelines` worker threads, each with
    `threads_per_pipeline` intra-op threads on a CPU (None: torch's default), fewer while
    other processes take cores (`adaptive_threads`, engine/threads.py `FollowFreeCores`).

    `make_graphs`: each pipeline's captured decode rounds (search/graphs.py), made on its
    thread before its first batch (None: every round eager; settable until then); batches
    are then padded to `padded_len` so that fewer shapes come.

    Test seams: `fault` (called with the batch before it runs; may raise) and `clock`
    (the time base of deadlines and of when a batch's answers are ready: the scheduler's).
    `num_rounds_run` counts the rounds the pipelines have started, all batches together
    (a replayed batch's decode rounds count as started when the replay is queued).
    """

    def __init__(self, model: RecModel, num_pipelines: int, threads_per_pipeline: int | None,
                 answers: AnswerSettings,
                 on_done: Callable[[EngineBatch, BatchReport[ResponseData]], None],
                 adaptive_threads: bool | None = None,
                 make_graphs: Callable[[], DecodeGraphs] | None = None):
        self.model, self.answers, self.on_done = model, answers, on_done
        self.make_graphs = make_graphs
        self._graphs: list[DecodeGraphs] = []   # each pipeline's, appended by its thread
        self.threads_per_pipeline = threads_per_pipeline
        self.adaptive_threads = adaptive_threads
        self.fault: Callable[[EngineBatch], None] | None = None
        self.clock: Callable[[], float] = time.monotonic
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = 0
        self._bytes_in_use = 0
        self._busy_lock = threading.Lock()
        self._num_rounds_run = 0
        self._is_stopping = threading.Event()   # close(): batches stop at their next round
        # close() began: the pipelines end after the batches launched before it, so a batch
        # launched later is answered here; the lock orders launches against that moment
        self._is_closed = False
        self._launch_lock = threading.Lock()
        self._cores: list[FollowFreeCores] = []   # each CPU pipeline's, appended by its thread
        device = model.device
        self._pipelines = [threading.Thread(target=self._serve, args=(device,),
                                            name=f"xrec-pipeline-{index}", daemon=True)
                           for index in range(num_pipelines)]
        for thread in self._pipelines:
            thread.start()

    @property
    def num_busy(self) -> int:
        return self._busy

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The pipelines' worker threads."""
        return tuple(self._pipelines)

    @property
    def cpu_threads(self) -> int:
        """The intra-op threads the CPU pipelines run their batches on now (0 on a GPU)."""
        return sum(cores.current for cores in list(self._cores))

    @property
    def graph_counts(self) -> tuple[int, int]:
        """Captures and replays of decode rounds, all pipelines together."""
        graphs = list(self._graphs)
        return sum(g.num_captures for g in graphs), sum(g.num_replays for g in graphs)

    @property
    def num_rounds_run(self) -> int:
        return self._num_rounds_run

    @property
    def is_stopping(self) -> bool:
        """`close` has stopped the pipelines: a running batch stops at its next round."""
        return self._is_stopping.is_set()

    @property
    def workspace_bytes_in_use(self) -> int:
        """The workspace estimate of the batches running now (the scheduler's admission figure)."""
        return self._bytes_in_use

    def launch(self, batch: EngineBatch) -> None:
        """Hand a batch to a free pipeline (the scheduler bounds batches in flight); it runs
        on `batch.catalog` whatever the engine serves by then. Once `close` has begun (the
        scheduler's loop held up past close's wait for it) no pipeline would take it: it is
        answered UNAVAILABLE at once, here."""
        with self._launch_lock:
            if not self._is_closed:
                self._work.put(batch)
                return
        now = self.clock()
        self._answer(batch, BatchReport(batch.num_requests, batch.num_beams, 0.0,
                                        tuple(now - r.enqueued_at for r in batch.requests),
                                        now, (),
                                        Unavailable("engine closed before the batch started")))

    def close(self, grace_s: float = 30.0) -> None:
        """End the pipelines: batches launched before this run and may finish for up to
        `grace_s`; then those still running stop at their next round (their requests
        answered UNAVAILABLE) and the threads are joined, waiting at most STOP_WAIT_S
        for a round to end. Idempotent; from a pipeline thread it does not wait for
        that thread."""
        with self._launch_lock:
            self._is_closed = True
            for _ in self._pipelines:
                self._work.put(None)
        others = [t for t in self._pipelines if t is not threading.current_thread()]
        deadline = time.monotonic() + max(0.0, grace_s)
        for thread in others:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._is_stopping.set()
        deadline = time.monotonic() + STOP_WAIT_S
        for thread in others:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.error("pipeline %s still runs a round %.0f s after close", thread.name,
                             STOP_WAIT_S)

    def _serve(self, device: torch.device) -> None:
        cores = None
        if self.threads_per_pipeline:
            cores = FollowFreeCores(self.threads_per_pipeline, len(self._pipelines),
                                    self.adaptive_threads)
            cores.follow()
            self._cores.append(cores)
        # Each pipeline owns its stream; everything of a batch is queued on it.
        stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        pipe = _Pipeline(stream, Workspace(device), cores)
        while self._serve_one(pipe):
            pass

    def _serve_one(self, pipe: _Pipeline) -> bool:
        """Run the next batch (False: close). Its catalog is referenced by this frame only,
        so it is let go when the batch is done (a catalog load waits for that)."""
        batch = self._work.get()
        if batch is None:
            return False
        with self._busy_lock:
            self._busy += 1
            self._bytes_in_use += batch.workspace_bytes
        try:
            report = self._run(batch, pipe)
        finally:
            with self._busy_lock:
                self._busy -= 1
                self._bytes_in_use -= batch.workspace_bytes
        self._answer(batch, report)
        return True

    def _answer(self, batch: EngineBatch, report: BatchReport[ResponseData]) -> None:
        """`on_done(batch, report)`; a failure there is logged, never raised: a pipeline lives
        on to run the batches after this one, and a launch's caller must not answer the
        batch again."""
        try:
            self.on_done(batch, report)
        except Exception:
            logger.exception("answering a batch of %d requests failed", batch.num_requests)

    def _run(self, batch: EngineBatch, pipe: _Pipeline) -> BatchReport[ResponseData]:
        started = self.clock()
        scheduled = batch.requests
        queue_s = tuple(started - r.enqueued_at for r in scheduled)
        try:
            self._ready(pipe)
            if self.fault is not None:
                self.fault(batch)
            served = batch.catalog
            answers: list[ResponseData | XrecError | None] = \
                served.resolve_filters([r.request for r in scheduled])
            # a filter the batch's catalog cannot apply fails its request; the rest run
            runs = [i for i, answer in enumerate(answers) if not isinstance(answer, XrecError)]
            if runs:
                requests = [scheduled[i].request for i in runs]
                filters = [answers[i] for i in runs]
                is_pinned = pipe.stream is not None
                step_batch = prepare_batch(requests, self.model.config.d_model, is_pinned,
                                           SearchFilter.of(filters, served.trie_sizes, is_pinned)
                                           if any(filters) else None, pipe.graphs is not None)
                with _on(pipe.stream):
                    deadlines = [r.deadline for r in batch.requests]
                    last_deadline = None if None in deadlines else max(deadlines)
                    output = served.step.run(
                        step_batch, pipe.workspace,
                        lambda r: self._before_round(batch.catalog.step.rounds, last_deadline, r),
                        pipe.graphs)
                run_ms = ms(self.clock() - started)
                settings = self.answers
                done = response_data(output, requests, served.catalog,
                                     settings.each_conversion_threshold,
                                     settings.total_conversion_threshold,
                                     [{"queue_ms": ms(queue_s[i]), "run_ms": run_ms} for i in runs],
                                     settings.token_text, served.content_hash, filters)
                for i, data in zip(runs, done):
                    answers[i] = data
            answers = tuple(answers)
            error = None
        except _Stopped as stop:
            logger.info("batch of %d requests stopped: %s", batch.num_requests, stop.error.message)
            answers, error = (), stop.error
        except Exception as exc:  # a failure in one batch fails only that batch
            logger.exception("batch of %d requests failed", batch.num_requests)
            answers, error = (), Internal(f"batch failed: {type(exc).__name__}: {exc}")
        finished = self.clock()
        return BatchReport(batch.num_requests, batch.num_beams, finished - started, queue_s,
                           finished, answers, error)

    def _ready(self, pipe: _Pipeline) -> None:
        """Before a batch: the pipeline's thread count, and its CUDA graphs' pool at its first
        batch (in the batch's try: a failure here fails that batch, never the pipeline)."""
        if pipe.cores is not None:
            pipe.cores.follow()
        if pipe.graphs is None and self.make_graphs is not None:
            with _on(pipe.stream):
                pipe.graphs = self.make_graphs()   # its memory pool, on this pipeline's device
            self._graphs.append(pipe.graphs)

    def _before_round(self, rounds: int, last_deadline: float | None, round_index: int) -> None:
        """Between rounds: stop the batch when the engine closes or when every request in
        it has passed its deadline, i.e. `last_deadline`, the latest of them (None: one has
        none); on time is up to and including the deadline."""
        if self._is_stopping.is_set():
            raise _Stopped(Unavailable(f"engine closed: the batch stopped before round "
                                       f"{round_index + 1} of {rounds}"))
        if last_deadline is not None:
            late_s = self.clock() - last_deadline
            if late_s > 0:
                raise _Stopped(DeadlineExceeded(
                    f"deadline passed {round(1000.0 * late_s, 3)} ms ago: the batch stopped "
                    f"before round {round_index + 1} of {rounds}"))
        with self._busy_lock:
            self._num_rounds_run += 1
