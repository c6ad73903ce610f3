"""Prometheus metrics of one HTTP app, on its own `CollectorRegistry` (never the global one,
so that several apps in one process do not collide).

Batch metrics come from the engine's report hook (`BatchReport`, called on a
pipeline thread; prometheus_client metrics are thread-safe). Gauges are read
from the engine when scraped. Per-round time is the batch's run time divided
by the engine's `rounds` (the run time includes host preparation and item
conversion, so this is an upper bound of the device time of one round).

The served catalog (hot reload, `server/admin.py`) is read when scraped:
`xrec_catalog_info{content_hash, source} 1` names the current version,
`xrec_catalog_items` and `xrec_catalog_loaded_timestamp_seconds` describe it (none of
the three without a catalog); `xrec_catalog_changes_total{action, code}` counts loads
and restores through the admin routes by outcome.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

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
        self._engine: Any = None
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
        gauges = {
            "xrec_requests_waiting": ("Requests queued and not yet launched",
                                      lambda e: e.scheduler.num_waiting),
            "xrec_batches_running": ("Batches in flight",
                                     lambda e: e.scheduler.num_running_batches),
            "xrec_pipelines_busy": ("Pipelines running a batch", lambda e: e.executor.num_busy),
            "xrec_pipelines": ("Pipelines", lambda e: e.num_pipelines),
            "xrec_workspace_bytes_total": ("Workspace budget of all pipelines",
                                           lambda e: e.workspace_per_pipeline * e.num_pipelines),
            "xrec_workspace_bytes_in_use": ("Workspace estimate of the batches running now",
                                            lambda e: e.executor.workspace_bytes_in_use),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=registry).set_function(self._reader(read))
        self.catalog_changes = Counter(
            "xrec_catalog_changes", "Catalog loads and restores through the admin routes, by "
            "action (load, restore) and status code (OK or an error code)", ["action", "code"],
            registry=registry)
        registry.register(_CatalogCollector(self))

    def attach(self, engine: Any) -> None:
        self._engine = engine
        engine.add_report_hook(self.on_batch)

    def _reader(self, read: Any) -> Any:
        def value() -> float:
            engine = self._engine
            return 0.0 if engine is None else float(read(engine))
        return value

    def on_batch(self, report: Any) -> None:
        """The engine's report hook: one call per finished batch, on a pipeline thread."""
        self.batches.labels("ok" if report.is_ok else "failed").inc()
        self.step_time.observe(report.run_s)
        rounds = getattr(getattr(self._engine, "options", None), "rounds", 0) or 1
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


class _CatalogCollector(Collector):
    """The engine's current catalog version, read at each scrape (a swap shows at once, and
    the previous version's labels vanish)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Any:
        engine = self.metrics._engine
        version = None if engine is None else getattr(engine, "catalog_version", None)
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
