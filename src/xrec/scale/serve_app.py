"""`xrec serve --ray`: a Ray Serve application whose replicas each hold one Engine.

    client -> Ray Serve's HTTP proxy -> a replica (XrecReplica) -> its create_app(engine)

The routes are `xrec.server.app.create_app`'s, built once per replica around that
replica's engine and handed to Serve through `__serve_build_asgi_app__`: one app
definition for `xrec serve` and for every replica, so paths, bodies, errors and status
codes are the same. What differs is below the app: Serve's proxy (uvicorn, its own
connection handling) instead of `xrec.server.limits`, and Serve's replica lifecycle.

Decisions where the issue is silent:

- A replica reserves `replica_cpus` CPUs (and `replica_gpus` GPUs); its engine's
  intra-op threads are that CPU share (at least 1) unless `num_threads` is given, and
  it runs in thread isolation (the replica is already a process of its own).
  `xrec serve --ray` refuses replicas the cluster's free CPUs / GPUs cannot hold
  (`check_fits`): Serve would wait for them without a limit and say nothing.
- Every option is checked when `ServeOptions` is made (the engine options, the model
  directory's config.json too), before Ray starts; a deployment whose replicas fail to
  start is one ValueError with the replica's error (`deploy`).
- `max_ongoing_requests` = twice the engine's capacity (`request_queue_size +
  max_concurrency * max_seqs_per_batch`): the requests past that capacity still reach a
  replica, whose engine answers 429 at once, as `xrec serve` does; with only the
  capacity, Serve's proxy held them in an unbounded queue and nothing was refused.
  The proxy queues as many more at most (`max_queued_requests`), then answers 429
  itself (plain text, `Retry-After: 1`). A request's `timeout_ms` counts from its
  reaching the replica. Autoscaling (`max_replicas` above `num_replicas`) targets one
  full batch per pipeline ongoing per replica: more than that means requests wait in
  the engine's queue.
- Health: a replica is healthy while its engine accepts work (not closed, its
  scheduler thread alive); Serve's health check calls `check_health` and replaces a
  replica that fails it. `/health` through the proxy means what it means for
  `xrec serve` (200 serving; Serve routes only to replicas whose engine has loaded).
- A replica that dies is restarted by Serve; its in-flight requests are answered 500
  by the proxy, in plain text (the proxy writes that answer itself, outside any
  middleware), never left hanging; the other replicas are not affected.
- Metrics: `/metrics` through the proxy is the metrics of whichever replica answered;
  without an API key each replica also serves its own registry on an ephemeral port of
  the loopback interface (`replica_info()`: pid, replica id, metrics URL; `xrec serve
  --ray` logs them), for a scraper on its node. With a key there is no such port: it
  would answer without the key.
- Shutdown: SIGTERM / SIGINT drains every replica at once (Serve's `broadcast` of
  `XrecReplica.drain`: new requests 503 UNAVAILABLE, as `xrec serve` answers them, while
  the engine finishes its own, for `grace_s` at most; then those still unanswered are
  answered 503 UNAVAILABLE and the engine is closed), then deletes the application. A signal while the application
  starts stops the start (the replicas already running, which may be answering, are
  drained first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

from xrec.config import EngineOptions, read_model_config
from xrec.config.engine import (check_catalog_flags, check_grace_flag, parse_bool,
                               parse_generation_prefix)

logger = logging.getLogger("xrec.server")

APP_NAME = "xrec"
DEPLOYMENT_NAME = "XrecReplica"
METRICS_HOST = "127.0.0.1"   # a replica's own metrics port: for a scraper on its node only
SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class ServeOptions:
    """One Serve application of xrec: the model, the app's settings and the replicas."""

    model_dir: str
    catalog: str | None = None
    engine_options: dict = field(default_factory=dict)
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int | None = None
    grace_s: float = 30.0
    num_replicas: int = 1
    max_replicas: int | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    catalog_extended: bool | None = None   # how to read `catalog` (Engine.from_pretrained)

    def __post_init__(self) -> None:
        if not isinstance(self.num_replicas, int) or not 1 <= self.num_replicas <= 1024:
            raise ValueError(f"--replicas: got {self.num_replicas!r}, allowed: 1 to 1024")
        if self.max_replicas is not None and not self.num_replicas <= self.max_replicas <= 1024:
            raise ValueError(f"--max-replicas: got {self.max_replicas}, allowed: --replicas "
                             f"({self.num_replicas}) to 1024")
        if not 0 < self.replica_cpus <= 1024:
            raise ValueError(f"--replica-cpus: got {self.replica_cpus}, expected > 0")
        if not 0 <= self.replica_gpus <= 64:
            raise ValueError(f"--replica-gpus: got {self.replica_gpus}, expected >= 0")
        check_grace_flag(self.grace_s)   # as `xrec serve` checks it
        check_catalog_flags(self.catalog, self.catalog_extended)
        from xrec.server.service import checked_api_key, checked_max_body_bytes
        try:
            checked_max_body_bytes(self.max_body_bytes)
        except ValueError as e:
            raise ValueError(f"--max-body-bytes{str(e)[len('max_body_bytes'):]}") from None
        if self.api_key is not None:
            try:
                checked_api_key(self.api_key)
            except ValueError as e:
                raise ValueError(f"--api-key / XREC_API_KEY: {str(e)[len('api key: '):]}") from None
        self.replica_engine()
        # the replicas read it on their nodes (the same path on every node); a missing one
        # failed there, after Ray had started, as a traceback
        read_model_config(Path(self.model_dir) / "config.json")

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_dir: str, engine_options: dict,
                  ) -> "ServeOptions":
        api_key = args.api_key if args.api_key is not None else os.environ.get("XREC_API_KEY")
        given = {name: value for name, value in (("num_replicas", args.replicas),
                                                 ("replica_cpus", args.replica_cpus),
                                                 ("replica_gpus", args.replica_gpus))
                 if value is not None}   # the flags' defaults are the fields'
        return cls(model_dir, args.catalog, engine_options, args.served_model_name, api_key,
                   args.max_body_bytes, args.grace_s, max_replicas=args.max_replicas,
                   catalog_extended=args.catalog_extended, **given)

    def replica_engine_options(self) -> dict:
        """The engine options of one replica: its intra-op threads from its CPU share."""
        options = dict(self.engine_options)
        options.setdefault("num_threads", max(1, math.floor(self.replica_cpus)))
        if self.replica_gpus > 0 and options.get("device", "auto") == "auto":
            options["device"] = "cuda"
        return options

    def replica_engine(self) -> EngineOptions:
        """One replica's engine options, checked (ValueError naming the option)."""
        return EngineOptions.from_kwargs(**self.replica_engine_options())

    def deployment_options(self) -> dict:
        """Serve's options of the deployment (see the module docstring for the mapping)."""
        engine = self.replica_engine()
        pipelines = engine.max_concurrency or (2 if self.replica_gpus > 0 else 1)
        per_batch = pipelines * engine.max_seqs_per_batch
        max_ongoing = 2 * (engine.request_queue_size + per_batch)   # the engine's capacity, twice
        options: dict[str, Any] = {
            "name": DEPLOYMENT_NAME,
            "ray_actor_options": {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus},
            "max_ongoing_requests": max_ongoing,
            "max_queued_requests": max_ongoing,
            "backpressure_config": {"status_code": 429, "retry_after_s": 1},
            "graceful_shutdown_timeout_s": self.grace_s + 5.0,
            "health_check_period_s": 2.0,
            "health_check_timeout_s": 30.0,
        }
        if self.max_replicas is not None and self.max_replicas > self.num_replicas:
            options["autoscaling_config"] = {"min_replicas": self.num_replicas,
                                             "max_replicas": self.max_replicas,
                                             "target_ongoing_requests": per_batch}
        else:
            options["num_replicas"] = self.num_replicas
        return options


class XrecReplica:
    """One Serve replica: an Engine and `create_app(engine)` around it."""

    def __init__(self, options: ServeOptions):
        from xrec.scale.batch import load_engine
        from xrec.server.app import create_app

        logging.getLogger("xrec").setLevel(logging.INFO)
        self.options = options
        self.engine = load_engine(options.model_dir, options.catalog,
                                  options.replica_engine_options(), owns_process=True,
                                  catalog_extended=options.catalog_extended)
        self.http_app = create_app(self.engine, served_model_name=options.served_model_name,
                              api_key=options.api_key, max_body_bytes=options.max_body_bytes)
        self.service = self.http_app.state.xrec
        # with a key, no port of its own: it would answer without the key
        self._metrics_url = None if options.api_key else _serve_metrics(self.service.metrics.registry)

    def __serve_build_asgi_app__(self) -> Any:   # (`app` is Serve's own attribute)
        return self.http_app

    def check_health(self) -> None:
        """Serve's health check: raises while this replica's engine cannot take work (but
        not once `drain` closes it: Serve would start a replacement during the shutdown)."""
        if not self.service.is_draining and not self.engine.stats().is_serving:
            raise RuntimeError("the engine is closed or its scheduler has stopped")

    def replica_info(self) -> dict:
        """Who this replica is: pid, Serve's replica id, its own metrics URL (None with a key)."""
        from ray import serve

        context = serve.get_replica_context()
        return {"pid": os.getpid(), "replica_id": str(context.replica_id.unique_id),
                "metrics_url": self._metrics_url}

    async def drain(self, timeout_s: float) -> dict:
        """`xrec serve`'s drain on this replica: from now on new requests are answered 503
        UNAVAILABLE (and `/health`) while the engine finishes those it holds, for
        `timeout_s` at most; then those still unanswered are answered 503 UNAVAILABLE and
        the engine is closed, as `xrec serve` drains. {"pid", "is_idle"}: whether it had
        finished them all."""
        from xrec.server.run import HTTP_TAIL_S

        self.service.begin_drain()
        deadline = time.monotonic() + timeout_s
        while not self._is_idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)   # the event loop answers meanwhile
        is_idle = self._is_idle()
        # what is left fails UNAVAILABLE now; before, Serve waited grace_s + 5 s more for
        # it, then killed the replica: the proxy's plain-text 500 (or a reset) instead
        await asyncio.to_thread(self.engine.close, 0)
        self.service.abandon_unfinished()
        deadline = time.monotonic() + HTTP_TAIL_S
        while self.service.num_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)   # bounded: the answers are being written
        return {"pid": os.getpid(), "is_idle": is_idle}

    def _is_idle(self) -> bool:
        stats = self.engine.stats()
        return stats.num_requests_waiting == 0 and stats.num_batches_running == 0

    def __del__(self) -> None:   # Serve's graceful shutdown: requests in flight have finished
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(self.options.grace_s)


def _serve_metrics(registry: Any) -> str:
    """This replica's registry over HTTP on an ephemeral port of the loopback interface
    (not the node's address: it would answer every host that reaches the node); the URL."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(0, addr=METRICS_HOST, registry=registry)
    return f"http://{METRICS_HOST}:{server.server_port}/metrics"


def deployment(options: ServeOptions) -> Any:
    from ray import serve

    return serve.deployment(serve.ingress()(XrecReplica), **options.deployment_options())


def application(options: ServeOptions) -> Any:
    """The bound application (`serve.run(application(options))`)."""
    return deployment(options).bind(options)


# ---- serve run xrec.scale.serve_app:build_app ---------------------------------------------------

BUILD_APP_RENAMES = {"model": "model_dir", "replicas": "num_replicas"}
# how `serve run`'s text becomes an option's value: `xrec serve`'s flag parsers, and what
# each expects
PARSERS = {"bool": (parse_bool, "true or false"), "int": (int, "an integer"),
           "float": (float, "a number"),
           "prefix": (parse_generation_prefix, "text or a JSON list of token ids")}


def build_app(args: dict) -> Any:
    """Serve's application builder: `serve run xrec.scale.serve_app:build_app model=DIR
    replicas=2`, or `import_path: xrec.scale.serve_app:build_app` with `args:` in a Serve
    config file. Keys: the `ServeOptions` fields (`model` or `model_dir`, `replicas` for
    `num_replicas`) and engine options by name; a missing model is the demo model, a
    missing api_key $XREC_API_KEY (as `xrec serve --ray`)."""
    return application(build_options(args))


def build_options(args: dict) -> ServeOptions:
    """`build_app`'s arguments as ServeOptions: text parsed as `xrec serve` parses the flag
    of the same option (a typo is refused, not taken as false)."""
    serve_kinds, engine_kinds = _kinds(ServeOptions), _kinds(EngineOptions)
    del serve_kinds["engine_options"]
    given: dict[str, Any] = {}
    engine_options: dict[str, Any] = {}
    for key, value in args.items():
        name = BUILD_APP_RENAMES.get(key, key)
        if name in serve_kinds:
            given[name] = _parsed(key, serve_kinds[name], value)
        elif name in engine_kinds:
            engine_options[name] = _parsed(key, engine_kinds[name], value)
        else:
            raise ValueError(f"build_app: unknown argument {key!r}; allowed: "
                             f"{sorted(set(serve_kinds) | set(BUILD_APP_RENAMES) | set(engine_kinds))}")
    if "model_dir" not in given:
        from xrec.demo import demo_model_dir
        given["model_dir"] = str(demo_model_dir())
    if "api_key" not in given:
        given["api_key"] = os.environ.get("XREC_API_KEY")
    return ServeOptions(engine_options=engine_options, **given)


def _kinds(options_class: type) -> dict[str, str]:
    """Field name -> its PARSERS key ("str": kept as text), from the field's annotation."""
    kinds = {}
    for f in fields(options_class):
        kind = next((k for k in ("bool", "int", "float") if str(f.type).startswith(k)), "str")
        kinds[f.name] = "prefix" if f.name == "generation_prefix" else kind
    return kinds


def _parsed(key: str, kind: str, value: Any) -> Any:
    """One argument as its option's value. `serve run key=value` gives text; a config
    file's typed values (YAML numbers, booleans, lists) are kept as they are."""
    if not isinstance(value, str) or kind == "str":
        return value
    if value.lower() in ("none", "null"):
        return None
    parse, expected = PARSERS[kind]
    try:
        return parse(value)
    except (ValueError, argparse.ArgumentTypeError):
        raise ValueError(f"build_app: {key}: got {value!r}, expected {expected}") from None


# ---- the proxy ------------------------------------------------------------------------------------

PROXY_CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "xrec.scale.serve_app:proxy_middlewares"


class OneRequestId:
    """ASGI middleware for Serve's proxy: the proxy appends its own `X-Request-ID` to every
    answer; when the app already set one (xrec's: the body's `id`), Serve's is dropped, so
    the header is the one `xrec serve` sends. Answers of the proxy itself keep Serve's."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_one(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                positions = [i for i, (name, _) in enumerate(headers)
                             if name.lower() == b"x-request-id"]
                if len(positions) > 1:
                    message = {**message, "headers": [h for i, h in enumerate(headers)
                                                      if i not in positions[1:]]}
            await send(message)

        await self.app(scope, receive, send_one)


def proxy_middlewares() -> list:
    """Serve's HTTP proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, read by
    the proxy process when it starts: a local cluster started by `xrec serve --ray` gets
    it; start an existing cluster with it set)."""
    from starlette.middleware import Middleware
    return [Middleware(OneRequestId)]


# ---- xrec serve --ray ---------------------------------------------------------------------------

def check_fits(options: ServeOptions, free: dict[str, float]) -> None:
    """ValueError unless `free` (`ray.available_resources()`) holds the replicas Serve
    starts with (`--replicas`; autoscaling's minimum): Serve waits for a replica it cannot
    place without a limit, and says nothing."""
    for flag, resource, each in (("--replica-cpus", "CPU", options.replica_cpus),
                                 ("--replica-gpus", "GPU", options.replica_gpus)):
        needed, available = options.num_replicas * each, free.get(resource, 0.0)
        if needed > available + 1e-9:
            raise ValueError(f"--replicas {options.num_replicas} x {flag} {each:g} = {needed:g} "
                             f"{resource}(s), but the Ray cluster has {available:g} free; Serve "
                             "would wait for the replicas without end: ask for less, or add "
                             "nodes")


def start(options: ServeOptions, host: str, port: int, app_name: str = APP_NAME) -> None:
    """Deploy on the connected cluster; returns once every replica has loaded its engine."""
    start_serve(host, port)
    deploy(options, app_name)


def start_serve(host: str, port: int) -> None:
    """Serve on the connected cluster, its proxies on `host:port`. ValueError when Serve
    already runs there on another address: it keeps its HTTP options until `serve
    shutdown`, and the application would not be where `--host` / `--port` say."""
    from ray import serve
    from ray.serve.context import _get_global_client   # the running HTTP options: no public API

    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    running = _get_global_client().http_config
    if (running.host, running.port) != (host, port):
        raise ValueError(f"--host {host} --port {port}: Ray Serve already runs on this cluster "
                         f"on {running.host}:{running.port} (it keeps that until `serve "
                         f"shutdown`); pass --host {running.host} --port {running.port}")


def deploy(options: ServeOptions, app_name: str = APP_NAME) -> None:
    """The application on the running Serve, at `/`; returns once every replica has loaded
    its engine. ValueError with a replica's error when they fail to start."""
    from ray import serve

    try:
        serve.run(application(options), name=app_name, route_prefix="/", blocking=False)
    except RuntimeError as e:   # DEPLOY_FAILED: the reason is in the deployment's status
        raise ValueError(f"the replicas failed to start: {_replica_error(app_name) or e}") from None


def _replica_error(app_name: str) -> str | None:
    """The last line of the deployment's status message: the exception a replica's
    constructor raised (the lines above are Serve's traceback)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    status = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
    lines = status.message.strip().splitlines() if status is not None else []
    return lines[-1] if lines else None


def replica_infos(num_replicas: int, app_name: str = APP_NAME, timeout_s: float = 30.0) -> list[dict]:
    """`replica_info()` of every running replica, sorted by pid."""
    return _ask_every_replica("replica_info", num_replicas, app_name, timeout_s)


def drain(grace_s: float, app_name: str = APP_NAME) -> None:
    """`XrecReplica.drain` on every running replica at once: new requests are answered 503
    while the engines finish theirs; returns once all are idle, or after about `grace_s`."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    status = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
    states = status.replica_states if status is not None else {}
    num_running = states.get("RUNNING", 0)
    answers = _ask_every_replica("drain", num_running, app_name, grace_s + 5.0, grace_s)
    num_idle = sum(answer["is_idle"] for answer in answers)
    if num_idle < num_running:
        logger.warning("xrec serve --ray: %d of %d replica(s) idle after the grace period; "
                       "deleting the application", num_idle, num_running)


def _ask_every_replica(method: str, num_replicas: int, app_name: str, timeout_s: float,
                       *args: Any) -> list[dict]:
    """`method(*args)`'s answers ({"pid": ...}) of `num_replicas` replicas, sorted by pid:
    every replica the handle knows is asked at once (Serve's `broadcast`), again until each
    has answered or `timeout_s` is over (a new handle may not know them all yet). One call
    at a time through the handle's router reached a busy replica last, or never: the
    router sends a call to the less loaded of two replicas, a drained one. None to ask: no
    handle either (Serve refuses one, with a KeyError, for a deployment it has not registered
    yet: a signal just after the application appeared)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    if num_replicas <= 0:
        return []
    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name)
    seen: dict[int, dict] = {}
    failures: list = []
    deadline = time.monotonic() + timeout_s
    while len(seen) < num_replicas and (time_left := deadline - time.monotonic()) > 0:
        try:
            answers = handle.broadcast(method, *args).results(timeout_s=time_left,
                                                              return_exceptions=True)
        except (TimeoutError, RayServeException):   # no replica known yet, or none answered
            answers = []
        seen.update((answer["pid"], answer) for answer in answers if isinstance(answer, dict))
        failures = [answer for answer in answers if not isinstance(answer, dict)]
        if len(seen) < num_replicas:
            time.sleep(0.05)
    if failures:
        logger.warning("xrec serve --ray: %s failed on %d replica(s): %r", method,
                       len(failures), failures[0])
    return sorted(seen.values(), key=lambda answer: answer["pid"])


class Interrupted(BaseException):
    """A signal came while the application was starting. A BaseException, as
    KeyboardInterrupt is: Ray's deploy path catches Exception and swallowed it."""


class StopSignals:
    """SIGTERM / SIGINT of `xrec serve --ray`: each sets `stop`. Inside `interrupting()`
    the first one also raises Interrupted in the main thread: Serve waits for the replicas
    to run without a limit, and one the cluster cannot place never does."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._is_interrupting = False
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop.set()
        if self._is_interrupting:
            self._is_interrupting = False
            raise Interrupted(f"signal {signum}")

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        self._is_interrupting = True
        try:
            if self.stop.is_set():   # it came before
                raise Interrupted("a signal before the start")
            yield
        finally:
            self._is_interrupting = False

    def wait(self) -> None:
        while not self.stop.wait(0.5):   # short waits: the handler runs between them
            pass

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def serve_forever(options: ServeOptions, address: str | None, host: str, port: int) -> int:
    """`xrec serve --ray`: deploy, log the URL and the replicas, wait for SIGTERM / SIGINT,
    drain, then delete the application (and stop the local cluster this call started)."""
    import ray

    from xrec.scale.batch_ray import connect, started_cluster

    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    os.environ.setdefault(PROXY_CALLBACK_VARIABLE, PROXY_CALLBACK)   # a local cluster's proxy
    is_connected = connect(address)
    # Serve on a joined cluster is not ours to shut down (other applications use it)
    is_local = is_connected and started_cluster()
    signals = StopSignals()   # after ray.init, which installs its own SIGTERM handler (it exits at once)
    try:
        check_fits(options, ray.available_resources())
        start_serve(host, port)   # nothing of ours is deployed when this refuses
        is_drained = False
        try:
            is_drained = _serve_until_signal(options, host, port, signals)
        finally:
            _delete_app(is_drained, is_local)
    finally:
        if is_connected:
            ray.shutdown()
        signals.restore()
    return 0


def _delete_app(is_drained: bool, is_local: bool) -> None:
    """After the drain: delete the application (and Serve, on the local cluster). After a
    start that failed or was stopped, Serve would wait `grace_s` + 5 s for each replica it
    never placed: the local cluster goes at once with ray.shutdown, and on another cluster
    the deletion goes on without this process waiting."""
    from ray import serve

    if is_drained:
        serve.delete(APP_NAME)
        if is_local:
            serve.shutdown()
    elif not is_local:
        serve.delete(APP_NAME, _blocking=False)


def _serve_until_signal(options: ServeOptions, host: str, port: int, signals: StopSignals) -> bool:
    """True once drained after a signal; False when a signal stopped the start (the replicas
    already running drained)."""
    try:
        with signals.interrupting():
            deploy(options)
            infos = replica_infos(options.num_replicas)
    except Interrupted:
        # a replica that has started may be answering requests while Serve waits for another
        logger.info("xrec serve --ray: stopped while the replicas were starting; draining "
                    "those running (grace period %.1f s)", options.grace_s)
        drain(options.grace_s)
        return False
    display = f"[{host}]" if ":" in host else host
    logger.info("xrec serve --ray: model %s, %d replica(s) x %g CPU / %g GPU; listening on "
                "http://%s:%d (Ray Serve); SIGTERM stops", options.model_dir,
                options.num_replicas, options.replica_cpus, options.replica_gpus, display, port)
    for info in infos:
        logger.info("replica %s: pid %d, metrics %s", info["replica_id"], info["pid"],
                    info["metrics_url"] or "through the proxy only (an API key is set)")
    signals.wait()
    logger.info("xrec serve --ray: draining (grace period %.1f s)", options.grace_s)
    drain(options.grace_s)
    return True
