"""Prometheus metrics of one HTTP app, on its own `CollectorRegistry` (never the global one,
so that several apps in one process do not collide).

Batch metrics come from the engine's report hook (`BatchReport`, called on a
pipeline thread; prometheus_client metrics are thread-safe). Gauges come from one
`engine.stats()` per scrape (`EngineStats`: the same for both engine kinds). A scrape
renders on a worker thread (app.py): a process-isolated engine's `stats()` is a round trip
to its child, bounded (`isolated.READ_TIMEOUT_S`); when the engine cannot say (a stopped
child), the scrape still answers, with `xrec_ready` 0 and the load gauges and graph
counters 0; a child that is gone answers (`is_serving=False`, no load, its last catalog).
Per-round time is the batch's run time divided by the engine's `rounds` (the run time
includes host preparation and item conversion, so this is an upper bound of the device
time of one round).

The served catalog (hot reload, `server/admin.py`) is read when scraped:
`xrec_catalog_info{content_hash, source} 1` names the current version,
`xrec_catalog_items` and `xrec_catalog_loaded_timestamp_seconds` describe it (none of
the three without a catalog); `xrec_catalog_changes_total{action, code}` counts loads
and restores through the admin routes by outcome.

`xrec_graph_captures_total` and `xrec_graph_replays_total` count captured decode rounds
(option `cuda_graphs`, search/graphs.py) and the batches that replayed one.

`xrec_model_info{family, dtype} 1` names the model family and the dtype serving (option
`dtype` resolved: "auto" is float32 or bfloat16 by hardware).

For alerts (ops/prometheus/xrec-alerts.yml): `xrec_ready` is 1 while the engine is loaded
and takes new work (`EngineStats.is_serving`), 0 while loading, once a drain has closed
the engine, when its scheduler stopped, or when a process-isolated engine's child is gone or
does not answer; `xrec_request_queue_limit` and (with a default
deadline) `xrec_request_timeout_seconds` are the engine's `request_queue_size` and
`request_timeout_ms`. `process_*` are prometheus_client's process metrics (Linux): the
serving process's memory, CPU and file descriptors (a process-isolated engine's child is
not counted).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (CollectorRegistry, Counter, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from xrec.errors import XrecError

if TYPE_CHECKING:
    from xrec.config.engine import EngineOptions
    from xrec.engine.frontend import EngineFrontend, EngineStats
    from xrec.engine.requests import BatchReport

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BEAM_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    """All `xrec_*` metrics of one app. `attach(engine)` once the engine is loaded."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self._engine: EngineFrontend | None = None
        self.request_latency = Histogram(
            "xrec_request_latency_seconds", "End-to-end latency of recommendation requests "
            "(body read to response built)", ["api"], buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_wait = Histogram(
            "xrec_queue_wait_seconds", "Time from submission to the start of the request's batch",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.step_time = Histogram(
            "xrec_step_seconds", "Run time of one batch (all rounds, host preparation included)",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.round_time = Histogram(
            "xrec_round_seconds", "Batch run time divided by the number of rounds",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.batch_requests = Histogram(
            "xrec_batch_size_requests", "Requests per batch", buckets=REQUEST_BUCKETS,
            registry=registry)
        self.batch_beams = Histogram(
            "xrec_batch_size_beams", "Beams (sum of beam widths) per batch", buckets=BEAM_BUCKETS,
            registry=registry)
        self.input_length = Histogram(
            "xrec_input_length_tokens", "Encoder input length of accepted requests",
            buckets=LENGTH_BUCKETS, registry=registry)
        self.requests = Counter(
            "xrec_requests", "Recommendation requests by final status code (OK or an error code)",
            ["api", "code"], registry=registry)
        self.tokens_in = Counter(
            "xrec_input_tokens", "Encoder input tokens of accepted requests", registry=registry)
        self.batches = Counter(
            "xrec_batches", "Batches run, by outcome", ["outcome"], registry=registry)
        self.catalog_changes = Counter(
            "xrec_catalog_changes", "Catalog loads and restores through the admin routes, by "
            "action (load, restore) and status code (OK or an error code)", ["action", "code"],
            registry=registry)
        registry.register(_EngineCollector(self))
        ProcessCollector(registry=registry)   # process_*: memory, CPU, open fds (Linux)

    def attach(self, engine: EngineFrontend) -> None:
        self._engine = engine
        engine.add_report_hook(self.on_batch)

    def on_batch(self, report: BatchReport) -> None:
        """The engine's report hook: one call per finished batch, on a pipeline thread."""
        self.batches.labels("ok" if report.is_ok else "failed").inc()
        self.step_time.observe(report.run_s)
        rounds = self._engine.options.rounds if self._engine is not None else 1
        self.round_time.observe(report.run_s / rounds)
        self.batch_requests.observe(report.num_requests)
        self.batch_beams.observe(report.num_beams)
        for seconds in report.queue_s:
            self.queue_wait.observe(max(0.0, seconds))

    def on_accepted(self, input_len: int) -> None:
        self.input_length.observe(input_len)
        self.tokens_in.inc(input_len)

    def on_catalog_change(self, action: str, code: str) -> None:
        self.catalog_changes.labels(action, code).inc()

    def on_finished(self, api: str, code: str, seconds: float | None = None) -> None:
        self.requests.labels(api, code).inc()
        if seconds is not None:
            self.request_latency.labels(api).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# gauge -> (help, its value in an EngineStats)
ENGINE_GAUGES = {
    "xrec_requests_waiting": ("Requests queued and not yet launched",
                              lambda s: s.num_requests_waiting),
    "xrec_batches_running": ("Batches in flight", lambda s: s.num_batches_running),
    "xrec_pipelines_busy": ("Pipelines running a batch", lambda s: s.num_pipelines_busy),
    "xrec_pipelines": ("Pipelines", lambda s: s.num_pipelines),
    "xrec_workspace_bytes_budget": ("Workspace budget of all pipelines",
                                    lambda s: s.workspace_bytes_total),
    "xrec_workspace_bytes_in_use": ("Workspace estimate of the batches running now",
                                    lambda s: s.workspace_bytes_in_use),
    "xrec_cpu_threads": ("CPU intra-op threads of all pipelines now (fewer while other "
                         "processes take cores; 0 on a GPU)", lambda s: s.cpu_threads),
}


class _EngineCollector(Collector):
    """The engine's load, readiness and its current catalog version from one `stats()` per
    scrape (a catalog swap shows at once, and the previous version's labels vanish); 0
    while the engine loads (the limits and the catalog are absent then) or cannot say (the
    catalog is absent then)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engine = self.metrics._engine
        stats = None if engine is None else _stats_or_none(engine)
        for name, (doc, value) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=0.0 if stats is None else value(stats))
        for name, doc, value in (
                ("xrec_graph_captures", "Decode rounds captured as a CUDA graph (one per bucket "
                 "and pipeline; option cuda_graphs)", lambda s: s.graph_captures),
                ("xrec_graph_replays", "Batches whose decode rounds replayed a captured graph",
                 lambda s: s.graph_replays)):
            yield CounterMetricFamily(name, doc, value=0.0 if stats is None else value(stats))
        yield GaugeMetricFamily("xrec_ready", "1 while the engine is loaded and takes new work, "
                                "else 0 (loading, closed by a drain, scheduler stopped, engine "
                                "process gone or not answering)",
                                value=float(stats is not None and stats.is_serving))
        if engine is not None:
            info = GaugeMetricFamily("xrec_model_info", "The model serving (value 1): its "
                                     "family and the dtype it runs in", labels=["family", "dtype"])
            info.add_metric([engine.family, engine.dtype], 1.0)
            yield info
            yield from _limit_gauges(engine.options)
        if stats is not None:
            yield from _catalog_gauges(stats)


def _stats_or_none(engine: EngineFrontend) -> EngineStats | None:
    """`engine.stats()`, or None when the engine cannot say (a process-isolated engine's child
    that does not answer in time): the scrape answers without it instead of failing."""
    try:
        return engine.stats()
    except XrecError as exc:
        logger.warning("metrics without the engine's stats: %s", exc)
        return None


def _limit_gauges(options: EngineOptions) -> Iterator[GaugeMetricFamily]:
    yield GaugeMetricFamily("xrec_request_queue_limit", "request_queue_size: requests waiting "
                            "(xrec_requests_waiting) at which new ones are refused 429",
                            value=options.request_queue_size)
    if options.request_timeout_ms is not None:
        yield GaugeMetricFamily("xrec_request_timeout_seconds", "request_timeout_ms in seconds: "
                                "the deadline of requests that give no timeout_ms",
                                value=options.request_timeout_ms / 1000)


def _catalog_gauges(stats: EngineStats) -> Iterator[GaugeMetricFamily]:
    version = stats.catalog_version
    if version is None:
        return
    info = GaugeMetricFamily("xrec_catalog_info", "The catalog serving new batches (value 1)",
                             labels=["content_hash", "source"])
    info.add_metric([version.content_hash, version.source or ""], 1.0)
    yield info
    yield GaugeMetricFamily("xrec_catalog_items", "Items in the current catalog",
                            value=version.num_items)
    yield GaugeMetricFamily("xrec_catalog_loaded_timestamp_seconds",
                            "When the current catalog was loaded (Unix time)",
                            value=version.loaded_at)
