"""Executor: `max_concurrency` pipelines, each a worker thread (+ a CUDA stream on a GPU).

A launched batch runs start to finish on one pipeline: host preparation, the
whole R-round `RecStep` on the pipeline's stream, one copy back, item
conversion, answers. Pipelines share one model and take no lock from each
other; a batch runs on the catalog (`ServedCatalog`: tables and items, read-only)
it was launched with, even when the engine swaps catalogs meanwhile. A failure
inside a batch fails that batch's requests with INTERNAL; the pipeline goes on
serving.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xrec.engine.catalogs import ServedCatalog
from xrec.engine.requests import ScheduledRequest
from xrec.engine.responses import ResponseData, response_data, ms
from xrec.engine.threads import use_threads_in_this_thread
from xrec.errors import DeadlineExceeded, Internal
from xrec.search.batch import prepare_batch
from xrec.model.family import RecModel
from xrec.search.workspace_buffers import Workspace

logger = logging.getLogger(__name__)


@dataclass
class BatchReport:
    """What a finished batch tells the metrics: sizes and times (seconds)."""

    num_requests: int
    num_beams: int
    run_s: float
    is_ok: bool
    queue_s: list[float] = field(default_factory=list)


class Executor:
    """Runs launched batches on `num_pipelines` worker threads.

    `token_text(ids)` gives a result's text (None: results carry none).
    `on_batch_done` is called once per batch after its requests are answered
    (the scheduler's `batch_done`); `on_report` receives a `BatchReport`.
    `finish(ResponseData)` makes a request's answer (default: the `RecResponse`).
    `fault` is a test hook: called with the batch before it runs; may raise.
    """

    def __init__(self, model: RecModel, num_pipelines: int,
                 each_threshold: int, total_threshold: int, threads_per_pipeline: int | None,
                 token_text: Callable[[list[int]], str] | None,
                 on_batch_done: Callable[[], None], on_report: Callable[[BatchReport], None],
                 batch_bytes: Callable[[list[ScheduledRequest]], int],
                 clock: Callable[[], float] = time.monotonic,
                 finish: Callable[[ResponseData], Any] = ResponseData.to_response):
        self.model, self.token_text = model, token_text
        self.each_threshold, self.total_threshold = each_threshold, total_threshold
        self.on_batch_done, self.on_report, self.clock = on_batch_done, on_report, clock
        self.threads_per_pipeline = threads_per_pipeline
        self.batch_bytes, self.finish = batch_bytes, finish
        self.fault: Callable[[list[ScheduledRequest]], None] | None = None
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = 0
        self._bytes_in_use = 0
        self._busy_lock = threading.Lock()
        device = model.device
        self._pipelines = [threading.Thread(target=self._serve, args=(index, device),
                                            name=f"xrec-pipeline-{index}", daemon=True)
                           for index in range(num_pipelines)]
        for thread in self._pipelines:
            thread.start()

    @property
    def num_busy(self) -> int:
        return self._busy

    @property
    def workspace_bytes_in_use(self) -> int:
        """The workspace estimate of the batches running now (the scheduler's admission figure)."""
        return self._bytes_in_use

    def launch(self, batch: list[ScheduledRequest], served: ServedCatalog) -> None:
        """Hand a batch to a free pipeline (the scheduler bounds batches in flight); it runs
        on `served` (its search and items) whatever the engine serves by then."""
        self._work.put((batch, served))

    def close(self, timeout_s: float = 30.0) -> None:
        for _ in self._pipelines:
            self._work.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._pipelines:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _serve(self, index: int, device: torch.device) -> None:
        if self.threads_per_pipeline:
            use_threads_in_this_thread(self.threads_per_pipeline)
        # Each pipeline owns its stream; everything of a batch is queued on it.
        stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        workspace = Workspace(device)  # this pipeline's reusable buffers, used on its stream only
        while self._serve_one(stream, workspace):
            pass

    def _serve_one(self, stream: torch.cuda.Stream | None, workspace: Workspace) -> bool:
        """Run the next batch (False: close). Its catalog is referenced by this frame only,
        so it is let go when the batch is done (a catalog load waits for that)."""
        work = self._work.get()
        if work is None:
            return False
        batch, served = work
        num_bytes = self.batch_bytes(batch)
        with self._busy_lock:
            self._busy += 1
            self._bytes_in_use += num_bytes
        try:
            self._run(batch, served, stream, workspace)
        finally:
            with self._busy_lock:
                self._busy -= 1
                self._bytes_in_use -= num_bytes
            self.on_batch_done()
        return True

    def _run(self, batch: list[ScheduledRequest], served: ServedCatalog,
             stream: torch.cuda.Stream | None, workspace: Workspace) -> None:
        started = self.clock()
        requests = [r.payload for r in batch]
        is_ok = False
        try:
            if self.fault is not None:
                self.fault(batch)
            step_batch = prepare_batch(requests, self.model.config.d_model,
                                       pin_memory=stream is not None)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                output = served.step.run(step_batch, workspace)
            finished = self.clock()
            timings = [{"queue_ms": ms(started - r.enqueued_at), "run_ms": ms(finished - started)}
                       for r in batch]
            responses = [data if r.answer_as_data else self.finish(data)
                         for r, data in zip(batch, response_data(
                             output, requests, served.catalog, self.each_threshold,
                             self.total_threshold, timings, self.token_text, served.content_hash))]
            is_ok = True
        except Exception as exc:  # a failure in one batch fails only that batch
            logger.exception("batch of %d requests failed", len(batch))
            for r in batch:
                r.fail(Internal(f"batch failed: {type(exc).__name__}: {exc}"))
        else:
            now = self.clock()
            for r, response in zip(batch, responses):
                if r.deadline is not None and now > r.deadline:
                    r.fail(DeadlineExceeded(f"request finished {ms(now - r.deadline)} ms after its "
                                            "deadline"))
                else:
                    r.answer(response)
        self.on_report(BatchReport(len(batch), sum(r.beam_width for r in batch),
                                   self.clock() - started, is_ok,
                                   [started - r.enqueued_at for r in batch]))
