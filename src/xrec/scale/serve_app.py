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
- `max_ongoing_requests` = the engine's queue plus a full batch per pipeline
  (`request_queue_size + max_concurrency * max_seqs_per_batch`), so a full replica
  answers 429 from its own scheduler, as `xrec serve` does, and Serve never holds
  back a request the engine could still batch. Autoscaling (`max_replicas` above
  `num_replicas`) targets one full batch per pipeline ongoing per replica: more than
  that means requests wait in the engine's queue.
- Health: a replica is healthy while its engine accepts work (not closed, its
  scheduler thread alive); Serve's health check calls `check_health` and replaces a
  replica that fails it. `/health` through the proxy means what it means for
  `xrec serve` (200 serving; Serve routes only to replicas whose engine has loaded).
- A replica that dies is restarted by Serve; its in-flight requests are answered 500
  by the proxy, in plain text (the proxy writes that answer itself, outside any
  middleware), never left hanging; the other replicas are not affected.
- Metrics: `/metrics` through the proxy is the metrics of whichever replica answered;
  each replica also serves its own registry on an ephemeral port of its node
  (`replica_info()`: pid, replica id, metrics URL; `xrec serve --ray` logs them).
- Shutdown: SIGTERM / SIGINT deletes the application; each replica closes its
  engine with `grace_s` (Serve's graceful shutdown waits for requests in flight).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

logger = logging.getLogger("xrec.server")

APP_NAME = "xrec"
DEPLOYMENT_NAME = "XrecReplica"


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
        if self.grace_s < 0:
            raise ValueError(f"--grace-s: got {self.grace_s}, expected >= 0")
        if self.api_key is not None:
            from xrec.server.service import checked_api_key
            try:
                checked_api_key(self.api_key)
            except ValueError as e:
                raise ValueError(f"--api-key / XREC_API_KEY: {str(e)[len('api key: '):]}") from None

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_dir: str, engine_options: dict,
                  ) -> "ServeOptions":
        api_key = args.api_key if args.api_key is not None else os.environ.get("XREC_API_KEY")
        return cls(model_dir, args.catalog, engine_options, args.served_model_name, api_key,
                   args.max_body_bytes, args.grace_s, args.replicas, args.max_replicas,
                   args.replica_cpus, args.replica_gpus)

    def replica_engine_options(self) -> dict:
        """The engine options of one replica: its intra-op threads from its CPU share."""
        options = dict(self.engine_options)
        options.setdefault("num_threads", max(1, math.floor(self.replica_cpus)))
        if self.replica_gpus > 0 and options.get("device", "auto") == "auto":
            options["device"] = "cuda"
        return options

    def deployment_options(self) -> dict:
        """Serve's options of the deployment (see the module docstring for the mapping)."""
        from xrec.config import EngineOptions

        engine = EngineOptions.from_kwargs(**self.replica_engine_options())
        pipelines = engine.max_concurrency or (2 if self.replica_gpus > 0 else 1)
        per_batch = pipelines * engine.max_seqs_per_batch
        options: dict[str, Any] = {
            "name": DEPLOYMENT_NAME,
            "ray_actor_options": {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus},
            "max_ongoing_requests": engine.request_queue_size + per_batch,
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
                                  options.replica_engine_options(), owns_process=True)
        self.http_app = create_app(self.engine, served_model_name=options.served_model_name,
                              api_key=options.api_key, max_body_bytes=options.max_body_bytes)
        self._metrics_url = _serve_metrics(self.http_app.state.xrec.metrics.registry)

    def __serve_build_asgi_app__(self) -> Any:   # (`app` is Serve's own attribute)
        return self.http_app

    def check_health(self) -> None:
        """Serve's health check: raises while this replica's engine cannot take work."""
        if not self.engine.stats().is_serving:
            raise RuntimeError("the engine is closed or its scheduler has stopped")

    def replica_info(self) -> dict:
        """Who this replica is: pid, Serve's replica id, node, its own metrics URL."""
        from ray import serve

        context = serve.get_replica_context()
        return {"pid": os.getpid(), "replica_id": str(context.replica_id.unique_id),
                "metrics_url": self._metrics_url}

    def __del__(self) -> None:   # Serve's graceful shutdown: requests in flight have finished
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(self.options.grace_s)


def _serve_metrics(registry: Any) -> str:
    """This replica's registry over HTTP on an ephemeral port of its node; the URL."""
    import ray
    from prometheus_client import start_http_server

    host = ray.util.get_node_ip_address()
    server, _ = start_http_server(0, addr=host, registry=registry)
    return f"http://{host}:{server.server_port}/metrics"


def deployment(options: ServeOptions) -> Any:
    from ray import serve

    return serve.deployment(serve.ingress()(XrecReplica), **options.deployment_options())


def application(options: ServeOptions) -> Any:
    """The bound application (`serve.run(application(options))`)."""
    return deployment(options).bind(options)


def build_app(args: dict) -> Any:
    """Serve's application builder: `serve run xrec.scale.serve_app:build_app model=DIR
    replicas=2`, or `import_path: xrec.scale.serve_app:build_app` with `args:` in a Serve
    config file. Keys: the `ServeOptions` fields (`model` or `model_dir`, `replicas` for
    `num_replicas`) and engine options by name; a missing model is the demo model."""
    args = dict(args)
    names = {f.name for f in fields(ServeOptions)}
    from xrec.config import EngineOptions
    engine_types = {f.name: str(f.type) for f in fields(EngineOptions)}
    engine_names = set(engine_types)
    renames = {"model": "model_dir", "replicas": "num_replicas"}
    given: dict[str, Any] = {"engine_options": {}}
    for key, value in args.items():
        key = renames.get(key, key)
        if key in names and key != "engine_options":
            given[key] = value
        elif key in engine_names:
            given["engine_options"][key] = _typed(engine_types[key], value)
        else:
            raise ValueError(f"build_app: unknown argument {key!r}; allowed: "
                             f"{sorted(names - {'engine_options'} | set(renames) | engine_names)}")
    if "model_dir" not in given:
        from xrec.demo import demo_model_dir
        given["model_dir"] = str(demo_model_dir())
    for key in ("num_replicas", "max_replicas", "max_body_bytes"):
        if given.get(key) is not None:
            given[key] = int(given[key])
    for key in ("replica_cpus", "replica_gpus", "grace_s"):
        if given.get(key) is not None:
            given[key] = float(given[key])
    return application(ServeOptions(**given))


def _typed(kind: str, value: Any) -> Any:
    """`serve run key=value` gives text: numbers and booleans as the option's type."""
    if not isinstance(value, str) or value.lower() in ("none", "null"):
        return None if isinstance(value, str) else value
    if kind.startswith("bool"):
        return value.lower() in ("1", "true", "yes", "on")
    if kind.startswith("int"):
        return int(value)
    if kind.startswith("float"):
        return float(value)
    return value


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

def replica_infos(num_replicas: int, app_name: str = APP_NAME, timeout_s: float = 30.0) -> list[dict]:
    """`replica_info()` of every running replica (asked through the handle until each
    has answered; Serve's router spreads the calls), sorted by pid."""
    from ray import serve

    handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name)
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < num_replicas and time.monotonic() < deadline:
        info = handle.replica_info.remote().result(timeout_s=timeout_s)
        seen[info["pid"]] = info
    return sorted(seen.values(), key=lambda i: i["pid"])


def start(options: ServeOptions, host: str, port: int, app_name: str = APP_NAME) -> None:
    """Deploy on the connected cluster; returns once every replica has loaded its engine."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    serve.run(application(options), name=app_name, route_prefix="/", blocking=False)


def serve_forever(options: ServeOptions, address: str | None, host: str, port: int) -> int:
    """`xrec serve --ray`: deploy, log the URL and the replicas, wait for SIGTERM / SIGINT,
    then delete the application (and stop the local cluster this call started)."""
    import ray
    from ray import serve

    from xrec.scale.batch_ray import connect

    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    stop = threading.Event()
    os.environ.setdefault(PROXY_CALLBACK_VARIABLE, PROXY_CALLBACK)   # a local cluster's proxy
    is_local = connect(address)
    # after ray.init, which installs its own SIGTERM handler (it exits at once)
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        start(options, host, port)
        display = f"[{host}]" if ":" in host else host
        logger.info("xrec serve --ray: model %s, %d replica(s) x %g CPU / %g GPU; listening on "
                    "http://%s:%d (Ray Serve); SIGTERM stops", options.model_dir,
                    options.num_replicas, options.replica_cpus, options.replica_gpus, display, port)
        for info in replica_infos(options.num_replicas):
            logger.info("replica %s: pid %d, metrics %s", info["replica_id"], info["pid"],
                        info["metrics_url"])
        while not stop.wait(0.5):
            pass
        logger.info("xrec serve --ray: stopping (grace period %.1f s)", options.grace_s)
        serve.delete(APP_NAME)
        if is_local:
            serve.shutdown()
    finally:
        if is_local:
            ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
